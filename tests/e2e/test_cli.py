"""The `kvbroker` command as users run it: real processes, real ports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.journal import JournalSource
from tests.conftest import REDIS_URL

pytestmark = pytest.mark.e2e

KVBROKER = Path(sys.executable).parent / "kvbroker"


def kvbroker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    assert KVBROKER.exists(), f"{KVBROKER} missing: install the project (pip install -e '.[dev]') as README.md says"
    return subprocess.run([str(KVBROKER), *args], capture_output=True, text=True, timeout=timeout)


def test_demo_runs_a_broker_and_prints_the_comparison_table() -> None:
    done = kvbroker("demo", "--requests", "16")
    assert done.returncode == 0, done.stderr + done.stdout
    out = done.stdout
    assert "broker listening on 127.0.0.1:" in out
    assert "policy" in out and "hit_rate" in out and "dc_miss" in out and "p99_us" in out
    assert "lru" in out and "priority_lru" in out
    assert "reproduced all" in out


def test_policies_lists_every_policy_with_description_and_parameters() -> None:
    done = kvbroker("policies", "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    names = {r["name"] for r in rows}
    assert {"lru", "priority_lru"} <= names
    assert all(r["description"] and isinstance(r["params"], dict) for r in rows)
    # Each numeric parameter's range (issue 41): what a value outside is refused against.
    by_name = {r["name"]: r for r in rows}
    assert by_name["lru_k"]["ranges"] == {"k": "[1, 64]", "retained_ratio": "[0, 1024]"}
    assert by_name["s3fifo"]["ranges"]["small_ratio"] == "(0, 1)" and by_name["arc"]["ranges"] == {}


SERVE_CONFIG = '[policy]\nname = "lru"\n[[tiers]]\nname = "hbm"\ncapacity = 1000\n[[tiers]]\nname = "dram"\ncapacity = 100000\n'


def start_serve(tmp_path: Path, *extra: str, config_text: str = SERVE_CONFIG) -> tuple[subprocess.Popen[str], int]:
    config = tmp_path / "broker.toml"
    config.write_text(config_text)
    proc = subprocess.Popen(
        [str(KVBROKER), "serve", "--config", str(config), "--listen", "127.0.0.1:0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"serve did not start: {proc.stderr.read() if proc.stderr else ''}")
    ready = json.loads(line)
    assert ready["event"] == "listening"
    return proc, int(ready["port"])


def drive(port: int, n: int) -> None:
    """Send n allocations through the Python client in a child process (as an engine would)."""
    code = f"""
import asyncio
from clients.broker_client import BrokerClient
async def main():
    async with BrokerClient("127.0.0.1:{port}", "engine-1", max_batch_events=10) as c:
        for i in range({n}):
            await c.allocate(f"b{{i}}", 100, ts_us=i, request_id="r")
        await c.flush()
asyncio.run(main())
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=Path(__file__).parents[2])


@pytest.mark.parametrize("journal", ["file", "redis"])
def test_serve_status_sigterm_then_replay_verifies(tmp_path: Path, journal: str, redis_stream_key: str) -> None:
    if journal == "file":
        url = f"file://{tmp_path}/broker.journal"
        read_url = url
    else:
        url = REDIS_URL
        read_url = f"{REDIS_URL}?stream={redis_stream_key}"
    extra = ["--journal", f"{url}?stream={redis_stream_key}" if journal == "redis" else url]
    proc, port = start_serve(tmp_path, *extra)
    try:
        drive(port, 40)
        status = kvbroker("status", "--target", f"127.0.0.1:{port}", "--json")
        assert status.returncode == 0, status.stderr
        record = json.loads(status.stdout)
        assert record["policy"] == "lru" and record["config_generation"] == 1
        assert record["events"]["allocated"] == 40
        assert record["directives"]["demote"] >= 30
        assert [t["name"] for t in record["tiers"]] == ["hbm", "dram"]
        assert sum(t["blocks"] for t in record["tiers"]) == 40
        assert record["tiers"][0]["bytes"] <= record["tiers"][0]["capacity_bytes"]
        human = kvbroker("status", "--target", f"127.0.0.1:{port}")
        assert "policy lru" in human.stdout and "hbm" in human.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    # Graceful stop flushed the journal: every batch is there.
    assert len(list(JournalSource(read_url).batches())) == 4
    replay = kvbroker("replay", "--journal", read_url, "--policy", "lru,priority_lru", "--verify", "--json")
    assert replay.returncode == 0, replay.stderr
    rows = {r["policy"]: r for r in json.loads(replay.stdout)}
    assert rows["lru"]["verified"] is True and rows["lru"]["mismatches"] == 0
    assert rows["priority_lru"]["verified"] is None
    assert rows["lru"]["events"] == 40 and rows["lru"]["demotions"] == record["directives"]["demote"]


def test_status_of_a_broker_that_is_not_there_fails_clearly() -> None:
    done = kvbroker("status", "--target", "127.0.0.1:1", "--timeout", "1")
    assert done.returncode == 2
    assert "cannot reach 127.0.0.1:1" in done.stderr


def test_serve_refuses_an_invalid_config_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[tiers]]\nname = "hbm"\ncapacity = -1\n')
    done = kvbroker("serve", "--config", str(bad), "--listen", "127.0.0.1:0", timeout=30)
    assert done.returncode == 2
    assert "tiers[0].capacity" in done.stderr


def test_replay_of_a_missing_journal_fails_clearly(tmp_path: Path) -> None:
    done = kvbroker("replay", "--journal", f"file://{tmp_path}/absent.journal")
    assert done.returncode == 2 and "cannot open journal" in done.stderr


def test_sigint_stops_serve_gracefully_too(tmp_path: Path) -> None:
    proc, _port = start_serve(tmp_path, "--journal", "none")
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGINT)
    proc.wait(timeout=30)
    assert proc.returncode == 0


def test_serve_takes_a_plain_journal_path_as_replay_and_import_do(tmp_path: Path) -> None:
    path = tmp_path / "plain.journal"
    proc, port = start_serve(tmp_path, "--journal", str(path))
    try:
        drive(port, 12)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    assert len(list(JournalSource(str(path)).batches())) == 2  # 12 allocations, 10 a batch
    replay = kvbroker("replay", "--journal", str(path), "--policy", "lru", "--verify", "--json")
    assert replay.returncode == 0, replay.stderr
    assert json.loads(replay.stdout)[0]["verified"] is True


def test_a_journal_imported_without_config_replays_as_the_trace_does(tmp_path: Path) -> None:
    """import records the tiers `replay --trace` uses, so `replay --journal` needs no --config
    and decides exactly what the replay of the trace decides."""
    trace = tmp_path / "trace.jsonl"
    with (Path(__file__).parents[1] / "data" / "mooncake" / "synthetic_trace.jsonl").open() as f:
        trace.write_text("".join(next(f) for _ in range(40)))
    journal = f"file://{tmp_path}/imported.journal"
    made = kvbroker("import", "--trace", str(trace), "--format", "mooncake", "--out", journal)
    assert made.returncode == 0, made.stderr
    from_journal = kvbroker("replay", "--journal", journal, "--policies", "lru,fifo", "--hbm", "2GiB", "--json")
    assert from_journal.returncode == 0, from_journal.stderr
    from_trace = kvbroker("replay", "--trace", str(trace), "--format", "mooncake", "--policies", "lru,fifo", "--hbm", "2GiB", "--json")
    assert from_trace.returncode == 0, from_trace.stderr
    keys = ("policy", "events", "accesses", "hit_rate", "evictions", "demotions", "bytes_moved", "capacity_bytes")
    got = [{k: r[k] for k in keys} for r in json.loads(from_journal.stdout)]
    want = [{k: r[k] for k in keys} for r in json.loads(from_trace.stdout)]
    assert got == want and got[0]["events"] > 0 and got[0]["evictions"] + got[0]["demotions"] > 0
