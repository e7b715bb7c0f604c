#!/usr/bin/env python3
"""Replay speed: events per second per policy, on the bundled Mooncake trace.

The events are imported once and serialized, as a journal holds them (the importer is not
what is measured); each policy then replays those bytes through the same reader and core
the live broker runs, on one core.

    python bench/replay_speed.py                      # every policy, decode mode (~720k events)
    python bench/replay_speed.py --no-decode --policies lru,deadline_edf
    python bench/replay_speed.py --json
    python bench/replay_speed.py --repeat 5             # median of 5 runs per policy (shared machines)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from broker.config import CoreConfig, TierConfig
from broker.replay.replay import replay
from broker.replay.traces import TraceOptions, read_trace
from policies import registry

# The bundled copy of the Mooncake trace (tests/data/mooncake/README.md).
TRACE = os.path.join(os.path.dirname(__file__), "..", "tests", "data")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=os.path.join(TRACE, "mooncake", "synthetic_trace.jsonl"))
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument("--policies", default="")
    parser.add_argument("--hbm-tokens", type=int, default=3_000_000)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeat", type=int, default=1, help="runs per policy; the median is reported")
    args = parser.parse_args()
    opts = TraceOptions(decode=not args.no_decode)
    started = time.perf_counter()
    messages = list(read_trace(args.trace, "mooncake", opts))
    events = sum(len(b.events) for b in messages)
    batches = [b.SerializeToString() for b in messages]
    del messages
    imported = time.perf_counter() - started
    hbm = args.hbm_tokens * opts.bytes_per_token
    config = CoreConfig(
        tiers=(
            TierConfig("hbm", hbm, 0.0, 2000.0),
            TierConfig("dram", 4 * hbm, 2.0, 25.0),
        )
    )
    names = [p for p in args.policies.split(",") if p] or registry.names()
    records = []
    if not args.json:
        print(f"{events:,} events in {len(batches):,} batches (import {imported:.1f}s, not counted)")
    for name in names:
        runs = [replay(lambda: ((1, b) for b in batches), config, name) for _ in range(max(1, args.repeat))]
        seconds = statistics.median(r.seconds for r in runs)
        events = runs[0].events
        rate = events / seconds
        records.append({"policy": name, "events": events, "seconds": seconds, "events_per_s": rate, "runs": len(runs)})
        if not args.json:
            rates = [events / r.seconds for r in runs]
            spread = f", {min(rates):,.0f}..{max(rates):,.0f}" if len(runs) > 1 else ""
            print(f"{name:<20} {rate:>10,.0f} events/s  ({seconds:.1f}s{spread})", flush=True)
    if args.json:
        print(json.dumps(records, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
