"""The compiled build against the pure Python reference, on random event streams.

``outcome(policy, seed)`` applies a seeded random stream of IntentBatches (allocations with
parents, deadlines, priorities and prefix reuse, accesses, intent updates, releases, frees,
request-scoped uses, refreshes and scope ends, acks of past and made-up directives, clears,
duplicates and out-of-order batches) to a
core on small tiers, so that evictions, demotions and prefetches happen, and returns
everything the core decided: each batch's directives and rejections, then the residency of
every block and the metrics. Run as a module with ``--pure``, it first makes Python import
the source of every module broker/native.py builds (and none of the C extensions, whose
pure fallbacks then run): the reference. Equal outcomes, compiled and pure, are the
differential test (tests/broker/model/test_differential.py).

    python -m tests.broker.model.differential --pure --policy lru --seed 3
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import random
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from broker import native

TIERS = """
[[tiers]]
name = "hbm"
capacity = 6000
read_latency_us = 0.0
bandwidth_gb_per_s = 2000.0

[[tiers]]
name = "dram"
capacity = 12000
read_latency_us = 2.0
bandwidth_gb_per_s = 25.0

[[tiers]]
name = "nvme"
capacity = 40000
read_latency_us = 80.0
bandwidth_gb_per_s = 6.0
"""


class PureSources(importlib.abc.MetaPathFinder):
    """Imports each module broker/native.py compiles from its source, and refuses the C
    extensions (so their pure fallbacks run)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in native.C_EXTENSIONS or fullname.startswith(native.GROUP):
            raise ModuleNotFoundError(f"{fullname}: the pure reference runs without it", name=fullname)
        if fullname in native.COMPILED_MODULES:
            return importlib.util.spec_from_file_location(fullname, native.source(fullname))
        return None


def force_pure() -> None:
    """Must run before anything of the project but broker.native is imported."""
    loaded = [m for m in (*native.BUILT_MODULES, "broker.model.wire", "broker.model.apply") if m in sys.modules]
    if loaded:
        raise RuntimeError(f"already imported: {', '.join(loaded)}")
    sys.meta_path.insert(0, PureSources())


def build_flavour() -> str:
    """'compiled' when the core in use is a compiled extension, else 'pure'."""
    import broker.model.core
    import broker.model.wire

    compiled = not str(broker.model.core.__file__).endswith(".py")
    return "compiled" if compiled or broker.model.wire.native is not None else "pure"


def random_batches(seed: int, batches: int = 60, per_batch: int = 12) -> list[bytes]:
    """Serialized IntentBatches of one client (and, now and then, a second one)."""
    from kvbroker.v1 import intent_pb2 as pb

    rng = random.Random(seed)
    live: list[str] = []  # allocated by client 0, not freed
    released: list[str] = []
    next_id = 0
    ts = 0
    out: list[bytes] = []
    seqs = {"c0": 0, "c1": 0}
    for _ in range(batches):
        client = "c1" if rng.random() < 0.1 else "c0"
        events = []
        for _ in range(rng.randint(1, per_batch)):
            ts += rng.randint(0, 400)
            roll = rng.random()
            if roll < 0.35 or not live:
                reuse_id = released and rng.random() < 0.3
                if reuse_id:
                    block_id = released.pop(rng.randrange(len(released)))
                else:
                    block_id = f"{client}/b{next_id}"
                    next_id += 1
                request = f"r{rng.randint(0, 12)}"
                intent = pb.MemoryIntent(
                    block_id=block_id,
                    request_id=request,
                    size_bytes=rng.choice((500, 500, 1000, 1500)),
                    phase=rng.choice((pb.PHASE_PREFILL, pb.PHASE_DECODE)),
                    priority=rng.choice((pb.PRIORITY_COLD, pb.PRIORITY_WARM, pb.PRIORITY_HOT) * 4 + (pb.PRIORITY_DECODE_CRITICAL,)),
                    recompute_cost_us=rng.randint(0, 5000),
                    request_priority=rng.randint(0, 100),
                    token_start=rng.randint(0, 64) * 16,
                    token_count=16,
                )
                if live and rng.random() < 0.5:
                    intent.parent_block_id = rng.choice(live)
                if rng.random() < 0.4:
                    intent.deadline_us = ts + rng.randint(-500, 20_000)
                if rng.random() < 0.03:
                    intent.pin_requested = True
                tier = rng.choice(("",) * 12 + ("dram", "dram", "nvme", "tape"))
                scope = request if rng.random() < 0.3 else ""  # a request-scoped allocation
                allocated = pb.BlockAllocated(intent=intent, tier=tier, reuse=rng.random() < 0.2, scope=scope)
                events.append(pb.Event(ts_us=ts, allocated=allocated))
                if client == "c0" and block_id not in live:
                    live.append(block_id)
            elif roll < 0.6:
                ids = rng.sample(live, min(len(live), rng.randint(1, 6)))
                if rng.random() < 0.05:
                    ids.append("never-allocated")
                accessed = pb.BlocksAccessed(block_ids=ids)
                kind = rng.random()
                if kind < 0.3:  # request-scoped, with token positions
                    accessed.scope = f"r{rng.randint(0, 12)}"
                    accessed.token_positions.extend(rng.randint(0, 64) * 16 for _ in ids)
                elif kind < 0.4:  # a refresh (used, not read)
                    accessed.refresh_only = True
                if rng.random() < 0.1:
                    accessed.ends_scope = f"r{rng.randint(0, 12)}"
                events.append(pb.Event(ts_us=ts, accessed=accessed))
            elif roll < 0.72:
                update = pb.IntentUpdated(block_id=rng.choice(live))
                if rng.random() < 0.5:
                    update.priority = rng.choice((pb.PRIORITY_COLD, pb.PRIORITY_WARM, pb.PRIORITY_HOT) * 3 + (pb.PRIORITY_DECODE_CRITICAL,))
                if rng.random() < 0.5:
                    update.deadline_us = ts + rng.randint(0, 30_000)
                events.append(pb.Event(ts_us=ts, intent_updated=update))
            elif roll < 0.82:
                ids = rng.sample(live, min(len(live), rng.randint(1, 4)))
                for block_id in ids:
                    live.remove(block_id)
                    released.append(block_id)
                events.append(pb.Event(ts_us=ts, released=pb.BlocksReleased(block_ids=ids)))
            elif roll < 0.9:
                ids = rng.sample(live, min(len(live), rng.randint(1, 3)))
                for block_id in ids:
                    live.remove(block_id)
                events.append(pb.Event(ts_us=ts, freed=pb.BlocksFreed(block_ids=ids)))
            elif roll < 0.98:
                status = pb.ACK_STATUS_FAILED if rng.random() < 0.2 else pb.ACK_STATUS_DONE
                acked = pb.DirectiveAcked(directive_id=rng.randint(1, 40), status=status)
                events.append(pb.Event(ts_us=ts, acked=acked))
            else:
                events.append(pb.Event(ts_us=ts, cleared=pb.AllBlocksCleared()))
                if client == "c0":
                    live.clear()
                    released.clear()
        seqs[client] += 1
        seq = seqs[client]
        if rng.random() < 0.03 and seq > 1:
            seq -= 1  # a duplicate (or stale) batch: refused as a whole
        out.append(pb.IntentBatch(client_id=client, batch_seq=seq, events=events).SerializeToString())
    return out


def outcome(policy: str, seed: int) -> dict[str, Any]:
    """Everything the core decided on the seeded stream, as JSON-ready values."""
    from broker.config import parse_config
    from broker.model.apply import apply_batch
    from broker.model.core import Core

    config = parse_config(f'[policy]\nname = "{policy}"\n\n{TIERS}').core
    core = Core(config)
    per_batch = []
    for raw in random_batches(seed):
        result = apply_batch(core, raw)
        per_batch.append(
            {
                "applied": result.applied,
                "duplicate": result.duplicate,
                "accepted": result.accepted,
                "directives": [list(d.key()) for d in result.directives],
                "rejections": [[r.index, r.field, r.reason, r.code] for r in result.rejections],
            }
        )
        core.take_directives()
    residency = {
        block_id: [b.tier, b.pinned, b.refs, b.released, b.priority, b.deadline_us, b.accesses, b.reuses]
        for block_id, b in sorted(core.blocks.items())
    }
    tiers = [[t.name, t.used, t.blocks, t.pinned_bytes] for t in core.tiers]
    metrics = core.stats.as_dict([t.name for t in core.tiers])
    return {"batches": per_batch, "residency": residency, "tiers": tiers, "metrics": json.loads(json.dumps(metrics, default=str))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pure", action="store_true", help="import the pure Python sources of the compiled modules")
    ap.add_argument("--policy", required=True, help="comma-separated")
    ap.add_argument("--seed", type=int, required=True)
    args = ap.parse_args(argv)
    if args.pure:
        force_pure()
    found = {policy: outcome(policy, args.seed) for policy in args.policy.split(",")}
    print(json.dumps({"build": build_flavour(), "outcomes": found}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
