"""vllm_integration/decisions_to_vllm/report.py with a fake snapshot: the log lines, the status file
(written whole, rewritten, and at close), the Prometheus metrics scraped over HTTP, and the
errors of a port or a path that cannot be used."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm_integration.decisions_to_vllm.report import Reporter, report_line
from vllm_integration.decisions_to_vllm.settings import OffloadSettings, SettingsError


class FakePolicy:
    """Stands for KvbrokerCachePolicy: a snapshot() whose figures a test changes."""

    def __init__(self) -> None:
        self.hits = 30
        self.calls = 0
        self.broken = False

    def snapshot(self) -> dict[str, Any]:
        self.calls += 1
        if self.broken:
            raise RuntimeError("the shadows are being rebuilt")
        return {
            "client_id": "vllm-dp0",
            "pid": os.getpid(),
            "time": time.time(),
            "policy": "history_arc",
            "capacity": 100,
            "rows": [
                {"role": "decider", "policy": "history_arc", "capacity": 100, "hits": self.hits, "asked": 120,
                 "hit_ratio": self.hits / 120, "sample_rate": 1.0},
                {"role": "shadow", "policy": "lru", "capacity": 100, "hits": 20, "asked": 120, "hit_ratio": 20 / 120, "sample_rate": 1.0},
                {"role": "whatif", "policy": "history_arc", "capacity": 400, "hits": 9, "asked": 12, "hit_ratio": 0.75, "sample_rate": 0.1},
            ],
        }  # fmt: skip


@pytest.fixture
def reporters() -> Iterator[Callable[..., Reporter]]:
    """Reporters made by the test, closed after it (a failed assertion leaves no thread)."""
    made: list[Reporter] = []

    def make(policy: FakePolicy, **settings: Any) -> Reporter:
        reporter = Reporter(policy.snapshot, OffloadSettings(**settings))
        made.append(reporter)
        return reporter

    yield make
    for reporter in made:
        reporter.close()


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.01)


def report_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vllm.kvbroker" and r.getMessage().startswith("kvbroker report")]


def test_a_line_per_interval_naming_every_row_and_one_at_close(caplog: pytest.LogCaptureFixture, reporters: Any) -> None:
    caplog.set_level(logging.INFO, logger="vllm.kvbroker")
    policy = FakePolicy()
    reporter = reporters(policy, report_s=0.05)
    wait_for(lambda: len(report_lines(caplog)) >= 2)
    line = report_lines(caplog)[0]
    assert line == (
        "kvbroker report (vllm-dp0): decider history_arc capacity 100: 30 hits / 120 asked, hit ratio 0.2500; "
        "shadow lru capacity 100: 20 hits / 120 asked, hit ratio 0.1667; "
        "whatif history_arc capacity 400: 9 hits / 12 asked, hit ratio 0.7500, sampled 0.1"
    )
    assert all(r.levelno == logging.INFO for r in caplog.records if r.getMessage().startswith("kvbroker report"))
    # The timing thread does the periodic work, not the caller's.
    assert {r.threadName for r in caplog.records if r.getMessage().startswith("kvbroker report")} == {"kvbroker-report"}
    policy.hits = 60
    reporter.close()
    last = report_lines(caplog)[-1]
    assert last.startswith("kvbroker report (vllm-dp0): decider history_arc capacity 100: 60 hits / 120 asked, hit ratio 0.5000")
    after = len(report_lines(caplog))
    time.sleep(0.2)
    reporter.close()  # idempotent: no second exit line
    assert len(report_lines(caplog)) == after
    assert not reporter._thread.is_alive()


def test_with_a_long_interval_only_the_exit_line_is_logged(caplog: pytest.LogCaptureFixture, reporters: Any) -> None:
    caplog.set_level(logging.INFO, logger="vllm.kvbroker")
    reporter = reporters(FakePolicy())  # the default, 60 s
    time.sleep(0.3)
    assert report_lines(caplog) == []
    reporter.close()
    assert len(report_lines(caplog)) == 1


def test_a_snapshot_that_raises_is_logged_once_and_reporting_goes_on(caplog: pytest.LogCaptureFixture, reporters: Any) -> None:
    caplog.set_level(logging.INFO, logger="vllm.kvbroker")
    policy = FakePolicy()
    policy.broken = True
    reporter = reporters(policy, report_s=0.02)
    wait_for(lambda: policy.calls >= 5)
    errors = [r for r in caplog.records if "could not be read" in r.getMessage()]
    assert len(errors) == 1 and errors[0].exc_info is not None
    policy.broken = False
    wait_for(lambda: len(report_lines(caplog)) >= 1)
    reporter.close()


def test_the_status_file_is_written_at_start_rewritten_whole_and_at_close(tmp_path: Path, reporters: Any) -> None:
    policy = FakePolicy()
    reporter = reporters(policy, status_file=str(tmp_path / "vllm-{pid}-{rank}.json"), status_s=0.01, rank=3)
    path = tmp_path / f"vllm-{os.getpid()}-3.json"
    assert reporter.status_file == str(path)
    first = json.loads(path.read_text())
    assert first["rows"][0]["hits"] == 30 and first["client_id"] == "vllm-dp0" and "metrics_url" not in first
    # A reader that reads as fast as it can while the writer rewrites every 10 ms: each read
    # is a whole file (rename over it), never a half-written one.
    last_inode, replaced = -1, 0
    stop = time.monotonic() + 1.0
    reads = 0
    while time.monotonic() < stop:
        with path.open("rb") as f:
            inode = os.fstat(f.fileno()).st_ino
            assert json.loads(f.read())["rows"][2]["sample_rate"] == 0.1
        replaced += inode != last_inode  # a new file renamed over the old one (tmpfs reuses numbers)
        last_inode = inode
        reads += 1
    assert replaced > 10, "the file was not replaced as it was rewritten"
    policy.hits = 77
    wait_for(lambda: json.loads(path.read_text())["rows"][0]["hits"] == 77)
    reporter.close()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind
    assert reads > 50


def test_the_exit_writes_the_last_figures(tmp_path: Path, reporters: Any) -> None:
    policy = FakePolicy()
    path = tmp_path / "status.json"
    reporter = reporters(policy, status_file=str(path), status_s=3600)
    policy.hits = 99
    assert json.loads(path.read_text())["rows"][0]["hits"] == 30  # the start's write only
    reporter.close()
    assert json.loads(path.read_text())["rows"][0]["hits"] == 99


def test_a_status_file_that_stops_being_writable_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture, reporters: Any) -> None:
    caplog.set_level(logging.INFO, logger="vllm.kvbroker")
    folder = tmp_path / "d"
    folder.mkdir()
    policy = FakePolicy()
    reporters(policy, status_file=str(folder / "s.json"), status_s=0.01)
    (folder / "s.json").unlink()
    folder.rmdir()  # the folder goes (a tmpfs cleaned): every write fails
    wait_for(lambda: any("not written" in r.getMessage() for r in caplog.records))
    calls = policy.calls
    wait_for(lambda: policy.calls > calls + 5)
    assert sum("not written" in r.getMessage() for r in caplog.records) == 1
    folder.mkdir()
    wait_for(lambda: any("written again" in r.getMessage() for r in caplog.records))
    assert (folder / "s.json").exists()


def test_a_status_file_that_cannot_be_written_stops_the_start_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as caught:
        Reporter(FakePolicy().snapshot, OffloadSettings(status_file=str(tmp_path / "missing" / "s.json")))
    assert str(caught.value) == f"kvbroker_status_file: cannot write {tmp_path / 'missing' / 's.json'}: No such file or directory"


def scrape_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        assert answer.status == 200
        return str(answer.read().decode())


def scrape(url: str) -> dict[tuple[str, str, str, str, str], float]:
    """The kvbroker samples of a /metrics page: (name, role, policy, capacity, sample_rate) -> value."""
    samples = {}
    for family in text_string_to_metric_families(scrape_text(url)):
        for s in family.samples:
            if s.name.startswith("kvbroker_vllm_"):
                labels = s.labels
                samples[(s.name, labels["role"], labels["policy"], labels["capacity"], labels["sample_rate"])] = s.value
    return samples


def test_metrics_are_served_on_an_ephemeral_port_read_at_scrape_time(caplog: pytest.LogCaptureFixture, reporters: Any) -> None:
    caplog.set_level(logging.INFO, logger="vllm.kvbroker")
    policy = FakePolicy()
    reporter = reporters(policy, metrics_port=0)
    assert reporter.metrics_port and reporter.metrics_url == f"http://127.0.0.1:{reporter.metrics_port}/metrics"
    assert any(r.getMessage() == f"kvbroker metrics: {reporter.metrics_url}" for r in caplog.records)  # port 0: said
    # The exposition's own lines (labels sorted by name):
    lines = scrape_text(reporter.metrics_url).splitlines()
    assert 'kvbroker_vllm_hits_total{capacity="100",policy="history_arc",role="decider",sample_rate="1"} 30.0' in lines
    assert 'kvbroker_vllm_lookups_total{capacity="400",policy="history_arc",role="whatif",sample_rate="0.1"} 12.0' in lines
    assert "# TYPE kvbroker_vllm_hit_ratio gauge" in lines and "# TYPE kvbroker_vllm_hits_total counter" in lines
    got = scrape(reporter.metrics_url)
    assert got == {
        ("kvbroker_vllm_hits_total", "decider", "history_arc", "100", "1"): 30.0,
        ("kvbroker_vllm_lookups_total", "decider", "history_arc", "100", "1"): 120.0,
        ("kvbroker_vllm_hit_ratio", "decider", "history_arc", "100", "1"): 0.25,
        ("kvbroker_vllm_hits_total", "shadow", "lru", "100", "1"): 20.0,
        ("kvbroker_vllm_lookups_total", "shadow", "lru", "100", "1"): 120.0,
        ("kvbroker_vllm_hit_ratio", "shadow", "lru", "100", "1"): 20 / 120,
        ("kvbroker_vllm_hits_total", "whatif", "history_arc", "400", "0.1"): 9.0,
        ("kvbroker_vllm_lookups_total", "whatif", "history_arc", "400", "0.1"): 12.0,
        ("kvbroker_vllm_hit_ratio", "whatif", "history_arc", "400", "0.1"): 0.75,
    }
    policy.hits = 45  # read at the scrape, not cached
    assert scrape(reporter.metrics_url)[("kvbroker_vllm_hits_total", "decider", "history_arc", "100", "1")] == 45.0
    # Its own registry: the process's global one (vLLM's metrics) does not have them.
    assert prometheus_client.REGISTRY.get_sample_value("kvbroker_vllm_hits_total", {"role": "decider"}) is None
    reporter.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(reporter.metrics_url, timeout=2)


def test_a_scrape_while_the_snapshot_raises_is_answered_without_figures(reporters: Any) -> None:
    policy = FakePolicy()
    reporter = reporters(policy, metrics_port=0)
    policy.broken = True
    assert scrape(reporter.metrics_url) == {}
    policy.broken = False
    assert len(scrape(reporter.metrics_url)) == 9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_data_parallel_rank_serves_on_the_port_plus_its_rank(reporters: Any) -> None:
    port = free_port()
    reporter = reporters(FakePolicy(), metrics_port=port - 2, rank=2)
    assert reporter.metrics_port == port
    assert len(scrape(reporter.metrics_url)) == 9


def test_a_port_in_use_stops_the_start_naming_the_key() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(SettingsError) as caught:
            Reporter(FakePolicy().snapshot, OffloadSettings(metrics_port=port))
    assert str(caught.value) == f"kvbroker_metrics_port: cannot serve metrics on 127.0.0.1:{port}: Address already in use"


def test_a_host_that_does_not_resolve_stops_the_start_naming_the_key() -> None:
    with pytest.raises(SettingsError, match=r"^kvbroker_metrics_port: cannot serve metrics on no-such-host\.invalid:0: "):
        Reporter(FakePolicy().snapshot, OffloadSettings(metrics_port=0, metrics_host="no-such-host.invalid"))


def test_a_rank_past_the_last_port_is_refused() -> None:
    with pytest.raises(SettingsError, match=r"^kvbroker_metrics_port: 65535 \+ rank 1 is past 65535$"):
        Reporter(FakePolicy().snapshot, OffloadSettings(metrics_port=65535, rank=1))


def test_close_from_several_threads_reports_once(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    caplog.set_level(logging.INFO, logger="vllm.kvbroker")
    reporter = Reporter(FakePolicy().snapshot, OffloadSettings(metrics_port=0, status_file=str(tmp_path / "s.json")))
    threads = [threading.Thread(target=reporter.close) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(report_lines(caplog)) == 1


def test_an_empty_snapshot_says_so() -> None:
    assert report_line({"client_id": "c", "rows": []}) == "kvbroker report (c): no rows"
