"""hotcold: kv_deadline_scheduler's HotCold baseline; the least recently read block leaves first."""

from __future__ import annotations

import dataclasses

from policies.base import Block
from policies.params import bounded
from policies.scored import Key, ScoredPolicy, recency


@dataclasses.dataclass(frozen=True)
class HotColdParams:
    """``recency_horizon_us``: idle time after which the seed's recency_score reaches 0."""

    recency_horizon_us: int = bounded(100_000, 1, 10**12)

    def __post_init__(self) -> None:
        if not isinstance(self.recency_horizon_us, int) or self.recency_horizon_us < 1:
            raise ValueError(f"recency_horizon_us must be an integer >= 1, got {self.recency_horizon_us!r}")


class HotColdPolicy(ScoredPolicy):
    """Evicts min (recency_score, last_access, -size, id): the coldest, then the largest.

    Structures: the ``ScoredPolicy`` SortedList of (key, block id), smallest first, and the
    dict of each block's current entry.

    1. ``insert`` / ``access`` / ``update``: key = (last_access_us, -size, block id).
    2. ``choose_victims``: smallest keys first, skipping protected blocks.

    The key is exact at every instant, with no rescan: recency_score =
    max(0, 1 - (now - last_access) / horizon) is, at any fixed ``now``, a non-decreasing
    function of last_access, and blocks it ties (all those idle past the horizon) are then
    ordered by last_access anyway. So ordering by (recency, last_access, -size, id) is
    ordering by (last_access, -size, id), whatever the time.

    Deviations: none in the order. ``score`` reports recency_score at the current time.
    """

    name = "hotcold"
    description = "kv_deadline_scheduler HotCold: lowest recency score, then least recent, then largest leaves first"
    Params = HotColdParams

    def key(self, block: Block) -> Key:
        return (block.last_access_us, -block.size, block.block_id)

    def score(self, block: Block) -> float:
        return recency(block, self.ctx.clock.now_us, self.params.recency_horizon_us)
