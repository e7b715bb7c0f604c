"""A process holding the embedded core exits, normally or on SIGTERM, under load: it exits
within 5 s and its journal holds every batch it applied, then a trailer counting them. When
the journal cannot be written at exit (a full disk, Redis down), the exit waits at most
``journal_exit_s`` and one ERROR line says how many records were lost, from which batch on.

Each case runs tests/vllm_integration/decisions_to_vllm/exit_child.py in a process of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from broker.journal import JournalSource
from broker.journal.records import RecordKind
from broker.journal.trailer import Trailer
from broker.model.wire import read_batch
from tests.conftest import REDIS_URL
from tests.redis_server import RedisServer, free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[3]
EXIT_BOUND_S = 5.0
# exit_child's journal_exit_s, and what a given-up exit may take beyond it (the cancelled
# write, the ERROR line, the interpreter's own teardown).
EXIT_S = 2.0
GIVE_UP_SLACK_S = 2.0


def start(mode: str, url: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.vllm_integration.decisions_to_vllm.exit_child", mode, url],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str], since: float, out: str = "") -> tuple[int, str, float]:
    """(batches applied, stderr, seconds from ``since`` to the process's end); ``out``: the
    output already read."""
    rest, err = proc.communicate(timeout=120)
    took = time.monotonic() - since
    assert proc.returncode == 0, err
    applied = [int(line.split()[1]) for line in (out + rest).splitlines() if line.startswith("applied ")]
    assert applied, out + err
    return applied[0], err, took


def journal_counts(source: JournalSource) -> tuple[Counter[RecordKind], list[int], list[Trailer]]:
    records = list(source.ordered()) + list(source.trailers())
    seqs = [read_batch(r.payload).batch_seq for r in records if r.kind == RecordKind.BATCH]
    return Counter(r.kind for r in records), seqs, [Trailer.from_record(r) for r in source.trailers()]


@pytest.fixture(params=["file", "redis"])
def journal(request: pytest.FixtureRequest, tmp_path: Path, redis_stream_key: str) -> tuple[str, JournalSource]:
    if request.param == "file":
        url = f"file://{tmp_path / 'journal'}"
        return url, JournalSource(url)
    url = f"{REDIS_URL}?stream={redis_stream_key}"
    return url, JournalSource(url)


@pytest.mark.redis
@pytest.mark.parametrize("mode", ["normal", "sigterm", "sigterm-fork"])
def test_an_exit_under_load_journals_every_batch_applied_within_5_s(mode: str, journal: tuple[str, JournalSource]) -> None:
    # Before: a file journal's writes failed at exit ("cannot schedule new futures after
    # interpreter shutdown"), the exit took 60 s and lost everything still queued; a forked
    # child (vLLM's engine core) ran no atexit handler at all.
    url, source = journal
    proc = start(mode, url)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first.startswith("pid "), first + (proc.stderr.read() if proc.stderr else "")
    out = ""
    if mode == "normal":
        out = proc.stdout.readline()  # "applied N": 20,000 batches applied, leaving main
        since = time.monotonic()
    else:
        time.sleep(0.3)  # batches flowing
        since = time.monotonic()
        os.kill(int(first.split()[1]), signal.SIGTERM)
    applied, err, took = finish(proc, since, out)
    assert took < EXIT_BOUND_S, f"{mode}: exit took {took:.1f}s"
    kinds, seqs, trailers = journal_counts(source)
    assert kinds[RecordKind.BATCH] == applied, err
    assert seqs == list(range(seqs[0], seqs[0] + applied))  # every one, in order
    assert trailers == [Trailer("exit-test", seqs[0], seqs[-1], applied)]
    assert "lost" not in err


def lost_line(err: str) -> str:
    lines = [line for line in err.splitlines() if "at exit" in line]
    assert len(lines) == 1, err
    return lines[0]


def test_an_exit_on_a_full_disk_waits_at_most_journal_exit_s_and_says_what_was_lost(tmp_path: Path) -> None:
    # Before: a 60 s stall, and only retry warnings; nothing said what was lost.
    path = tmp_path / "journal"
    proc = start("disk-full", f"file://{path}")
    applied, err, took = finish(proc, time.monotonic())
    assert took < EXIT_S + GIVE_UP_SLACK_S + 1.5, f"exit took {took:.1f}s"  # + applying 2,000 batches
    kinds, seqs, trailers = journal_counts(JournalSource(str(path)))
    assert kinds[RecordKind.BATCH] == 101 and trailers == []
    # 2,000 batches and their 2,000 directive records, from the first one not written on.
    line = lost_line(err)
    assert f"lost 4000 records (2000 batches) from batch {seqs[-1] + 1} of client exit-test on" in line, line
    assert "File too large" in line
    assert applied == 101 + 2000


@pytest.mark.redis
def test_an_exit_with_redis_down_waits_at_most_journal_exit_s_and_says_what_was_lost(tmp_path: Path) -> None:
    server = RedisServer(free_port(), tmp_path)  # saves on stop, loads on start: what Redis held
    server.start()
    try:
        url = f"{server.url}?stream=exit"
        proc = start("redis-down", url)
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().startswith("pid ")
        assert proc.stdout.readline().strip() == "flushed"
        server.stop()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        applied, err, took = finish(proc, time.monotonic())
        assert took < EXIT_S + GIVE_UP_SLACK_S + 1.5, f"exit took {took:.1f}s"
        server.start()
        kinds, seqs, trailers = journal_counts(JournalSource(url))
    finally:
        server.stop()
    assert kinds[RecordKind.BATCH] == 101 and trailers == []
    line = lost_line(err)
    assert f"lost 4000 records (2000 batches) from batch {seqs[-1] + 1} of client exit-test on" in line, line
    assert applied == 101 + 2000


@pytest.mark.vllm
def test_a_forked_engine_core_applies_and_journals_what_the_policy_buffered(tmp_path: Path) -> None:
    # vLLM's engine core is a forked child by default: it leaves with os._exit, so the
    # policy's atexit close (which applies the events it still buffers) never ran there.
    path = tmp_path / "journal"
    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm_integration.decisions_to_vllm.exit_child", "vllm-fork", f"file://{path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    made, buffered = (int(word) for word in done.stdout.split()[1::2])
    assert buffered > 0  # else the exit had nothing to apply
    source = JournalSource(str(path))
    events = sum(read_batch(r.payload).count for r in source.batches())
    assert events == made + 1  # and the start's `cleared`
    assert [Trailer.from_record(r).batches for r in source.trailers()] == [len(list(source.batches()))]
