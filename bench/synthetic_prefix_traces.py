#!/usr/bin/env python3
"""Seeded Mooncake-format traces for checking a policy away from the Mooncake trace.

    python bench/synthetic_prefix_traces.py two_turn_chat > /tmp/two_turn.jsonl
    python bench/synthetic_prefix_traces.py zipf_docs_scan > /tmp/zipf_scan.jsonl
    kvbroker replay --trace /tmp/two_turn.jsonl --format mooncake --no-decode --hbm 20000tok,60000tok,200000tok --policies lru,adaptive

- ``two_turn_chat``: 3,000 conversations, each a first prompt of 4-40 new blocks and, a
  gap of 0-400 requests later (uniform), a second prompt that reuses the whole first one
  plus 1-4 new blocks; never a third. Every block is reused once at most: the workload
  where keeping "blocks reused before" first is worthless and recency is all there is.
- ``zipf_docs_scan``: 400 documents of 8-64 blocks with Zipf(0.9) popularity, each prompt a
  document plus a one-block question; one prompt in three is instead a one-time scan of
  20-120 new blocks. Frequency matters; scans must not flush the popular documents.

Nothing here was fitted to a policy: the shapes are the two extremes a prefix cache sees.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator


def two_turn_chat(seed: int = 1) -> Iterator[list[int]]:
    rng = random.Random(seed)
    next_id = 0
    pending: list[tuple[int, list[int]]] = []  # (request index due, prompt to extend)
    request = 0
    conversations = 3000
    started = 0
    while started < conversations or pending:
        due = [p for p in pending if p[0] <= request]
        if due:
            pending.remove(due[0])
            prompt = due[0][1] + list(range(next_id, next_id + rng.randint(1, 4)))
            next_id = prompt[-1] + 1
        elif started < conversations:
            prompt = list(range(next_id, next_id + rng.randint(4, 40)))
            next_id = prompt[-1] + 1
            pending.append((request + rng.randint(0, 400), prompt))
            started += 1
        else:
            pending.sort()
            request = pending[0][0]
            continue
        yield prompt
        request += 1


def zipf_docs_scan(seed: int = 1) -> Iterator[list[int]]:
    rng = random.Random(seed)
    docs = 400
    next_id = 0
    chains = []
    for _ in range(docs):
        n = rng.randint(8, 64)
        chains.append(list(range(next_id, next_id + n)))
        next_id += n
    weights = [1.0 / (rank + 1) ** 0.9 for rank in range(docs)]
    for _ in range(6000):
        if rng.random() < 1 / 3:
            n = rng.randint(20, 120)
            yield list(range(next_id, next_id + n))
        else:
            doc = rng.choices(range(docs), weights)[0]
            yield [*chains[doc], next_id]
            n = 1
        next_id += n


def main(argv: list[str]) -> int:
    generators = {"two_turn_chat": two_turn_chat, "zipf_docs_scan": zipf_docs_scan}
    if len(argv) != 1 or argv[0] not in generators:
        print(f"usage: {sys.argv[0]} {{{','.join(generators)}}}", file=sys.stderr)
        return 2
    for i, hashes in enumerate(generators[argv[0]]()):
        print(json.dumps({"timestamp": i, "input_length": 512 * len(hashes), "output_length": 1, "hash_ids": hashes}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
