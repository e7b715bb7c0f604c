"""heavy_hitter: kv-hierarchy-lab's heavy-hitter policy; the least read block leaves first."""

from __future__ import annotations

import dataclasses

from policies.base import Block
from policies.params import bounded
from policies.scored import Key, StepScoredPolicy


@dataclasses.dataclass(frozen=True)
class HeavyHitterParams:
    """``freq_weight``: steps of recency one read is worth (the lab's 10000)."""

    freq_weight: int = bounded(10_000, 0, 10**12)

    def __post_init__(self) -> None:
        if not isinstance(self.freq_weight, int) or self.freq_weight < 0:
            raise ValueError(f"freq_weight must be an integer >= 0, got {self.freq_weight!r}")


class HeavyHitterPolicy(StepScoredPolicy):
    """Evicts the lowest freq x 10000 + last step (frequency never ages).

    Structures: the ``ScoredPolicy`` SortedList of (score, block id), smallest first, the
    dict of each block's current entry, and the dict of each block's last step.

    1. ``insert``: last step = the current step; key = (accesses x 10000 + last, id).
    2. ``access``: the core has counted the read in ``block.accesses``; last step = now,
       re-key. Nothing else changes a score, so the order is exact.
    3. ``choose_victims``: lowest score first (ties by block id), skipping protected blocks.

    Deviations: the step is the event ordinal, which also counts allocations, updates and
    other events, so the recency part grows faster than the lab's access counter and a
    read is worth fewer accesses of recency than 10000 (raise ``freq_weight`` to
    compensate). Allocation is not a read: a new block starts at freq 0.
    """

    name = "heavy_hitter"
    description = "kv-hierarchy-lab heavy hitter: lowest reads x 10000 + last step leaves first"
    Params = HeavyHitterParams

    def key(self, block: Block) -> Key:
        return (block.accesses * self.params.freq_weight + self.last_step(block), block.block_id)
