"""The replay table's note on latencies that are copy queues, not reads (issue 32: a decode-mode
replay of the Mooncake trace printed p50_us 1,946,157,056 with no word about it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from broker.replay.replay import QUEUED_NOTE, format_table

KVBROKER = Path(sys.executable).parent / "kvbroker"
MOONCAKE = Path(__file__).parents[2] / "data" / "mooncake" / "synthetic_trace.jsonl"


def record(p50: int, p99: int) -> dict[str, Any]:
    return {
        "policy": "lru",
        "events": 10,
        "accesses": 5,
        "hit_rate": 0.5,
        "prefix_hit_rate": 0.0,
        "prompt_blocks": 0,
        "dc_miss_rate": 0.0,
        "dc_accesses": 0,
        "deadline_miss_rate": 0.0,
        "deadline_accesses": 0,
        "p50_us": p50,
        "p99_us": p99,
        "demotions": 0,
        "evictions": 0,
        "prefetches": 0,
        "bytes_moved": 0,
        "verified": None,
        "mismatches": None,
        "capacity_bytes": {"hbm": 1},
    }


def test_latencies_of_reads_need_no_note() -> None:
    table = format_table([record(0, 60_416), record(558, 999_999)])
    assert "note:" not in table


def test_a_latency_over_a_second_is_said_to_be_a_copy_queue() -> None:
    table = format_table([record(0, 60_416), record(1_946_157_056, 3_321_888_768)])
    assert table.endswith(QUEUED_NOTE)
    assert "open loop" in table and "copy channels" in table


def test_a_decode_mode_replay_whose_copies_outrun_the_channels_prints_the_note(tmp_path: Path) -> None:
    """The first 50 requests of the Mooncake trace at a 100,000-token HBM: their decode
    steps ask more DRAM copies than two channels carry, and the queue is the figure."""
    trace = tmp_path / "t.jsonl"
    with MOONCAKE.open() as f:
        trace.write_text("".join(next(f) for _ in range(50)))
    done = subprocess.run(
        [str(KVBROKER), "replay", "--trace", str(trace), "--format", "mooncake", "--hbm", "100000tok", "--policy", "lru"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("lru "))
    headers = done.stdout.splitlines()[0].split()
    assert int(row.split()[headers.index("p50_us")]) > 1_000_000 or int(row.split()[headers.index("p99_us")]) > 1_000_000, row
    assert QUEUED_NOTE in done.stdout
