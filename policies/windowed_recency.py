"""windowed_recency: kv-hierarchy-lab's windowed recency; fewest hits in the last W reads leaves first."""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

from policies.base import Block, PolicyContext
from policies.params import bounded
from policies.scored import Key, StepScoredPolicy


@dataclasses.dataclass(frozen=True)
class WindowedRecencyParams:
    """``window``: how many of the latest reads count as hits (the lab's W = 32);
    ``hit_weight``: steps of recency one hit is worth (the lab's 1e6)."""

    window: int = bounded(32, 1, 1_000_000)
    hit_weight: int = bounded(1_000_000, 0, 10**12)

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1, got {self.window!r}")
        if not isinstance(self.hit_weight, int) or self.hit_weight < 0:
            raise ValueError(f"hit_weight must be an integer >= 0, got {self.hit_weight!r}")


class WindowedRecencyPolicy(StepScoredPolicy):
    """Evicts the lowest (hits in the last W reads) x 1e6 + last step.

    Structures: the ``ScoredPolicy`` SortedList of (score, block id), smallest first, the
    dict of each block's current entry and of its last step; a deque of the ids of the last
    W reads this policy saw, and a dict id -> its hits in that deque (ids with no hit are
    absent; ids of blocks that left stay counted, so a block that comes back within the
    window keeps its hits).

    1. ``insert``: last step = the current step; key = (hits x 1e6 + last, id).
    2. ``access``: append the id to the window (+1 hit); if the window is longer than W,
       its oldest id falls out (-1 hit); re-key the block read and the block whose read
       fell out, the only two whose score changed. O(log n) per read, and exact.
    3. ``choose_victims``: lowest score first (ties by block id), skipping protected blocks.

    Deviations: the window holds the reads of this tier's blocks (``access`` calls): a read
    that promotes a block from a lower tier reaches this policy as an ``insert`` and is not
    a hit here. The step is the event ordinal (see ``heavy_hitter``), and past 1e6 events
    the recency part can outweigh a hit; raise ``hit_weight`` for long streams.
    """

    name = "windowed_recency"
    description = "kv-hierarchy-lab windowed recency: fewest hits in the last 32 reads x 1e6 + last step leaves first"
    Params = WindowedRecencyParams

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._window: deque[str] = deque()
        self._hits: dict[str, int] = {}

    def hits(self, block_id: str) -> int:
        """The block's reads among the last W reads of this tier."""
        return self._hits.get(block_id, 0)

    def key(self, block: Block) -> Key:
        return (self.hits(block.block_id) * self.params.hit_weight + self.last_step(block), block.block_id)

    def access(self, block: Block) -> None:
        self._require(block)
        block_id = block.block_id
        window, hits = self._window, self._hits
        window.append(block_id)
        hits[block_id] = hits.get(block_id, 0) + 1
        leaving = None
        if len(window) > self.params.window:
            leaving = window.popleft()
            left = hits[leaving] - 1
            if left:
                hits[leaving] = left
            else:
                del hits[leaving]
        super().access(block)
        if leaving is not None and leaving != block_id:
            held = self._held.get(leaving)
            if held is not None:
                self._place(held[1])
