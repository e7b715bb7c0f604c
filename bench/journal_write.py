#!/usr/bin/env python3
"""Redis journal write speed: records per second, and the writer's CPU per record, for
groups of 1, 16 and 64 records.

Each group goes through the journal as the broker drives it (append, then wait until it is
written), one group at a time, into a fresh stream key that is deleted afterwards. The CPU
is this process's: what the broker's process, which also serves the requests, pays.

    python bench/journal_write.py                      # 127.0.0.1:6379, 4 KiB payloads
    python bench/journal_write.py --groups 1,64 --seconds 5 --repeat 5
    python bench/journal_write.py --redis redis://:pw@10.0.0.5:6379/2 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid

import redis
import uvloop

from broker.journal import Journal, JournalRecord, RecordKind, open_journal
from broker.journal.redis_stream import directives_key

# A group not written by then (Redis down: the journal retries for ever) ends the run.
WAIT_S = 30.0


async def measure(url: str, group: int, payload: int, seconds: float, maxlen: int) -> dict[str, float]:
    """Write groups of ``group`` records for about ``seconds`` (after a short warm-up)."""
    key = f"kvbroker-bench:journal-write:{uuid.uuid4().hex}"
    journal = open_journal(url, stream=key, maxlen=maxlen, fsync=False, max_group=group)
    records = [JournalRecord(RecordKind.BATCH, 1, 1, os.urandom(payload)) for _ in range(group)]
    await journal.start()
    try:
        for _ in range(20):
            await write_group(journal, records)
        rounds = 0
        wall, cpu = time.perf_counter(), time.process_time()
        while time.perf_counter() - wall < seconds:
            await write_group(journal, records)
            rounds += 1
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if journal.errors:
            raise RuntimeError(f"the journal failed {journal.errors} writes: {journal.last_error}")
    finally:
        try:
            await asyncio.wait_for(journal.close(), WAIT_S)
        finally:
            client = redis.Redis.from_url(url)
            try:
                client.delete(key, directives_key(key))
            finally:
                client.close()
    written = rounds * group
    return {
        "group": group,
        "records": written,
        "records_per_s": written / wall,
        "cpu_us_per_record": cpu / written * 1e6,
        "ms_per_group": wall / rounds * 1e3,
    }


async def write_group(journal: Journal, records: list[JournalRecord]) -> None:
    for record in records:
        journal.append(record)
    await asyncio.wait_for(journal.flush(), WAIT_S)


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median rate (its own figures, not a mix of runs)."""
    return sorted(runs, key=lambda r: r["records_per_s"])[len(runs) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--groups", default="1,16,64", help="comma-separated group sizes")
    parser.add_argument("--payload", type=int, default=4096, help="bytes per record")
    parser.add_argument("--seconds", type=float, default=2.0, help="writing time per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per group size; the median is reported")
    parser.add_argument("--maxlen", type=int, default=10_000, help="stream MAXLEN (~), keeps Redis memory bounded")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    groups = [int(g) for g in args.groups.split(",") if g]
    if not args.json:
        print(
            f"journal write: {args.redis}, payload {args.payload} B, maxlen ~{args.maxlen}, "
            f"{args.seconds:g}s per run, median of {args.repeat}"
        )
        print(f"{'group':>5} {'records/s':>12} {'cpu us/record':>14} {'ms/group':>9}")
    for group in groups:
        runs = [uvloop.run(measure(args.redis, group, args.payload, args.seconds, args.maxlen)) for _ in range(max(1, args.repeat))]
        best = median_run(runs)
        if args.json:
            print(json.dumps({**best, "runs": len(runs), "payload": args.payload}))
        else:
            print(f"{group:5d} {best['records_per_s']:12,.0f} {best['cpu_us_per_record']:14.2f} {best['ms_per_group']:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
