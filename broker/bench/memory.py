"""Memory per tracked block: the RSS a broker's core adds per allocated block.

In a fresh process (so nothing else is on the heap), the core the broker runs is built with
the policy, then N blocks are allocated through the broker's own path (``apply_batch`` on
IntentBatches, in chunks that are dropped once applied): engine-like ids, one request per 16
blocks, a quarter of the blocks with a deadline. The tiers hold every block, so no directive
is outstanding (unacknowledged directives are bounded by ``max_outstanding_directives``, not
by blocks). Before the second reading every tier's policy is asked for a victim once (a
read that changes no state): a policy that files blocks lazily (deadline_edf) then holds
the structures it holds in a broker under pressure, not only its pending list. RSS
(/proc/self/status VmRSS) is read after a garbage collection before and after; the
difference over N is the figure.

Beside it, what a million blocks cost the cyclic garbage collector: the objects it tracks
(``gc.get_objects()``) and the time of one full collection (median of three), the pause a
serving broker takes whenever one runs (policies/_gc.c says why blocks are not tracked).

With ``--breakdown``, the objects themselves are counted too (``breakdown``): by owner (the
core's per-block state, then each tier's policy) and type, in allocated bytes per block,
and RSS beyond them is what the allocator holds besides. It shows which part of the figure
belongs to which structure, and so what a change of representation could save.

    python bench/memory.py                       # 100k and 1M blocks
    python bench/memory.py --breakdown           # and the objects counted, by owner and type
    python bench/memory.py --targets --blocks 1000000   # the issue's five policies, each one's target line
    kvbroker bench --memory --memory-blocks 100000,1000000
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broker.model.core import Core

BLOCK_BYTES = 2 * 2**20
BLOCKS_PER_REQUEST = 16
CHUNK = 2_000


def rss() -> int:
    """This process's resident memory in bytes (VmRSS), for before/after figures."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ValueError("VmRSS not in /proc/self/status")


def _child(blocks: int, policy: str, with_breakdown: bool = False) -> dict[str, Any]:
    from broker.config import CoreConfig, PolicyConfig, TierConfig
    from broker.model.apply import apply_batch
    from broker.model.core import Core
    from kvbroker.v1 import intent_pb2 as pb

    capacity = 2 * blocks * BLOCK_BYTES  # every block fits the top tier: no pressure, no directives
    config = CoreConfig(
        tiers=(
            TierConfig("hbm", capacity, 0.0, 2000.0),
            TierConfig("dram", capacity, 2.0, 25.0),
            TierConfig("nvme", capacity, 80.0, 6.0),
        ),
        policy=PolicyConfig(policy),
    )
    core = Core(config)

    def batch(seq: int, start: int, stop: int) -> pb.IntentBatch:
        events = []
        for i in range(start, stop):
            request, k = divmod(i, BLOCKS_PER_REQUEST)
            rid = f"~{request:014x}~c0/r{request}"
            intent = pb.MemoryIntent(
                block_id=f"{rid}/b{k}",
                request_id=rid,
                phase=pb.PHASE_DECODE,
                priority=pb.PRIORITY_HOT if i % 2 else pb.PRIORITY_WARM,
                size_bytes=BLOCK_BYTES,
                recompute_cost_us=800,
                token_start=k * 16,
                token_count=16,
                parent_block_id=f"{rid}/b{k - 1}" if k else "",
                request_priority=50,
            )
            if i % 4 == 0:
                intent.deadline_us = 1_000_000 + i
            events.append(pb.Event(ts_us=i, allocated=pb.BlockAllocated(intent=intent)))
        return pb.IntentBatch(client_id="memory-bench", batch_seq=seq, events=events)

    # Warm up the code paths (and their caches) on a few blocks, counted in the figure.
    first = min(CHUNK, blocks)
    outcome = apply_batch(core, batch(1, 0, first))
    gc.collect()
    before = rss()
    started = time.perf_counter()
    seq, done, rejected = 2, first, len(outcome.rejections)
    while done < blocks:
        stop = min(done + CHUNK, blocks)
        outcome = apply_batch(core, batch(seq, done, stop))
        rejected += len(outcome.rejections)
        core.take_directives()
        seq, done = seq + 1, stop
    seconds = time.perf_counter() - started
    for tier in core.tiers:
        tier.policy.choose_victims(1, frozenset())
    gc.collect()
    after = rss()
    added = blocks - first
    pauses = []
    for _ in range(3):
        t0 = time.perf_counter()
        gc.collect()
        pauses.append(time.perf_counter() - t0)
    tracked = len(gc.get_objects())
    if rejected or len(core.blocks) != blocks:
        raise RuntimeError(f"memory bench: {rejected} allocations rejected, {len(core.blocks)} blocks tracked of {blocks}")
    record: dict[str, Any] = {
        "kind": "memory",
        "blocks": blocks,
        "policy": policy,
        "rss_before_bytes": before,
        "rss_after_bytes": after,
        "rss_bytes_per_block": round((after - before) / added, 1) if added else None,
        "allocations_per_s": round(added / seconds, 1) if seconds > 0 else None,
        "gc_tracked_objects": tracked,
        "gc_full_ms": round(sorted(pauses)[1] * 1000, 1),
    }
    if with_breakdown:
        rows = breakdown(core, blocks)
        record["breakdown"] = rows
        record["counted_bytes_per_block"] = round(sum(row["bytes_per_block"] for row in rows), 1)
    return record


def allocated_size(obj: object) -> int:
    """The bytes ``obj`` takes from the allocator: ``sys.getsizeof`` (the cyclic collector's
    header included) rounded up to pymalloc's 16-byte size classes (larger blocks, from
    malloc, are rounded the same way)."""
    return (sys.getsizeof(obj) + 15) & ~15


_NOT_STATE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.CodeType)


def breakdown(core: Core, blocks: int) -> list[dict[str, Any]]:
    """Where the held blocks' bytes are: every object reachable from the core's per-block
    state (``core``) and then from each tier's policy (``policy``), by owner and type, in
    allocated bytes per block. Each object is counted once, under the first owner that
    reaches it (a block and its ids are the core's even though policies refer to them);
    the config, clock, tier descriptions and policy parameters are shared, not per block,
    and types, modules and functions are not state: none of them is counted. The walk
    follows ``gc.get_referents`` (what an object's traverse visits: compiled classes,
    tuples, lists, dicts, sets), so it sees what the interpreter sees, not what a
    ``__slots__`` list claims."""
    seen = {id(core.config), id(core.clock), id(core.tiers), id(core)}
    for tier in core.tiers:
        seen.update((id(tier), id(tier.info), id(tier.policy.ctx), id(tier.policy.params)))
    rows: dict[tuple[str, str], list[int]] = {}

    def walk(owner: str, roots: list[object]) -> None:
        stack = [r for r in roots if id(r) not in seen]
        seen.update(id(r) for r in stack)
        while stack:
            obj = stack.pop()
            row = rows.setdefault((owner, type(obj).__name__), [0, 0])
            row[0] += 1
            row[1] += allocated_size(obj)
            for ref in gc.get_referents(obj):
                if id(ref) not in seen and not isinstance(ref, _NOT_STATE):
                    seen.add(id(ref))
                    stack.append(ref)

    walk("core", [core.blocks, core.by_request, core.by_owner, core.client_seq, core.outstanding, core.tenant_blocks])
    walk("policy", [tier.policy for tier in core.tiers])
    ordered = sorted(rows.items(), key=lambda kv: (kv[0][0] != "core", -kv[1][1]))
    return [
        {"owner": owner, "type": name, "objects": count, "bytes_per_block": round(size / blocks, 1)}
        for (owner, name), (count, size) in ordered
    ]


def measure_blocks(blocks: int, policy: str = "deadline_edf", timeout: float = 600.0, *, with_breakdown: bool = False) -> dict[str, Any]:
    """The figure for ``blocks`` blocks, measured in a fresh process (with ``breakdown``'s
    rows under ``breakdown`` when asked)."""
    if blocks <= CHUNK:
        raise ValueError(f"blocks: need more than {CHUNK} (the warm-up), got {blocks}")
    done = subprocess.run(
        [sys.executable, "-m", "broker.bench.memory", "--child", str(blocks), "--policy", policy]
        + (["--breakdown"] if with_breakdown else []),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory bench at {blocks} blocks failed: {done.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def main(argv: list[str] | None = None) -> int:
    from broker.bench.targets import MEMORY_POLICIES, memory_lines, render

    parser = argparse.ArgumentParser(description="RSS per tracked block of the broker's core")
    parser.add_argument("--blocks", default="100000,1000000", help="comma-separated block counts (each in a fresh process)")
    parser.add_argument("--policy", default="deadline_edf", help="comma-separated policies (each block count in a fresh process)")
    parser.add_argument(
        "--targets",
        action="store_true",
        help=f"measure the five policies of the memory target ({','.join(MEMORY_POLICIES)}) and print each one's target line",
    )
    parser.add_argument("--quick", action="store_true", help="20,000 blocks only: checks the output, not the figure (the target is at 1M)")
    parser.add_argument("--json", action="store_true", help="one JSON record per block count")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also count the objects the blocks hold, by owner (core, policy) and type, in bytes per block",
    )
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.policy, args.breakdown)))
        return 0
    policies = MEMORY_POLICIES if args.targets else tuple(p for p in args.policy.split(",") if p.strip())
    sizes = [20_000] if args.quick else [int(b) for b in args.blocks.split(",") if b.strip()]
    records = []
    for policy in policies:
        for blocks in sizes:
            record = measure_blocks(blocks, policy, with_breakdown=args.breakdown)
            records.append(record)
            if args.json:
                print(json.dumps(record), flush=True)
                continue
            print(
                f"{blocks:>10,} blocks  {record['rss_bytes_per_block']:>8.1f} bytes of RSS per block  "
                f"({record['policy']}, {record['allocations_per_s']:,.0f} allocations/s; "
                f"full gc {record['gc_full_ms']:.1f} ms over {record['gc_tracked_objects']:,} tracked objects)",
                flush=True,
            )
            if args.breakdown:
                print(breakdown_table(record), flush=True)
    if not args.json:
        print()
        print(render("memory (RSS per tracked block, policy state included)", memory_lines(records, policies), quick=args.quick))
    return 0


def breakdown_table(record: dict[str, Any]) -> str:
    """The breakdown rows of a record, and what RSS holds beyond the objects counted
    (the allocator's free and partly used space, the interpreter's own growth)."""
    lines = [f"    {'owner':<7} {'type':<24} {'objects':>11} {'bytes/block':>12}"]
    for row in record["breakdown"]:
        if row["bytes_per_block"] >= 0.1:
            lines.append(f"    {row['owner']:<7} {row['type']:<24} {row['objects']:>11,} {row['bytes_per_block']:>12.1f}")
    counted = record["counted_bytes_per_block"]
    lines.append(f"    {'':<7} {'counted':<24} {'':>11} {counted:>12.1f}")
    lines.append(f"    {'':<7} {'RSS beyond the counted':<24} {'':>11} {record['rss_bytes_per_block'] - counted:>12.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
