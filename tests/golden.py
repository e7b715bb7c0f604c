"""The bundled real trace, and an independent computation of prefix hit ratios on it.

Independent means: written from the methodology alone (requests in timestamp order, blocks
in order, every block one 512-token block, one cache that takes every missed block), with
none of the broker's code, so the broker's replay can be checked against it.
"""

from __future__ import annotations

import collections
import heapq
import json
import pathlib

# The traces the tests need are kept in the repository (tests/data/*/README.md: origin and
# licence), so a fresh clone runs its tests with nothing beside it.
DATA = pathlib.Path(__file__).resolve().parent / "data"
MOONCAKE = DATA / "mooncake" / "synthetic_trace.jsonl"
KVDS_DEADLINE_PRESSURE = DATA / "kvds" / "deadline_pressure.jsonl"


def block_sequence() -> list[int]:
    requests = [json.loads(line) for line in MOONCAKE.read_text().splitlines() if line.strip()]
    requests.sort(key=lambda r: r["timestamp"])
    return [h for r in requests for h in r["hash_ids"]]


def lru_hits(seq: list[int], capacity: int) -> int:
    cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    hits = 0
    for h in seq:
        if h in cache:
            hits += 1
            cache.move_to_end(h)
        else:
            cache[h] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def belady_hits(seq: list[int], capacity: int) -> int:
    """Belady's MIN: on a miss with a full cache, drop the cached block used farthest ahead."""
    never = len(seq) + 1
    next_use = [never] * len(seq)
    last: dict[int, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        next_use[i] = last.get(seq[i], never)
        last[seq[i]] = i
    cached: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    hits = 0
    for i, h in enumerate(seq):
        if h in cached:
            hits += 1
        else:
            while len(cached) >= capacity:
                neg, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg:
                    del cached[victim]
        cached[h] = next_use[i]
        heapq.heappush(heap, (-next_use[i], h))
    return hits
