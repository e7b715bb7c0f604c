"""Belady's choice run through vLLM's CPU tier as its scheduler uses it: the reference a
policy's hits inside vLLM are shown against (``share of Belady``).

Each request looks its chunks up in order until the first miss (the hits), then stores the
chunks it does not hold; when the tier is full, the chunks whose next use lies farthest in
the future leave first, and a chunk being stored may itself be the one that leaves (it is
then not stored: admission, which vLLM allows through ``store_threshold`` and a policy's
``evict`` returning None). Next use is the next request that names the chunk.

With prefix lookups this is a reference, not a proven bound: a chunk is worth something
only while the chunks before it in its prompts are held too, which farthest-next-use does
not weigh, so an online policy can in principle pass it. Measured on the project's traces it
stays well above every online policy (docs/policies.md).

O(log n) per chunk: one heap of (next use, chunk) entries, stale entries skipped when popped.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

NEVER = 1 << 62


def belady_prefix_hits(requests: Sequence[Sequence[Hashable]], num_chunks: int) -> int:
    """Chunks hit by ``requests`` (each a prompt's chunk ids, in order) through a tier of
    ``num_chunks`` chunks run by Belady's choice with prefix lookups."""
    if num_chunks < 1:
        raise ValueError(f"num_chunks: {num_chunks} is below 1")
    # Next use of each chunk after each request that names it, computed backwards.
    upcoming: dict[Hashable, int] = {}
    next_after: list[list[int]] = [[] for _ in requests]
    for n in range(len(requests) - 1, -1, -1):
        row = next_after[n]
        for chunk in requests[n]:
            row.append(upcoming.get(chunk, NEVER))
        for chunk in requests[n]:
            upcoming[chunk] = n
    held: dict[Hashable, int] = {}  # chunk -> its next use
    heap: list[tuple[int, int, Hashable]] = []  # (-next use, tie, chunk): farthest on top
    tie = 0
    hits = 0
    for n, chunks in enumerate(requests):
        prefix = True
        for i, chunk in enumerate(chunks):
            if prefix and chunk in held:
                hits += 1
            else:
                prefix = False
            nxt = next_after[n][i]
            if held.get(chunk) != nxt:
                held[chunk] = nxt
                tie += 1
                heapq.heappush(heap, (-nxt, tie, chunk))
        while len(held) > num_chunks:
            neg, _, chunk = heapq.heappop(heap)
            if held.get(chunk) == -neg:
                del held[chunk]
    return hits
