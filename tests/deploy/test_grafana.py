"""deploy/grafana/kvbroker.json against the metrics the code exports.

The names come from real scrapes: a running broker's /metrics (a primary and a shadow,
traffic, a file journal) and the Prometheus collector of kvbroker's CachePolicy inside vLLM,
fed by a real embedded core and translator that evicted and journaled. Every series a panel
queries must be exported, with every label it groups or filters by; every family exported
is on some panel; the figures the dashboard is for are there (hit ratio of the decider,
the shadows and the what-if sizes, evictions, journal lag, fallbacks); no query uses the
config generation as a label (it is the gauge kvbroker_config_generation).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from broker.config import parse_config
from broker.service.telemetry import TelemetryConfig
from tests.broker.service.test_health import free_port, ops_broker
from tests.broker.service.test_telemetry import drive
from tests.conftest import SMALL_TIERS
from tests.vllm_integration.decisions_to_vllm.test_policy_calls import drive as drive_translator
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.policy_calls import Translator
from vllm_integration.decisions_to_vllm.report import SnapshotCollector
from vllm_integration.decisions_to_vllm.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvbroker.json"
# Labels Prometheus adds to every series it scrapes, and the histogram bucket bound.
SCRAPE_LABELS = {"instance", "job", "le"}
METRIC = re.compile(r"\bkvbroker_[a-z_]+\b")
BY = re.compile(r"\bby\s*\(([^)]*)\)")
SELECTOR = re.compile(r"\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
LEGEND = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")

# An exposition: sample name -> label names; family name -> its sample names.
Exported = tuple[dict[str, set[str]], dict[str, set[str]]]


def parse(text: str) -> Exported:
    samples: dict[str, set[str]] = {}
    families: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
            families.setdefault(family.name, set()).add(sample.name)
    return samples, families


async def broker_exposition(tmp_path: Path) -> str:
    import urllib.request

    text = (
        f'[broker]\nlisten = "127.0.0.1:0"\n[policy]\nname = "lru"\nshadows = ["fifo"]\n'
        f'[journal]\nurl = "file://{tmp_path}/broker.journal"\n{SMALL_TIERS}'
    )
    async with ops_broker(parse_config(text), telemetry_config=TelemetryConfig(prometheus_port=free_port())) as broker:
        await drive(broker.target)
        url = broker.telemetry.metrics_url
        assert url is not None

        def get() -> str:
            with urllib.request.urlopen(url, timeout=10) as response:
                body: bytes = response.read()
                return body.decode()

        return await asyncio.to_thread(get)


class SidecarCounters:
    """Stands for the sidecar decider's counters (what the translator reads of it)."""

    def counters(self) -> dict[str, int]:
        return {"fallback_decisions": 3, "fallback_timeout": 2, "fallback_down": 1, "evictions_asked": 7}


def vllm_exposition(tmp_path: Path) -> str:
    settings = load_settings({"kvbroker_policy": "lru", "kvbroker_journal": f"file://{tmp_path}/vllm.journal"}, {})
    translator = Translator(EmbeddedCore(settings, 16))
    try:
        drive_translator(translator, random.Random(4), 400, 16)
        translator.flush()
        translator.decider = SidecarCounters()  # type: ignore[assignment]
        counters = translator.counters()
        assert counters["chunks_evicted"] > 0 and counters["journal_written"] > 0

        def snapshot() -> dict[str, Any]:
            rows = [
                {"role": role, "policy": "lru", "capacity": 16, "hits": 3, "asked": 4, "hit_ratio": 0.75, "sample_rate": 1.0}
                for role in ("decider", "shadow", "whatif")
            ]
            return {"client_id": "vllm-dp0", "rows": rows, "counters": counters}

        registry = CollectorRegistry(auto_describe=False)
        registry.register(SnapshotCollector(snapshot))
        return generate_latest(registry).decode()
    finally:
        translator.local.close()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    tmp = tmp_path_factory.mktemp("grafana")
    broker_samples, broker_families = parse(asyncio.run(broker_exposition(tmp)))
    vllm_samples, vllm_families = parse(vllm_exposition(tmp))
    samples = {**broker_samples, **vllm_samples}
    families = {name: names for name, names in {**broker_families, **vllm_families}.items() if name.startswith("kvbroker_")}
    return samples, families


def queries() -> list[tuple[str, str, str]]:
    """(panel title, expr, legendFormat) of every target."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"], target.get("legendFormat", "")))
    return out


def test_every_query_names_exported_series_and_labels(exported: Exported) -> None:
    samples, _ = exported
    assert queries()
    for title, expr, legend in queries():
        names = set(METRIC.findall(expr))
        assert names, f"{title}: {expr} queries no kvbroker series"
        unknown = sorted(names - set(samples))
        assert not unknown, f"{title}: {expr} queries series the code does not export: {unknown}"
        available = set().union(*(samples[n] for n in names)) | SCRAPE_LABELS
        used = {label.strip() for group in BY.findall(expr) for label in group.split(",") if label.strip()}
        used |= {m for selector in SELECTOR.findall(expr) for m in MATCHER.findall(selector)}
        used |= set(LEGEND.findall(legend))
        assert used <= available, f"{title}: {expr} uses labels {sorted(used - available)} its series do not have"


def test_every_exported_family_is_on_a_panel(exported: Exported) -> None:
    _, families = exported
    queried = {name for _, expr, _ in queries() for name in METRIC.findall(expr)}
    missing = sorted(family for family, names in families.items() if not names & queried)
    assert missing == [], f"exported, on no panel of {DASHBOARD.relative_to(ROOT)}: {missing}"


def test_the_figures_it_is_for_are_there() -> None:
    exprs = [expr for _, expr, _ in queries()]

    def queried(name: str, by: str = "") -> bool:
        return any(name in e and (not by or any(by in group for group in BY.findall(e))) for e in exprs)

    assert queried("kvbroker_vllm_hits_total", by="role")  # decider, shadows, what-if sizes
    assert queried("kvbroker_accesses_total", by="arm")  # the broker's primary and shadows
    assert queried("kvbroker_vllm_chunks_evicted_total") and queried("kvbroker_directives_total")  # evictions
    assert queried("kvbroker_vllm_journal_pending") and queried("kvbroker_journal_pending")  # journal lag
    assert queried("kvbroker_vllm_fallbacks_total", by="reason")  # fallbacks
    assert not any("config_generation" in label for e in exprs for group in BY.findall(e) for label in group.split(","))
    assert not any("config_generation" in s for e in exprs for s in SELECTOR.findall(e))


def test_the_vllm_counters_are_what_the_translator_counted(tmp_path: Path) -> None:
    text = vllm_exposition(tmp_path)
    values = {s.name + json.dumps(s.labels, sort_keys=True): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values['kvbroker_vllm_fallbacks_total{"reason": "timeout"}'] == 2
    assert values['kvbroker_vllm_fallbacks_total{"reason": "down"}'] == 1
    assert 'kvbroker_vllm_fallbacks_total{"reason": "decisions"}' not in values  # the total is no reason
    assert values["kvbroker_vllm_journal_pending{}"] == 0  # flushed
    assert values["kvbroker_vllm_journal_written_total{}"] > 0
    assert values["kvbroker_vllm_chunks_evicted_total{}"] > 0
    assert values["kvbroker_vllm_evictions_asked_total{}"] >= values["kvbroker_vllm_evictions_refused_total{}"]
    assert values["kvbroker_vllm_config_generation{}"] == 1
