#!/usr/bin/env python3
"""Golden prefix-hit counts of every policy on the bundled Mooncake trace.

The test (tests/policies/test_golden_replay.py) replays each registered policy at each
size and compares with tests/data/golden_mooncake.json. When a change of behaviour is
intended, re-print the file and review the diff (as a module: run as a script, the
tests/broker folder would shadow the broker package):

    python -m tests.golden_mooncake > tests/data/golden_mooncake.json
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

from broker.replay.replay import replay
from broker.replay.sweep import single_tier
from broker.replay.traces import TraceOptions, read_trace
from kvbroker.v1 import intent_pb2 as pb
from policies import registry
from tests.golden import MOONCAKE

SIZES_TOKENS = (500_000, 1_000_000, 3_000_000)
BYTES_PER_TOKEN = TraceOptions.bytes_per_token


def prompt_batches() -> list[pb.IntentBatch]:
    return list(read_trace(str(MOONCAKE), "mooncake", TraceOptions(decode=False)))


def hits(batches: list[pb.IntentBatch], policy: str, tokens: int) -> dict[str, Any]:
    def source() -> Iterator[tuple[int, pb.IntentBatch]]:
        return ((1, b) for b in batches)

    m = replay(source, single_tier(tokens * BYTES_PER_TOKEN), policy).metrics
    return {"prefix_hits": m["prefix_hits"], "evictions": m["evictions"]}


def main() -> int:
    batches = prompt_batches()
    table = {name: {str(t): hits(batches, name, t) for t in SIZES_TOKENS} for name in registry.names()}
    header = {"trace": "mooncake synthetic_trace.jsonl, --no-decode, one tier", "sizes_tokens": SIZES_TOKENS}
    json.dump({**header, "policies": table}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
