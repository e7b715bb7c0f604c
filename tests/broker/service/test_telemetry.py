"""Metrics, traces and logs of a real broker: /metrics scraped over HTTP, OTLP into a fake
collector on a loopback port, JSON log lines."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import socket
import sys
import time
import tomllib
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from broker.config import ConfigError, PolicyConfig, parse_config
from broker.config.telemetry import telemetry_config_from_dict
from broker.logs import JsonFormatter, redact_text, setup_logging
from broker.model.core import Core
from broker.service import telemetry as telemetry_mod
from broker.service.telemetry import TelemetryConfig
from clients.admin import get_stats
from clients.broker_client import BrokerClient
from kvbroker.v1 import broker_service_pb2 as spb
from tests.broker.service.test_health import OpsBroker, free_port, ops_broker
from tests.conftest import SMALL_TIERS, small_config

Labels = frozenset[tuple[str, str]]


def scrape(url: str) -> dict[tuple[str, Labels], float]:
    """Every sample of a /metrics page: (sample name, labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value for family in text_string_to_metric_families(text) for s in family.samples}


def labels(**kv: str) -> Labels:
    return frozenset(kv.items())


def series(samples: dict[tuple[str, Labels], float], name: str) -> dict[Labels, float]:
    return {lab: v for (n, lab), v in samples.items() if n == name}


async def drive(target: str, client_id: str = "engine-1", first_block: int = 0) -> None:
    """20 allocations of 100 bytes in 4 batches of 5, then one batch: 2 accesses and 1 bad event."""
    async with BrokerClient(target, client_id, max_batch_events=5) as client:
        for i in range(first_block, first_block + 20):
            await client.allocate(f"b{i}", 100, ts_us=i + 1, request_id="r")
        await client.flush()
        await client.access([f"b{first_block}", f"b{first_block + 19}"], ts_us=1000)
        await client.access(["no-such-block"], ts_us=1001)
        await client.flush()


@pytest.fixture
async def metered(tmp_path: Path) -> AsyncIterator[OpsBroker]:
    config = small_config(journal_url=f"file://{tmp_path}/broker.journal")
    async with ops_broker(config, telemetry_config=TelemetryConfig(prometheus_port=free_port())) as broker:
        yield broker


async def test_scraped_metrics_equal_what_was_sent_and_what_the_broker_reports(metered: OpsBroker) -> None:
    await drive(metered.target)
    await metered.journal.flush()
    url = metered.telemetry.metrics_url
    assert url is not None and url.startswith("http://127.0.0.1:")  # bound to loopback by default
    samples = await asyncio.to_thread(scrape, url)
    stats: spb.GetStatsResponse = await asyncio.to_thread(get_stats, metered.target)
    gen1 = {"policy": "lru"}

    events = series(samples, "kvbroker_events_total")
    # What the client sent...
    assert events[labels(kind="allocated", **gen1)] == 20
    # ...and, for every kind (zeros included), exactly what the broker counts.
    assert events == {labels(kind=k, **gen1): v for k, v in stats.events.items()}
    arm = {"arm": "primary", **gen1}
    directives = series(samples, "kvbroker_directives_total")
    assert directives == {labels(kind=k, **arm): v for k, v in stats.directives.items()}
    assert directives[labels(kind="demote", **arm)] > 0  # 2,000 bytes into a 1,000-byte top tier

    # Accesses by serving tier: b19 was still in hbm (a hit), b0 had been demoted (a miss).
    accesses = series(samples, "kvbroker_accesses_total")
    assert accesses[labels(tier="hbm", result="hit", **arm)] == 1
    assert accesses[labels(tier="dram", result="miss", **arm)] == 1
    assert {dict(lab)["tier"]: v for lab, v in accesses.items()} == {(k or "dropped"): v for k, v in stats.accesses_by_tier.items()}
    assert series(samples, "kvbroker_rejected_events_total") == {labels(**gen1): 1}
    assert series(samples, "kvbroker_batches_total") == {labels(**gen1): 5}
    assert series(samples, "kvbroker_decode_critical_accesses_total") == {labels(**arm): 0}

    # Occupancy now, per tier, as GetStats says.
    for tier in stats.tiers:
        assert series(samples, "kvbroker_tier_bytes")[labels(tier=tier.name)] == tier.bytes
        assert series(samples, "kvbroker_tier_blocks")[labels(tier=tier.name)] == tier.blocks
        assert series(samples, "kvbroker_tier_capacity_bytes")[labels(tier=tier.name)] == tier.capacity_bytes
    assert sum(series(samples, "kvbroker_tier_blocks").values()) == 20

    # One decision-time observation per batch, all under 1 s.
    assert series(samples, "kvbroker_batch_seconds_count") == {labels(**gen1): 5}
    buckets = series(samples, "kvbroker_batch_seconds_bucket")
    assert buckets[labels(le="1.0", **gen1)] == 5 and buckets[labels(le="+Inf", **gen1)] == 5
    assert 0 < series(samples, "kvbroker_batch_seconds_sum")[labels(**gen1)] < 5

    # The journal: every record written (config + 5 batches + directive records), none waiting.
    assert series(samples, "kvbroker_journal_written_total") == {labels(): metered.journal.written}
    assert metered.journal.written >= 6
    assert series(samples, "kvbroker_journal_pending") == {labels(): 0}
    assert series(samples, "kvbroker_journal_errors_total") == {labels(): 0}
    assert series(samples, "kvbroker_config_generation") == {labels(policy="lru"): 1}


async def test_a_policy_swap_starts_new_series_and_never_rewrites_the_old_ones(metered: OpsBroker) -> None:
    await drive(metered.target)
    url = metered.telemetry.metrics_url
    assert url is not None
    before = await asyncio.to_thread(scrape, url)
    # What a reload does to the service: a new core, another policy, the next generation.
    service = metered.service
    service.driving.core = Core(dataclasses.replace(service.config.core, policy=PolicyConfig("fifo")), generation=2)
    await drive(metered.target, client_id="engine-2", first_block=100)
    after = await asyncio.to_thread(scrape, url)

    old = labels(kind="allocated", policy="lru")
    new = labels(kind="allocated", policy="fifo")
    events = series(after, "kvbroker_events_total")
    assert events[old] == series(before, "kvbroker_events_total")[old] == 20
    assert events[new] == 20
    assert series(after, "kvbroker_config_generation") == {labels(policy="fifo"): 2}
    assert series(after, "kvbroker_batch_seconds_count") == {
        labels(policy="lru"): 5,
        labels(policy="fifo"): 5,
    }
    # Counters never go down across the swap.
    for key, value in before.items():
        if key[0].endswith("_total"):
            assert after[key] >= value, key


async def test_a_reload_with_a_shadow_gives_new_labels_and_a_shadow_arm(tmp_path: Path) -> None:
    def config_text(policy: str, shadows: str = "") -> str:
        journal = f'[journal]\nurl = "file://{tmp_path}/broker.journal"\n'
        return f'[broker]\nlisten = "127.0.0.1:0"\n[policy]\nname = "{policy}"\n{shadows}\n{journal}{SMALL_TIERS}'

    config = parse_config(config_text("lru"))
    async with ops_broker(config, telemetry_config=TelemetryConfig(prometheus_port=free_port())) as broker:
        url = broker.telemetry.metrics_url
        assert url is not None
        await drive(broker.target)
        before = await asyncio.to_thread(scrape, url)
        # The admin RPC, SIGHUP and the file watcher all call service.reload.
        reply = broker.service.reload(config_text("fifo", 'shadows = ["lru"]'))
        assert reply.ok, reply.error
        assert (reply.policy, reply.config_generation) == ("fifo", 2)
        await drive(broker.target, client_id="engine-2", first_block=100)
        # The lru shadow is copied off the event loop and reports once it has caught up
        # (broker.service.shadow_builds): scrape after it joined (under load it had not).
        deadline = time.monotonic() + 60
        while broker.service.shadow_builds and time.monotonic() < deadline:
            broker.service.advance_shadow_builds()
            await asyncio.sleep(0.01)
        assert not broker.service.shadow_builds
        after = await asyncio.to_thread(scrape, url)
        stats: spb.GetStatsResponse = await asyncio.to_thread(get_stats, broker.target)

    events = series(after, "kvbroker_events_total")
    old = labels(kind="allocated", policy="lru")
    assert events[old] == series(before, "kvbroker_events_total")[old] == 20
    assert events[labels(kind="allocated", policy="fifo")] == 20
    assert not any(dict(lab).get("arm") for lab in events)  # events are the same for every arm
    assert series(after, "kvbroker_config_generation") == {labels(policy="fifo"): 2}
    assert series(after, "kvbroker_config_reloads_total") == {labels(): 1}
    # Accesses per arm add up to what GetStats reports per arm: the primary's since its policy
    # took over (kvbroker ab's counters per policy in force), and lru's before it.
    accesses = series(after, "kvbroker_accesses_total")
    per_arm: dict[tuple[str, str], float] = {}
    for lab, value in accesses.items():
        d = dict(lab)
        per_arm[d["arm"], d["policy"]] = per_arm.get((d["arm"], d["policy"]), 0) + value
    arms = {(a.role, a.policy): a.accesses for a in stats.arms}
    assert arms == {("primary", "fifo"): 2, ("shadow", "lru"): 2}
    assert per_arm[("primary", "fifo")] == arms[("primary", "fifo")]
    assert per_arm[("primary", "lru")] == 2
    assert per_arm[("shadow", "lru")] == arms[("shadow", "lru")]
    assert not any("config_generation" in dict(lab) for lab in accesses)
    shadow_directives = {lab for lab in series(after, "kvbroker_directives_total") if dict(lab)["arm"] == "shadow"}
    assert {dict(lab)["kind"] for lab in shadow_directives} == {"evict", "demote", "promote", "prefetch"}


async def test_a_reload_that_keeps_the_policy_starts_no_new_series(tmp_path: Path) -> None:
    """The config generation is a gauge, not a label: reloads (here two, the policy kept, the
    DRAM tier resized) add to the same series instead of starting new ones at every reload."""
    journal = f'[journal]\nurl = "file://{tmp_path}/broker.journal"\n'
    text = f'[broker]\nlisten = "127.0.0.1:0"\n[policy]\nname = "lru"\n{journal}{SMALL_TIERS}'
    async with ops_broker(parse_config(text), telemetry_config=TelemetryConfig(prometheus_port=free_port())) as broker:
        url = broker.telemetry.metrics_url
        assert url is not None
        await drive(broker.target)
        before = await asyncio.to_thread(scrape, url)
        for dram in ("3000", "2000"):
            reply = broker.service.reload(text.replace("capacity = 2000", f"capacity = {dram}"))
            assert reply.ok, reply.error
        await drive(broker.target, client_id="engine-2", first_block=100)
        after = await asyncio.to_thread(scrape, url)
    assert series(after, "kvbroker_config_generation") == {labels(policy="lru"): 3}
    names = {name for name, _ in after if name != "kvbroker_config_generation"}
    for name in names:
        assert set(series(after, name)) == set(series(before, name)), name  # the same label sets
    assert series(after, "kvbroker_events_total")[labels(kind="allocated", policy="lru")] == 40
    assert series(after, "kvbroker_batches_total") == {labels(policy="lru"): 10}


async def test_stop_unhooks_the_batch_path_and_closes_the_metrics_port(tmp_path: Path) -> None:
    config = small_config()
    async with ops_broker(config, telemetry_config=TelemetryConfig(prometheus_port=free_port())) as broker:
        assert {"submit", "reload"} <= set(broker.service.__dict__)  # the timing and reload hooks
        url = broker.telemetry.metrics_url
        assert url is not None
        await broker.telemetry.stop()
        assert not {"submit", "reload"} & set(broker.service.__dict__)
        with pytest.raises(OSError):
            await asyncio.to_thread(scrape, url)
        await drive(broker.target)  # the broker runs on without telemetry


async def test_a_taken_metrics_port_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"telemetry: cannot serve /metrics on 127.0.0.1:{port}"):
            async with ops_broker(small_config(), telemetry_config=TelemetryConfig(prometheus_port=port)):
                pass


# ---- OTLP: a fake collector on a loopback port ------------------------------------------------------


class FakeCollector(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.metrics: list[Any] = []

    async def Export(self, request: Any, context: Any) -> Any:  # both services name their RPC Export
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            self.spans.extend(s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()
        self.metrics.extend(m for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics)
        return metrics_service_pb2.ExportMetricsServiceResponse()


@pytest.fixture
async def collector() -> AsyncIterator[tuple[FakeCollector, int]]:
    fake = FakeCollector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(fake, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield fake, port
    finally:
        await server.stop(0)


def _attrs(kvs: Any) -> dict[str, Any]:
    out = {}
    for kv in kvs:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


async def test_otlp_gets_a_span_per_batch_and_the_metrics(collector: tuple[FakeCollector, int]) -> None:
    fake, port = collector
    tc = TelemetryConfig(otlp_endpoint=f"http://127.0.0.1:{port}", traces=True, export_interval_ms=60_000)
    broker_ops = ops_broker(small_config(), telemetry_config=tc)
    async with broker_ops as broker:
        async with BrokerClient(broker.target, "engine-1", max_batch_events=5) as client:
            for i in range(12):
                await client.allocate(f"b{i}", 100, ts_us=i + 1)
            await client.flush()
        await broker.telemetry.stop()  # flushes the spans and pushes the metrics once more

    spans = [s for s in fake.spans if s.name == "kvbroker.batch"]
    assert len(spans) == 3
    attrs = sorted((_attrs(s.attributes) for s in spans), key=lambda a: a["kvbroker.batch_seq"])
    assert [a["kvbroker.batch_seq"] for a in attrs] == [1, 2, 3]
    assert [a["kvbroker.events"] for a in attrs] == [5, 5, 2]
    assert all(a["kvbroker.client_id"] == "engine-1" and a["kvbroker.policy"] == "lru" for a in attrs)
    assert all(a["kvbroker.config_generation"] == 1 and a["kvbroker.duplicate"] is False for a in attrs)
    assert sum(a["kvbroker.directives"] for a in attrs) > 0  # 1,200 bytes into 1,000

    events = [m for m in fake.metrics if m.name == "kvbroker_events_total"]
    assert events, [m.name for m in fake.metrics]
    points = {(_attrs(p.attributes)["kind"], _attrs(p.attributes)["policy"]): p.as_int for p in events[-1].sum.data_points}
    assert points[("allocated", "lru")] == 12
    assert events[-1].sum.is_monotonic
    assert any(m.name == "kvbroker_batch_seconds" and m.histogram.data_points[0].count == 3 for m in fake.metrics)


async def test_otlp_configured_without_its_package_is_refused_naming_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.metric_exporter", None)
    with pytest.raises(ConfigError, match=r"telemetry\.otlp_endpoint: .*opentelemetry-exporter-otlp-proto-grpc"):
        async with ops_broker(small_config(), telemetry_config=TelemetryConfig(otlp_endpoint="http://127.0.0.1:4317")):
            pass
    # Without OTLP configured the package is never looked for; with no exporter at all
    # (the defaults) the batch path is not even wrapped.
    async with ops_broker(small_config(), telemetry_config=TelemetryConfig()) as broker:
        assert broker.telemetry.metrics_port is None and broker.telemetry.metrics_url is None
        assert "submit" not in broker.service.__dict__
        await drive(broker.target)


# ---- config ------------------------------------------------------------------------------------------


def test_telemetry_config_defaults_and_values() -> None:
    assert telemetry_config_from_dict({}) == TelemetryConfig()
    assert TelemetryConfig().prometheus_host == "127.0.0.1" and TelemetryConfig().prometheus_port == 0
    parsed = telemetry_config_from_dict(
        {
            "prometheus_host": "0.0.0.0",
            "prometheus_port": 9464,
            "otlp_endpoint": "http://otel-collector:4317",
            "otlp_protocol": "grpc",
            "otlp_metrics": False,
            "export_interval_ms": 5000,
            "traces": True,
            "traces_sample_ratio": 1,
            "service_name": "kvbroker-node-7",
            "log_format": "json",
        }
    )
    assert parsed.prometheus_port == 9464 and parsed.traces and parsed.traces_sample_ratio == 1.0
    assert parsed.log_format == "json" and not parsed.otlp_metrics


def test_telemetry_config_round_trips_through_its_toml_table() -> None:
    for tc in (
        TelemetryConfig(),
        TelemetryConfig("0.0.0.0", 9464, "http://otel:4317", "http/protobuf", False, 500, True, 0.25, 'k"v', "json"),
    ):
        assert telemetry_config_from_dict(tomllib.loads("\n".join(tc.toml_lines()))["telemetry"]) == tc


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"prometheus_port": "9464"}, "telemetry.prometheus_port: expected int"),
        ({"prometheus_port": True}, "telemetry.prometheus_port: expected int"),
        ({"prometheus_port": 70000}, "telemetry.prometheus_port: must be in 0..65535"),
        ({"prometheus_host": ""}, "telemetry.prometheus_host: must be non-empty"),
        ({"otlp_endpoint": "otel:4317"}, "telemetry.otlp_endpoint: expected http://HOST:PORT"),
        ({"otlp_endpoint": "https://user:s3cret@otel:4317"}, "telemetry.otlp_endpoint: must not carry credentials"),
        ({"otlp_protocol": "thrift"}, "telemetry.otlp_protocol: must be one of grpc, http/protobuf"),
        ({"export_interval_ms": 0}, "telemetry.export_interval_ms: must be > 0"),
        ({"traces": True}, "telemetry.traces: spans are exported over OTLP"),
        ({"traces": "yes"}, "telemetry.traces: expected bool"),
        ({"traces_sample_ratio": 1.5, "traces": False}, r"telemetry.traces_sample_ratio: must be in \[0, 1\]"),
        ({"log_format": "xml"}, "telemetry.log_format: must be one of text, json"),
        ({"metrics_port": 9464}, r"unknown key\(s\) telemetry.metrics_port"),
    ],
)
def test_telemetry_config_errors_name_the_key(table: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        telemetry_config_from_dict(table)
    assert "s3cret" not in str(error.value)


# ---- logs ---------------------------------------------------------------------------------------------


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """The root logger, its handlers and level put back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def test_json_logs_are_one_object_per_line_with_extra_fields_and_no_secrets(root_logger: logging.Logger) -> None:
    stream = io.StringIO()
    handler = setup_logging("info", "json", stream=stream)
    try:
        log = logging.getLogger("kvbroker.test")
        log.info("journal %s ready", "redis://:hunter2@redis:6379/0", extra={"port": 50051, "password": "hunter2"})
        log.debug("not at info level")
        try:
            raise RuntimeError("cannot reach redis://admin:hunter2@redis:6379/0")
        except RuntimeError:
            log.exception("write failed", extra={"url": "rediss://admin:hunter2@redis:6380/1"})
    finally:
        root_logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and "hunter2" not in stream.getvalue()
    first, second = (json.loads(line) for line in lines)
    assert set(first) == {"ts", "level", "logger", "msg", "port", "password"}
    assert first["level"] == "info" and first["logger"] == "kvbroker.test" and first["ts"].endswith("Z")
    assert first["msg"] == "journal redis://:***@redis:6379/0 ready"
    assert first["port"] == 50051 and first["password"] == "***"
    assert second["level"] == "error" and second["url"] == "rediss://admin:***@redis:6380/1"
    assert "RuntimeError: cannot reach redis://admin:***@redis:6379/0" in second["exc"]


def test_text_logs_hide_passwords_too_and_unknown_formats_are_refused(root_logger: logging.Logger) -> None:
    stream = io.StringIO()
    handler = setup_logging("warning", "text", stream=stream)
    try:
        logging.getLogger("kvbroker.test").warning("to %s", "redis://u:pw@h:1/0")
    finally:
        root_logger.removeHandler(handler)
    assert stream.getvalue().rstrip().endswith("WARNING kvbroker.test: to redis://u:***@h:1/0")
    assert redact_text("no url here @ all") == "no url here @ all"
    assert isinstance(JsonFormatter(), logging.Formatter)
    with pytest.raises(ValueError, match="log format must be one of text, json"):
        setup_logging("info", "xml")


def test_install_reads_the_telemetry_field_of_a_broker_config_once_wired() -> None:
    # Until config.py carries a `telemetry` field, install falls back to the defaults.
    assert telemetry_mod._telemetry_of(small_config()) == TelemetryConfig()
    assert telemetry_mod._telemetry_of(TelemetryConfig(prometheus_port=1)).prometheus_port == 1
