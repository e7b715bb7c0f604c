#!/usr/bin/env python3
"""Bytes per ghost (the history the core keeps of a freed block, docs/configuration.md's
``history.ghosts``): the RSS an embedded core (vLLM's CPU tier, one byte a chunk) grows by
while it files ``--ghosts`` ghosts, over the ghosts filed, and the RSS of a long run that
stores and evicts far more chunks than the bound keeps (it must stay flat).

    python bench/ghost_memory.py                       # 200,000 ghosts, 32-hex-digit ids
    python bench/ghost_memory.py --broker --blocks 2000000 --max-ghosts 1000000
        # kvbroker serve's core at the default tiers: one client allocates and frees 1-byte
        # blocks (issue 41 item 12); the ghosts stop at history.max_ghosts
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from broker.bench.memory import rss
from vllm_integration.decisions_to_vllm import intent_bytes
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.settings import OffloadSettings

PLAIN = intent_bytes.intent_fields("")  # a chunk's MemoryIntent after its id, as the adapter sends it (size 1)


def churn(core: EmbeddedCore, start: int, count: int, capacity: int) -> None:
    """Store ``count`` new chunks one after another, each evicting the oldest once full:
    every eviction is EvictionRequested + freed (a ghost), as the adapter sends them."""
    ts = intent_bytes.timestamp(1)
    for n in range(start, start + count):
        batch = []
        if n >= capacity:
            batch.append(intent_bytes.eviction_requested(ts, 1, []))
        batch.append(intent_bytes.allocated(ts, intent_bytes.id_field(f"{n:032x}"), PLAIN))
        outcome = core.apply(batch)
        if outcome.directives:
            core.apply([intent_bytes.freed(ts, [intent_bytes.id_field(d.block_id) for d in outcome.directives])])


def broker_churn(max_ghosts: int, blocks: int) -> int:
    """The broker's core (default tiers, history.ghosts 8) with ``history.max_ghosts``: one
    client allocates and frees ``blocks`` distinct 1-byte blocks, 200 a batch."""
    from broker.config import parse_config
    from broker.model.apply import apply_batch
    from broker.model.core import Core
    from kvbroker.v1 import intent_pb2 as pb

    core = Core(parse_config(f"[history]\nmax_ghosts = {max_ghosts}\n").core)
    before = rss()
    for seq, start in enumerate(range(0, blocks, 200), start=1):
        ids = [f"{n:032x}" for n in range(start, min(start + 200, blocks))]
        events = [pb.Event(ts_us=start, allocated=pb.BlockAllocated(intent=pb.MemoryIntent(block_id=i, size_bytes=1))) for i in ids]
        events.append(pb.Event(ts_us=start, freed=pb.BlocksFreed(block_ids=ids)))
        apply_batch(core, pb.IntentBatch(client_id="abuser", batch_seq=seq, events=events))
    grown = rss() - before
    ghosts = len(core.ghosts)
    per = f", {grown / ghosts:.0f} bytes per ghost" if ghosts else ""
    print(f"history.max_ghosts {max_ghosts:,}: {blocks:,} 1-byte blocks freed, {ghosts:,} ghosts kept, RSS +{grown / 2**20:.1f} MiB{per}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--ghosts", type=int, default=200_000, help="ghosts to file (the bound is set to hold them all)")
    parser.add_argument("--capacity", type=int, default=1_000, help="the CPU tier's chunks")
    parser.add_argument("--broker", action="store_true", help="the broker's core and 1-byte blocks instead (--blocks, --max-ghosts)")
    parser.add_argument("--blocks", type=int, default=2_000_000, help="--broker: 1-byte blocks allocated and freed")
    parser.add_argument("--max-ghosts", type=int, default=1_000_000, help="--broker: history.max_ghosts (0: the bytes bound alone)")
    args = parser.parse_args()
    if args.broker:
        return broker_churn(args.max_ghosts, args.blocks)
    multiple = args.ghosts / args.capacity
    core = EmbeddedCore(OffloadSettings(policy="lru", history_ghosts=multiple), args.capacity, journal=False)
    churn(core, 0, args.capacity, args.capacity)  # fill the tier first: its blocks are not ghosts
    before = rss()
    churn(core, args.capacity, args.ghosts, args.capacity)
    grown = rss() - before
    ghosts = len(core.core.ghosts)
    print(f"{ghosts:,} ghosts: RSS +{grown / 2**20:.1f} MiB, {grown / ghosts:.0f} bytes per ghost")
    # The bound holds: as many chunks again churn through, the ghosts stay at the bound.
    churn(core, args.capacity + args.ghosts, args.ghosts, args.capacity)
    after = rss()
    print(f"after {args.ghosts:,} more evictions: {len(core.core.ghosts):,} ghosts, RSS {(after - before - grown) / 2**20:+.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
