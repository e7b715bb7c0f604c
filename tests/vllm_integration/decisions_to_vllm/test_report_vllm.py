"""The report of kvbroker's CachePolicy inside vLLM's real CPUOffloadingManager (vLLM 0.33,
marker ``vllm``): the Mooncake trace runs through the manager with ``kvbroker_metrics_port``
0 and ``kvbroker_status_file``; the metrics scraped over HTTP, the status file read by
``kvbroker vllm-status`` in a process of its own, and the exit line say the figures the
policy's ``snapshot()`` counts. In a forked engine core (vLLM's default), which leaves with
os._exit, the exit still writes the last figures."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]
CAPACITY = 256
REQUESTS = 300


def driver() -> Any:
    from tests.vllm_integration.decisions_to_vllm import manager_driver

    return manager_driver


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVBROKER_PURE_PYTHON": "1"}
    return subprocess.run([sys.executable, "-m", "broker.cli.main", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in text.splitlines()) if name.startswith("kvbroker_")}


def test_metrics_and_status_file_show_what_the_policy_counted_in_vllm(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vllm.kvbroker")
    pattern = str(tmp_path / "vllm-{pid}.json")
    manager = driver().kvbroker_manager("lru", CAPACITY, metrics_port=0, status_file=pattern, status_s=0.05)
    policy = manager._policy
    assert type(policy).__name__ == "KvbrokerCachePolicy"
    requests = list(driver().mooncake_requests(REQUESTS))
    hit, asked = driver().mooncake(manager, requests)
    snap = policy.snapshot()
    (row,) = snap["rows"]
    # vLLM's count of reuse (on_request_finished's reused_keys) and of store misses is, on
    # this trace, the driver's own: the prefix hits, and every chunk the requests named.
    assert (row["role"], row["policy"], row["capacity"], row["sample_rate"]) == ("decider", "lru", CAPACITY, 1.0)
    assert hit > 50 and (row["hits"], row["asked"]) == (hit, asked)
    assert row["hit_ratio"] == row["hits"] / row["asked"]

    labels = f'capacity="{CAPACITY}",policy="lru",role="decider",sample_rate="1"'
    got = scrape(policy.reporter.metrics_url)
    counters = policy.translator.counters()
    stats = policy.translator.stats
    assert counters["chunks_evicted"] == stats.chunks_evicted > 0 and counters["fallbacks"] == {}  # embedded: no fallback
    assert got == {
        f"kvbroker_vllm_hits_total{{{labels}}}": row["hits"],
        f"kvbroker_vllm_lookups_total{{{labels}}}": row["asked"],
        f"kvbroker_vllm_hit_ratio{{{labels}}}": row["hit_ratio"],
        "kvbroker_vllm_chunks_evicted_total": stats.chunks_evicted,
        "kvbroker_vllm_evictions_asked_total": stats.evictions_asked,
        "kvbroker_vllm_evictions_refused_total": stats.evictions_refused,
        "kvbroker_vllm_errors_total": 0,
        "kvbroker_vllm_journal_written_total": 0,  # no journal here
        "kvbroker_vllm_journal_pending": 0,
        "kvbroker_vllm_config_generation": 1,
    }

    policy.close()  # as at vLLM's exit: the last line and the last status file
    path = tmp_path / f"vllm-{os.getpid()}.json"
    done = cli("vllm-status", str(path), "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["rows"] == [row] and status["metrics_url"] == policy.reporter.metrics_url
    assert (status["client_id"], status["pid"], status["policy"], status["capacity"]) == ("vllm", os.getpid(), "lru", CAPACITY)
    table = cli("vllm-status", str(path))
    assert table.returncode == 0 and f"decider  lru     {CAPACITY}" in table.stdout, table.stdout
    # This policy's own lines (a policy another test left behind logs its minute line too).
    mine = f"kvbroker report (vllm): decider lru capacity {CAPACITY}:"
    last = [r.getMessage() for r in caplog.records if r.getMessage().startswith(mine)][-1]
    assert last == (
        f"kvbroker report (vllm): decider lru capacity {CAPACITY}: {row['hits']} hits / {row['asked']} asked, "
        f"hit ratio {row['hit_ratio']:.4f}"
    )


def test_a_bad_reporting_setting_stops_the_managers_build_naming_it() -> None:
    from vllm_integration.decisions_to_vllm.settings import SettingsError

    with pytest.raises(SettingsError, match=r"^kv_connector_extra_config\.kvbroker_metrics_port: expected a port in 0\.\.65535"):
        driver().kvbroker_manager("lru", CAPACITY, metrics_port=70000)


CHILD = """
import json, multiprocessing, sys
from tests.vllm_integration.decisions_to_vllm import manager_driver as d

def engine_core(status, figures):
    manager = d.kvbroker_manager("lru", 256, status_file=status, status_s=3600, report_s=3600)
    d.mooncake(manager, list(d.mooncake_requests(100)))
    with open(figures, "w") as f:
        json.dump(manager._policy.snapshot()["rows"], f)
    # returns: multiprocessing's fork child leaves with os._exit, no atexit handler runs

child = multiprocessing.get_context("fork").Process(target=engine_core, args=sys.argv[1:])
child.start()
child.join()
sys.exit(child.exitcode)
"""


def test_a_forked_engine_core_writes_its_last_figures_at_exit(tmp_path: Path) -> None:
    status, figures = tmp_path / "status.json", tmp_path / "figures.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVBROKER_PURE_PYTHON": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(status), str(figures)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(figures.read_text())
    assert rows[0]["hits"] > 0  # the start wrote zeros; status_s is an hour: only the exit wrote these
    assert json.loads(status.read_text())["rows"] == rows
