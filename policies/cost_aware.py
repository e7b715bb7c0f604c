"""cost_aware: kv-hierarchy-lab's cost-aware policy; frequency, recency and size in one score."""

from __future__ import annotations

import dataclasses

from policies.base import Block
from policies.params import bounded
from policies.scored import Key, StepScoredPolicy, step_of


@dataclasses.dataclass(frozen=True)
class CostAwareParams:
    """``freq_weight``: weight of a read (the lab's 2.0); ``size_weight``: penalty per KiB
    (the lab's 0.4)."""

    freq_weight: float = bounded(2.0, 0.0, 1e9)
    size_weight: float = bounded(0.4, 0.0, 1e9)

    def __post_init__(self) -> None:
        if not isinstance(self.freq_weight, (int, float)) or self.freq_weight < 0:
            raise ValueError(f"freq_weight must be a number >= 0, got {self.freq_weight!r}")
        if not isinstance(self.size_weight, (int, float)) or self.size_weight < 0:
            raise ValueError(f"size_weight must be a number >= 0, got {self.size_weight!r}")


class CostAwarePolicy(StepScoredPolicy):
    """Evicts the lowest 2.0 freq + last/step - 0.4 size/1024: rarely read, big blocks first.

    Structures: the ``ScoredPolicy`` SortedList of (score, last step, block id), smallest
    first, the dict of each block's current entry and of its last step.

    1. ``insert`` / ``access``: last step = the current step; score = 2.0 x accesses +
       last/step - 0.4 x size/1024, at this step; re-key.
    2. ``choose_victims``: lowest score first, then the least recent, then block id.

    Deviations: last/step changes with every step for every block, so an exact order would
    need a rescan per event; the score is taken at the block's own last event and kept.
    Taken then, last = step and the term is 1 for every block (0 at step 0): recency orders
    blocks only through the tie-break on last step. The step is the event ordinal and a new
    block starts at freq 0 (see ``heavy_hitter``).
    """

    name = "cost_aware"
    description = "kv-hierarchy-lab cost aware: lowest 2.0 reads + last/step - 0.4 KiB leaves first"
    Params = CostAwareParams

    def key(self, block: Block) -> Key:
        p = self.params
        last = self.last_step(block)
        value = p.freq_weight * block.accesses + last / max(step_of(self.ctx), 1) - p.size_weight * block.size / 1024
        return (value, last, block.block_id)
