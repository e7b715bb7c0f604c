"""regret_aware: kv-hierarchy-lab's regret-aware policy; blocks evicted too early earn protection."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

from policies.base import Block, PolicyContext
from policies.params import bounded
from policies.scored import Key, StepScoredPolicy, step_of


@dataclasses.dataclass(frozen=True)
class RegretAwareParams:
    """``freq_weight`` (1.5) and ``regret_weight`` (6.0): weights of reads and regret;
    ``horizon``: steps after an eviction within which a return is a regret (H = 24);
    ``decay``: regret kept per read of the block (0.98); ``max_history``: evicted ids
    remembered, the oldest dropped first."""

    freq_weight: float = bounded(1.5, 0.0, 1e9)
    regret_weight: float = bounded(6.0, 0.0, 1e9)
    horizon: int = bounded(24, 1, 10**9)
    decay: float = bounded(0.98, 0.0, 1.0)
    max_history: int = bounded(1_000_000, 0, 10**8)

    def __post_init__(self) -> None:
        for name in ("freq_weight", "regret_weight"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if not isinstance(self.horizon, int) or self.horizon < 1:
            raise ValueError(f"horizon must be an integer >= 1, got {self.horizon!r}")
        if not isinstance(self.decay, (int, float)) or not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {self.decay!r}")
        if not isinstance(self.max_history, int) or self.max_history < 0:
            raise ValueError(f"max_history must be an integer >= 0, got {self.max_history!r}")


class RegretAwarePolicy(StepScoredPolicy):
    """Evicts the lowest 1.5 freq + last/step + 6.0 regret.

    Structures: the ``ScoredPolicy`` SortedList of (score, last step, block id), smallest
    first, the dict of each block's current entry and of its last step; a dict id -> regret
    of the blocks held (absent = 0); an OrderedDict history id -> (step it was evicted,
    its regret then), oldest first, at most ``max_history`` entries.

    1. ``evicted``: the block leaves; history remembers its eviction step and regret.
    2. ``insert``: a block in the history is coming back: gap = step - eviction step; if
       gap <= H its regret grows by (H - gap + 1)/H (regret survives an eviction). Last
       step = now; re-key.
    3. ``access``: the block's regret decays x 0.98 (lazily: only the block read changes);
       last step = now; re-key.
    4. ``remove`` (freed, or moved without being chosen): its state is forgotten.
    5. ``choose_victims``: lowest score first, then the least recent, then block id.

    Deviations: as ``cost_aware``, the score is taken at the block's own last event, where
    last/step is 1, so recency orders blocks only through the tie-break on last step. The
    step is the event ordinal, so H = 24 counts events, not accesses, and a block comes
    "back" when it is inserted in this tier again (for the top tier: promoted by a read).
    """

    name = "regret_aware"
    description = "kv-hierarchy-lab regret aware: lowest 1.5 reads + last/step + 6.0 regret leaves first"
    Params = RegretAwareParams

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._regret: dict[str, float] = {}
        self._history: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def regret(self, block_id: str) -> float:
        """The regret of a block held, or of one evicted and remembered (0 otherwise)."""
        if block_id in self._regret:
            return self._regret[block_id]
        past = self._history.get(block_id)
        return 0.0 if past is None else past[1]

    def key(self, block: Block) -> Key:
        p = self.params
        last = self.last_step(block)
        value = p.freq_weight * block.accesses + last / max(step_of(self.ctx), 1) + p.regret_weight * self._regret.get(block.block_id, 0.0)
        return (value, last, block.block_id)

    def insert(self, block: Block) -> None:
        past = self._history.pop(block.block_id, None)
        if past is not None:
            evicted_at, regret = past
            h = self.params.horizon
            gap = step_of(self.ctx) - evicted_at
            if gap <= h:
                regret += (h - gap + 1) / h
            if regret:
                self._regret[block.block_id] = regret
        super().insert(block)

    def access(self, block: Block) -> None:
        self._require(block)
        regret = self._regret.get(block.block_id)
        if regret is not None:
            self._regret[block.block_id] = regret * self.params.decay
        super().access(block)

    def remove(self, block: Block) -> None:
        super().remove(block)
        self._regret.pop(block.block_id, None)

    def evicted(self, block: Block) -> None:
        regret = self._regret.get(block.block_id, 0.0)
        self.remove(block)
        history = self._history
        history[block.block_id] = (step_of(self.ctx), regret)
        history.move_to_end(block.block_id)
        while len(history) > self.params.max_history:
            history.popitem(last=False)
