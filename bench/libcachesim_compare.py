#!/usr/bin/env python3
"""kvbroker's policies beside libCacheSim's algorithms on the same block sequence.

The trace goes through kvbroker's importer once (prompt blocks only, one tier: the
methodology of prefix-cache hit-ratio studies); kvbroker replays the batches with each
policy, and libCacheSim (``libcachesim`` 0.3.5, a dev dependency) runs each algorithm on
the block ids those batches allocate, in the same order. Blocks are uniform, so
libCacheSim counts in blocks (object size 1, cache size = the tier's bytes // the block's
bytes): in bytes, libCacheSim's ARC would move its target by the ghost-size ratio alone,
one byte per ghost hit, rather than the paper's one block. Printed per size: hits, share
of Belady's hits, seconds (wall clock: noisy on a shared machine); then issue #22's table:
per size, the best online kvbroker policy, the best online libCacheSim algorithm,
prefix_aware, lru and adaptive, and kvbroker's offline prefetch_oracle in a column of its
own, as shares of Belady's hits (``--json`` rows say ``online``).

    python bench/libcachesim_compare.py                       # the Mooncake trace, 1M/3M/10M tokens
    python bench/libcachesim_compare.py --sizes 1000000tok --kvbroker lru,adaptive --libcachesim LRU,ARC
    python bench/libcachesim_compare.py --kvbroker s3fifo:variant=libcachesim:move_to_main_threshold=2 --libcachesim S3FIFO
    python bench/libcachesim_compare.py --json

A kvbroker entry ``policy:key=value:...`` runs the policy with those parameters (as
``kvbroker replay --param policy.key=value``).
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

from broker.replay.grid import parse_params  # noqa: E402
from broker.replay.replay import replay  # noqa: E402
from broker.replay.sweep import parse_capacity, single_tier  # noqa: E402
from broker.replay.traces import TraceOptions, read_trace  # noqa: E402
from broker.replay.traces.sequence import block_sequence  # noqa: E402
from kvbroker.v1 import intent_pb2 as pb  # noqa: E402
from policies import registry  # noqa: E402

TRACE = ROOT / "tests" / "data" / "mooncake" / "synthetic_trace.jsonl"
KVBROKER = [name for name in registry.names() if name != "belady"] + ["s3fifo:variant=libcachesim:move_to_main_threshold=2", "belady"]
# The columns of issue #22's table besides the two bests.
TABLE_POLICIES = ("prefix_aware", "lru", "adaptive")
# Every libCacheSim algorithm that takes a plain request stream (Belady needs each
# request's next access, which this script fills in).
LIBCACHESIM = (
    "LRU,FIFO,Belady,ARC,S3FIFO,Sieve,Clock,LFU,LFUDA,TwoQ,SLRU,LRUK,MQ,LIRS,ClockPro,Clock2QPlus,"
    "WTinyLFU,LeCaR,Cacheus,LHD,Hyperbolic,GDSF,Random,Size,BeladySize,LRUProb,FlashProb,GLCache"
)


def batches_of(trace: str, fmt: str) -> list[pb.IntentBatch]:
    return list(read_trace(trace, fmt, TraceOptions(decode=False)))


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


def policy_spec(text: str) -> tuple[str, dict[str, Any]]:
    """``policy:key=value:...`` as (policy, parameters), values read as the defaults' types."""
    name, *pairs = text.split(":")
    if not pairs:
        return name, {}
    grid = parse_params([f"{name}.{pair}" for pair in pairs], [name])
    return name, grid[name][0]


# libCacheSim's algorithms that read the future (this script fills in each request's next access).
LIBCACHESIM_OFFLINE = ("Belady", "BeladySize")


def is_online(row: dict[str, Any]) -> bool:
    """Whether a row's policy decides from the past alone, as a cache can. kvbroker's
    ``prefetch_oracle`` reads the future as Belady does: it led "best kvbroker" at 100% of
    Belady's hits, beside online libCacheSim algorithms."""
    if row["source"] == "kvbroker":
        return not registry.policy_class(policy_spec(row["algorithm"])[0]).offline
    return row["algorithm"] not in LIBCACHESIM_OFFLINE


def best_online(rows: list[dict[str, Any]], source: str) -> dict[str, Any] | None:
    online = [r for r in rows if r["source"] == source and is_online(r)]
    return max(online, key=lambda r: r["hits"]) if online else None


def print_table(rows: list[dict[str, Any]], sizes: list[str]) -> None:
    """Issue #22's table, in Markdown: shares of Belady's hits (hits; seconds). The bests
    are of online policies; kvbroker's offline ones other than Belady (the oracle) have a
    column of their own."""

    def cell(r: dict[str, Any] | None, named: bool = False) -> str:
        if r is None:
            return "-"
        label = f"{r['algorithm']} " if named else ""
        return f"{label}{100 * r['share_of_belady']:.1f}% ({r['hits']:,}; {r['seconds']:.1f} s)"

    mine = [r for r in rows if r["source"] == "kvbroker" and r["algorithm"] != "belady"]
    offline = list(dict.fromkeys(r["algorithm"] for r in mine if not is_online(r)))
    head = ["cache", "best kvbroker (online)", "best libCacheSim (online)", *TABLE_POLICIES, *(f"{p} (offline)" for p in offline)]
    print("| " + " | ".join([*head, "Belady hits"]) + " |")
    print("|---" * (len(head) + 1) + "|")
    for size in sizes:
        here = [r for r in rows if r["size"] == size]
        named = {r["algorithm"]: r for r in here if r["source"] == "kvbroker"}
        belady = next((r["hits"] for r in here if r["algorithm"] == "Belady"), 0)
        cells = [cell(best_online(here, "kvbroker"), True), cell(best_online(here, "libCacheSim"), True)]
        cells += [cell(named.get(p)) for p in (*TABLE_POLICIES, *offline)]
        print(f"| {size} | " + " | ".join(cells) + f" | {belady:,} |")


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
        found: list[dict[str, Any]] = [
            {
                "size": text,
                "blocks": blocks,
                "source": "libCacheSim",
                "algorithm": "Belady",
                "hits": belady,
                "share_of_belady": 1.0,
                "seconds": round(time.perf_counter() - started, 2),
                "online": False,
            }
        ]
        runs = [("kvbroker", p) for p in args.kvbroker.split(",") if p]
        runs += [("libCacheSim", a) for a in args.libcachesim.split(",") if a and a != "Belady"]
        for source, name in runs:
            started = time.perf_counter()
            if source == "kvbroker":
                policy, params = policy_spec(name)
                hits = kvbroker_hits(batches, policy, capacity, params)
            else:
                hits = libcachesim_hits(name, seq, blocks)
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
            found[-1]["online"] = is_online(found[-1])
            if not args.json:
                r = found[-1]
                print(f"{text:>14} {source:<11} {name:<16} {hits:>7} {100 * r['share_of_belady']:6.1f}% {r['seconds']:7.1f}s", flush=True)
        rows.extend(found)
        if not args.json:
            for s in ("kvbroker", "libCacheSim"):
                best = best_online(found, s)
                if best is not None:
                    share = 100 * best["share_of_belady"]
                    print(f"{text:>14} best {s:<11} {best['algorithm']:<11} {best['hits']:>7} {share:6.1f}% (online)")
            print()
    if args.json:
        json.dump({"trace": args.trace, "sequence_blocks": len(seq), "rows": rows}, sys.stdout, indent=1)
        print()
    else:
        print_table(rows, args.sizes.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
