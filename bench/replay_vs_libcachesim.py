#!/usr/bin/env python3
"""Replay time against libCacheSim's, LRU, FIFO, S3-FIFO and ARC, on the same block sequence.

The issue 24 target: kvbroker's replay within 5x of libCacheSim's time, with the same result.
The trace goes through kvbroker's importer once (prompt blocks, one tier: the prefix-cache
study setup of ``bench/libcachesim_compare.py``) and is serialized, as a journal holds it;
kvbroker then replays those bytes (decode, apply, policy: what ``kvbroker replay`` does, the
journal read aside), and libCacheSim runs the block ids those batches allocate, in the same
order, through its C trace loop (``process_trace`` on an oracleGeneral file written once:
no Python per request, the fastest libCacheSim there is). Blocks are uniform, so libCacheSim
counts in blocks (size 1, capacity = the tier's bytes // the block's bytes). s3fifo runs
with ``variant=libcachesim, move_to_main_threshold=2``, the parameters that make it
libCacheSim's S3FIFO (policies/s3fifo.py). Each side's time
is this process's CPU time (``time.process_time``: both sides run on one thread, and on a
shared host wall time counts the other tenants too), the median of ``--repeat`` runs; the hits must be equal (kvbroker's prefix hits,
libCacheSim's requests minus misses).

    python bench/replay_vs_libcachesim.py                    # Mooncake trace, 1M tokens
    python bench/replay_vs_libcachesim.py --repeat 3 --json
    python bench/replay_vs_libcachesim.py --quick            # 40 batches: checks the output, not the figure
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from broker.bench.targets import REPLAY_ALGORITHMS, REPLAY_PARAMS, render, replay_lines  # noqa: E402
from broker.replay.replay import replay  # noqa: E402
from broker.replay.sweep import parse_capacity, single_tier  # noqa: E402
from broker.replay.traces import TraceOptions, read_trace  # noqa: E402
from broker.replay.traces.sequence import block_sequence  # noqa: E402

TRACE = ROOT / "tests" / "data" / "mooncake" / "synthetic_trace.jsonl"
# libCacheSim's oracleGeneral record: uint32 time, uint64 object id, uint32 size, int64 next access.
ORACLE = struct.Struct("<IQIq")


def allocated_ids(batches: list[Any]) -> tuple[list[int], int]:
    """The allocated block ids as ints from 1 (libCacheSim's oracle records), and the block's bytes."""
    seq, size = block_sequence(batches)
    return [i + 1 for i in seq], size


def write_oracle(seq: list[int], path: str) -> None:
    with open(path, "wb") as f:
        f.write(b"".join(ORACLE.pack(i, obj, 1, -1) for i, obj in enumerate(seq)))


def libcachesim_run(algorithm: str, path: str, requests: int, capacity_blocks: int) -> tuple[int, float]:
    """(hits, seconds) of libCacheSim's C loop over the trace file."""
    import libcachesim

    reader = libcachesim.TraceReader(path, libcachesim.TraceType.ORACLE_GENERAL_TRACE)
    cache = getattr(libcachesim, algorithm)(capacity_blocks)
    started = time.process_time()
    miss_ratio, _ = cache.process_trace(reader)
    seconds = time.process_time() - started
    return round(requests * (1 - miss_ratio)), seconds


def kvbroker_run(data: list[bytes], policy: str, capacity: int, params: dict[str, Any] | None = None) -> tuple[int, float, int]:
    """(prefix hits, seconds, events) of kvbroker's replay of the serialized batches."""
    started = time.process_time()
    result = replay(lambda: ((1, b) for b in data), single_tier(capacity), policy, params)
    return int(result.metrics["prefix_hits"]), time.process_time() - started, result.events


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--format", default="mooncake")
    ap.add_argument("--size", default="1000000tok", help="the one tier's capacity (tokens with 'tok', else bytes)")
    ap.add_argument("--policies", default=",".join(p for p, _ in REPLAY_ALGORITHMS), help="a subset of lru,fifo,s3fifo,arc")
    ap.add_argument("--repeat", type=int, default=1, help="runs per side; the median time is reported")
    ap.add_argument("--quick", action="store_true", help="the first 40 batches of the trace and one run: the output, not the figure")
    ap.add_argument("--json", action="store_true", help="one JSON record per algorithm")
    args = ap.parse_args(argv)
    chosen = [p for p in args.policies.split(",") if p]
    known = [p for p, _ in REPLAY_ALGORITHMS]
    if not chosen or set(chosen) - set(known):
        print(f"replay_vs_libcachesim: --policies: each one of {','.join(known)}, got {args.policies!r}", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print(f"replay_vs_libcachesim: --repeat: must be >= 1, got {args.repeat}", file=sys.stderr)
        return 2

    batches = list(read_trace(args.trace, args.format, TraceOptions(decode=False)))
    if args.quick:
        batches, args.repeat = batches[:40], 1
    seq, block_bytes = allocated_ids(batches)
    data = [b.SerializeToString() for b in batches]
    del batches
    # Whole blocks on both sides: ARC's and S3-FIFO's targets are fractions of the capacity.
    blocks = parse_capacity(args.size, TraceOptions.bytes_per_token, "--size") // block_bytes
    capacity = blocks * block_bytes
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvbroker-lcs-") as tmp:
        path = os.path.join(tmp, "trace.oracleGeneral")
        write_oracle(seq, path)
        for policy, algorithm in REPLAY_ALGORITHMS:
            if policy not in chosen:
                continue
            params = REPLAY_PARAMS.get(policy)
            ours = [kvbroker_run(data, policy, capacity, params) for _ in range(args.repeat)]
            theirs = [libcachesim_run(algorithm, path, len(seq), blocks) for _ in range(args.repeat)]
            row = {
                "policy": policy,
                "algorithm": algorithm,
                "params": params or {},
                "size": args.size,
                "blocks": blocks,
                "requests": len(seq),
                "events": ours[0][2],
                "kvbroker_hits": ours[0][0],
                "libcachesim_hits": theirs[0][0],
                "kvbroker_seconds": round(statistics.median(r[1] for r in ours), 4),
                "libcachesim_seconds": round(statistics.median(r[1] for r in theirs), 5),
                "load_1m": round(os.getloadavg()[0], 2),
            }
            row["ratio"] = round(row["kvbroker_seconds"] / row["libcachesim_seconds"], 2)
            row["identical"] = row["kvbroker_hits"] == row["libcachesim_hits"]
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"{policy:<7} {ours[0][2]:>9,} events {row['kvbroker_seconds']:>8.3f}s  libCacheSim {algorithm:<6} "
                    f"{len(seq):>9,} requests {row['libcachesim_seconds']:>8.4f}s  ratio {row['ratio']:>7.1f}  "
                    f"hits {row['kvbroker_hits']} / {row['libcachesim_hits']}",
                    flush=True,
                )
    if not args.json:
        print(f"\n(load average {os.getloadavg()[0]:.2f}; {blocks:,} blocks of room, {len(seq):,} allocations)")
        print(render("replay against libCacheSim, same block sequence", replay_lines(rows), quick=args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
