"""`kvbroker serve` writes a trailer per client at a clean stop (SIGTERM, SIGINT), so that
`replay --verify` of its journal can say the tail is whole (before: `tail?` always); a serve
killed with SIGKILL writes none and still reads `tail?`. A real serve on loopback, driven by
the Python client in a child process, its journal read back by `kvbroker replay`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from broker.journal import JournalSource
from broker.journal.file import read_file_journal
from broker.journal.records import MAGIC, RecordKind, encode
from broker.journal.trailer import Trailer
from broker.model.wire import read_batch
from tests.conftest import REDIS_URL
from tests.e2e.test_cli import KVBROKER, start_serve

pytestmark = pytest.mark.e2e

# Client id -> allocations it sends, 10 per batch: 4 and 3 batches.
CLIENTS = {"engine-1": 40, "engine-2": 30}


def drive(port: int, clients: dict[str, int], first: int = 0) -> None:
    """Each client sends its allocations (block ids from ``first`` on) in batches of 10
    through the Python client, in a child process, as engines would."""
    code = f"""
import asyncio
from clients.broker_client import BrokerClient
async def send(client_id, n):
    async with BrokerClient("127.0.0.1:{port}", client_id, max_batch_events=10) as c:
        for i in range({first}, {first} + n):
            await c.allocate(f"{{client_id}}-b{{i}}", 100, ts_us=i, request_id="r")
        await c.flush()
async def main():
    await asyncio.gather(*(send(c, n) for c, n in {clients!r}.items()))
asyncio.run(main())
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=Path(__file__).parents[2])


def verify(url: str) -> tuple[int, dict[str, object], str]:
    done = subprocess.run(
        [str(KVBROKER), "replay", "--journal", url, "--verify", "--policy", "lru", "--json", "--jobs", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, json.loads(done.stdout)[0] if done.stdout.strip() else {}, done.stderr


def run_serve(tmp_path: Path, journal: str, stop: signal.Signals, clients: dict[str, int] = CLIENTS, first: int = 0, **config: str) -> None:
    """Start serve on ``journal`` (``config_text``: its config, else test_cli's), drive
    ``clients``, stop it with ``stop``."""
    proc, port = start_serve(tmp_path, "--journal", journal, **config)
    try:
        drive(port, clients, first)
    finally:
        proc.send_signal(stop)
        proc.wait(timeout=30)
    expected = -signal.SIGKILL if stop == signal.SIGKILL else 0
    assert proc.returncode == expected, proc.stderr.read() if proc.stderr else ""


@pytest.fixture(params=["file", "redis"])
def journal(request: pytest.FixtureRequest, tmp_path: Path, redis_stream_key: str) -> str:
    """The journal URL serve writes and replay reads (a Redis journal names its stream)."""
    if request.param == "file":
        return f"file://{tmp_path}/broker.journal"
    return f"{REDIS_URL}?stream={redis_stream_key}"


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_cleanly_stopped_serve_journal_verifies_whole(tmp_path: Path, journal: str, stop: signal.Signals) -> None:
    run_serve(tmp_path, journal, stop)
    source = JournalSource(journal)
    trailers = sorted((Trailer.from_record(r) for r in source.trailers()), key=lambda t: t.client_id)
    # One per client, counting the batches it sent (numbered from 1).
    assert trailers == [Trailer("engine-1", 1, 4, 4), Trailer("engine-2", 1, 3, 3)]
    code, record, err = verify(journal)
    # Before: exit 0 with tail "unknown" and the "cannot tell" line (serve wrote no trailer).
    assert code == 0, err
    assert record["verified"] is True and record["tail"] == "complete" and record["missing_batches"] == 0, record
    assert "cannot tell" not in err, err


def test_a_killed_serve_journal_still_cannot_be_told_whole(tmp_path: Path, journal: str) -> None:
    run_serve(tmp_path, journal, signal.SIGKILL)
    assert list(JournalSource(journal).trailers()) == []
    code, record, err = verify(journal)
    assert code == 0, err
    assert record["verified"] is True and record["tail"] == "unknown", record
    assert "cannot tell whether the journal's tail is whole: 4 batches of client engine-1, 3 batches of client engine-2" in err, err


def test_a_restart_counts_each_process_apart(tmp_path: Path) -> None:
    # Stopped cleanly, started again on the journal (recovered), stopped cleanly: each
    # process's trailer counts its own batches, and the whole journal verifies.
    url = f"file://{tmp_path}/broker.journal"
    run_serve(tmp_path, url, signal.SIGTERM)
    run_serve(tmp_path, url, signal.SIGTERM, {"engine-1": 20}, first=1000)
    trailers = [Trailer.from_record(r) for r in JournalSource(url).trailers()]
    assert Trailer("engine-1", 5, 6, 2) in trailers and len(trailers) == 3
    code, record, err = verify(url)
    assert code == 0, err
    assert record["tail"] == "complete", record
    # Killed the third time: its batches are counted by no trailer, the earlier ones are.
    run_serve(tmp_path, url, signal.SIGKILL, {"engine-2": 10}, first=2000)
    code, record, err = verify(url)
    assert code == 0 and record["tail"] == "unknown", err
    assert "1 batches of client engine-2 have no writer's trailer" in err, err


def test_a_serve_journal_that_lost_its_last_batch_fails_verify_naming_the_client(tmp_path: Path) -> None:
    # The last batch journaled is lost (with its directives, which follow it), the trailers
    # kept: the directives of every batch before it still replay the same, and the trailer
    # of its client says one is missing.
    url = f"file://{tmp_path}/broker.journal"
    run_serve(tmp_path, url, signal.SIGTERM)
    path = tmp_path / "broker.journal"
    records = list(read_file_journal(str(path)))
    last = max(i for i, r in enumerate(records) if r.kind == RecordKind.BATCH)
    batch = read_batch(records[last].payload)
    lost = {i for i, r in enumerate(records) if i >= last and r.kind in (RecordKind.BATCH, RecordKind.DIRECTIVES)}
    path.write_bytes(MAGIC + b"".join(encode(r) for i, r in enumerate(records) if i not in lost))
    code, record, err = verify(url)
    assert code == 1, err
    assert record["verified"] is True and record["tail"] == "cut" and record["missing_batches"] == 1, record
    sent = CLIENTS[batch.client_id] // 10
    assert batch.batch_seq == sent
    counted = f"client {batch.client_id}: {sent - 1} of {sent}, first missing batch seq {sent}"
    assert f"lacks 1 batches its writer counted ({counted})" in err, err
