#!/usr/bin/env python3
"""kvbroker's policies beside libCacheSim's algorithms on the same block sequence.

The trace goes through kvbroker's importer once (prompt blocks only, one tier: the
methodology of prefix-cache hit-ratio studies); kvbroker replays the batches with each
policy, and libCacheSim (``libcachesim`` 0.3.5, a dev dependency) runs each algorithm on
the block ids those batches allocate, in the same order. Blocks are uniform, so
libCacheSim counts in blocks (object size 1, cache size = the tier's bytes // the block's
bytes): in bytes, libCacheSim's ARC would move its target by the ghost-size ratio alone,
one byte per ghost hit, rather than the paper's one block. Printed per size: hits, share
of Belady's hits, seconds (wall clock: noisy on a shared machine).

    python bench/libcachesim_compare.py                       # the Mooncake trace, 1M/3M/10M tokens
    python bench/libcachesim_compare.py --sizes 1000000tok --kvbroker lru,adaptive --libcachesim LRU,ARC
    python bench/libcachesim_compare.py --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from broker.replay.replay import replay  # noqa: E402
from broker.replay.sweep import parse_capacity, single_tier  # noqa: E402
from broker.replay.traces import TraceOptions, read_trace  # noqa: E402
from kvbroker.v1 import intent_pb2 as pb  # noqa: E402
from policies import registry  # noqa: E402

TRACE = ROOT / "tests" / "data" / "mooncake" / "synthetic_trace.jsonl"
KVBROKER = [name for name in registry.names() if name != "belady"] + ["belady"]
# Every libCacheSim algorithm that takes a plain request stream (Belady needs each
# request's next access, which this script fills in).
LIBCACHESIM = (
    "LRU,FIFO,Belady,ARC,S3FIFO,Sieve,Clock,LFU,LFUDA,TwoQ,SLRU,LRUK,MQ,LIRS,ClockPro,Clock2QPlus,"
    "WTinyLFU,LeCaR,Cacheus,LHD,Hyperbolic,GDSF,Random,Size,BeladySize,LRUProb,FlashProb,GLCache"
)


def batches_of(trace: str, fmt: str) -> list[pb.IntentBatch]:
    return list(read_trace(trace, fmt, TraceOptions(decode=False)))


def block_sequence(batches: list[pb.IntentBatch]) -> tuple[list[int], int]:
    """The block ids the batches allocate, in order (as ints), and the block size in bytes."""
    ids: dict[str, int] = {}
    seq: list[int] = []
    size = 0
    for batch in batches:
        for event in batch.events:
            if event.WhichOneof("kind") == "allocated":
                intent = event.allocated.intent
                seq.append(ids.setdefault(intent.block_id, len(ids)))
                size = size or intent.size_bytes
    return seq, size


def libcachesim_hits(algorithm: str, seq: list[int], capacity_blocks: int, **params: Any) -> int:
    """Hits of one libCacheSim algorithm on ``seq`` with room for ``capacity_blocks``."""
    import libcachesim

    never = 2**62
    next_use = [never] * len(seq)
    last: dict[int, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        next_use[i] = last.get(seq[i], never)
        last[seq[i]] = i
    cache = getattr(libcachesim, algorithm)(capacity_blocks, **params)
    request = libcachesim.Request
    hits = 0
    for i, obj in enumerate(seq):
        if cache.get(request(obj_size=1, obj_id=obj, next_access_vtime=next_use[i], clock_time=i)):
            hits += 1
    return hits


def kvbroker_hits(batches: list[pb.IntentBatch], policy: str, capacity: int, params: dict[str, Any] | None = None) -> int:
    def source() -> Iterator[tuple[int, pb.IntentBatch]]:
        return ((1, b) for b in batches)

    return int(replay(source, single_tier(capacity), policy, params).metrics["prefix_hits"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--format", default="mooncake")
    ap.add_argument("--sizes", default="1000000tok,3000000tok,10000000tok")
    ap.add_argument("--kvbroker", default=",".join(KVBROKER), help="kvbroker policies (comma separated; '' for none)")
    ap.add_argument("--libcachesim", default=LIBCACHESIM, help="libCacheSim algorithms (class names; '' for none)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    batches = batches_of(args.trace, args.format)
    seq, block_bytes = block_sequence(batches)
    rows: list[dict[str, Any]] = []
    for text in args.sizes.split(","):
        # Both sides get the same cache: whole blocks (the tier can hold no more anyway, but
        # ARC's and S3-FIFO's targets are fractions of the capacity, and libCacheSim's are
        # fractions of its object count).
        blocks = parse_capacity(text, TraceOptions.bytes_per_token, "--sizes") // block_bytes
        capacity = blocks * block_bytes
        started = time.perf_counter()
        belady = libcachesim_hits("Belady", seq, blocks)
        found: list[dict[str, Any]] = []
        runs = [("kvbroker", p) for p in args.kvbroker.split(",") if p] + [("libCacheSim", a) for a in args.libcachesim.split(",") if a]
        for source, name in runs:
            started = time.perf_counter()
            hits = kvbroker_hits(batches, name, capacity) if source == "kvbroker" else libcachesim_hits(name, seq, blocks)
            found.append(
                {
                    "size": text,
                    "blocks": blocks,
                    "source": source,
                    "algorithm": name,
                    "hits": hits,
                    "share_of_belady": hits / belady if belady else 0.0,
                    "seconds": round(time.perf_counter() - started, 2),
                }
            )
            if not args.json:
                r = found[-1]
                print(f"{text:>14} {source:<11} {name:<16} {hits:>7} {100 * r['share_of_belady']:6.1f}% {r['seconds']:7.1f}s", flush=True)
        rows.extend(found)
        if not args.json:
            for s in ("kvbroker", "libCacheSim"):
                online = [r for r in found if r["source"] == s and "elady" not in r["algorithm"]]
                if online:
                    r = max(online, key=lambda r: r["hits"])
                    print(f"{text:>14} best {s:<11} {r['algorithm']:<11} {r['hits']:>7} {100 * r['share_of_belady']:6.1f}%")
            print()
    if args.json:
        json.dump({"trace": args.trace, "sequence_blocks": len(seq), "rows": rows}, sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
