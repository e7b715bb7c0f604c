#!/usr/bin/env python3
"""Per-policy operations per second at 10k and 1M resident blocks.

Each policy serves one tier holding N blocks of equal size, filled first, then driven
through the same seeded mix as the core drives it: 4 accesses of resident blocks, 1 intent
update, and 1 insert of a new block that first evicts (choose_victims + evicted) one. The
cost per operation at 1M must stay within 3x of the cost at 10k for every policy: proof
that no operation scans the resident blocks.

    python bench/policy_ops.py                  # 10k and 1M, every policy
    python bench/policy_ops.py --sizes 10000,100000 --ops 50000 --policies lru,arc
    python bench/policy_ops.py --json

Figures depend on the machine; the ratio is what the check reads.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from typing import Any

from policies import registry
from policies.base import Block, Clock, FutureUses, PolicyContext, Priority, TierInfo
from policies.registry import make_params, policy_class

BLOCK = 1024
MIX = ("access", "access", "access", "access", "update", "insert")


def run(name: str, resident: int, ops: int, seed: int = 1) -> dict[str, Any]:
    rng = random.Random(seed)
    # The operation sequence is fixed up front, so offline policies can be given its future.
    plan: list[tuple[str, int]] = []
    next_id = resident
    live = list(range(resident))
    for _ in range(ops):
        op = rng.choice(MIX)
        if op == "insert":
            plan.append((op, next_id))
            next_id += 1
        else:
            plan.append((op, rng.randrange(resident)))  # index into the live list, resolved at run time
    cls = policy_class(name)
    clock = Clock()
    info = TierInfo(0, "hbm", resident * BLOCK, 0.0, 1000.0)
    future = None
    if cls.offline:
        uses: dict[str, list[int]] = {}
        # Ordinals: the fill is 0..resident-1, then one per planned op.
        shadow = list(range(resident))
        for i, (op, arg) in enumerate(plan):
            if op == "access":
                uses.setdefault(f"b{shadow[arg]}", []).append(resident + i)
            elif op == "insert":
                uses.setdefault(f"b{arg}", []).append(resident + i)
                # Which block the insert evicts is the policy's choice, unknown up front: the
                # future given to offline policies is an approximation, good for timing only.
                shadow[rng.randrange(resident)] = arg
        future = FutureUses(uses, clock)
    policy = cls(PolicyContext(info, (info,), clock, future), make_params(cls, None))
    blocks: dict[int, Block] = {}
    slot_of = {i: i for i in range(resident)}
    for i in range(resident):
        clock.event_index = i
        clock.now_us = i
        b = Block(f"b{i}", BLOCK)
        b.priority = (Priority.COLD, Priority.WARM, Priority.HOT)[i % 3]
        blocks[i] = b
        policy.insert(b)
    gc.collect()
    started = time.perf_counter()
    for i, (op, arg) in enumerate(plan):
        clock.event_index = resident + i
        clock.now_us = resident + i
        if op == "access":
            b = blocks[live[arg]]
            b.accesses += 1
            b.last_access_us = clock.now_us
            policy.access(b)
        elif op == "update":
            b = blocks[live[arg]]
            b.priority = Priority.HOT if b.priority != Priority.HOT else Priority.WARM
            policy.update(b)
        else:
            victims = policy.choose_victims(BLOCK, frozenset())
            assert victims, f"{name}: no victim in a full tier"
            for v in victims:
                policy.evicted(v)
                index = int(v.block_id[1:])
                del blocks[index]
                # The new block takes the victim's slot in the live list: O(1) at every size.
                slot = slot_of.pop(index)
            b = Block(f"b{arg}", BLOCK)
            blocks[arg] = b
            policy.insert(b)
            live[slot] = arg
            slot_of[arg] = slot
    elapsed = time.perf_counter() - started
    ns = elapsed / ops * 1e9
    return {"policy": name, "resident": resident, "ops": ops, "seconds": elapsed, "ns_per_op": ns, "ops_per_s": ops / elapsed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,1000000")
    parser.add_argument("--ops", type=int, default=100_000)
    parser.add_argument("--policies", default="")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    names = [p for p in args.policies.split(",") if p] or registry.names()
    records = []
    failed = []
    for name in names:
        row = [run(name, n, args.ops) for n in sizes]
        ratio = row[-1]["ns_per_op"] / row[0]["ns_per_op"]
        for r in row:
            r["ratio_to_smallest"] = r["ns_per_op"] / row[0]["ns_per_op"]
        records.extend(row)
        ok = ratio <= 3.0
        if not ok:
            failed.append(name)
        if not args.json:
            cells = "  ".join(f"{r['resident']:>9,}: {r['ops_per_s']:>10,.0f} ops/s ({r['ns_per_op']:>7,.0f} ns)" for r in row)
            print(f"{name:<20} {cells}  ratio {ratio:4.2f} {'ok' if ok else 'OVER 3x'}", flush=True)
        gc.collect()
    if args.json:
        print(json.dumps(records, indent=2))
    if failed:
        print(f"cost per operation grew more than 3x for: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
