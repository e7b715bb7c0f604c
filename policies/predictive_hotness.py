"""predictive_hotness: kv_deadline_scheduler's PredictiveHotness baseline (recency plus reuse hint)."""

from __future__ import annotations

import dataclasses

from policies.base import Block
from policies.params import bounded
from policies.scored import Key, ScoredPolicy, SeedLabels, recency

# The seed's reuse horizon in tokens: a reuse window of 64 or more (or none) gives no boost.
REUSE_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class PredictiveHotnessParams:
    """``recency_horizon_us``: idle time after which the seed's recency_score reaches 0;
    ``recency_weight``: weight of recency (the reuse hint gets 1 - recency_weight)."""

    recency_horizon_us: int = bounded(100_000, 1, 10**12)
    recency_weight: float = bounded(0.7, 0.0, 1.0)

    def __post_init__(self) -> None:
        if not isinstance(self.recency_horizon_us, int) or self.recency_horizon_us < 1:
            raise ValueError(f"recency_horizon_us must be an integer >= 1, got {self.recency_horizon_us!r}")
        if not 0.0 <= self.recency_weight <= 1.0:
            raise ValueError(f"recency_weight must be in [0, 1], got {self.recency_weight!r}")


def reuse_boost(block: Block) -> float:
    """max(0, 64 - reuse_window) / 64; an unknown reuse window counts as 64 (no boost)."""
    reuse = REUSE_TOKENS if block.reuse_window is None else block.reuse_window
    return max(0, REUSE_TOKENS - reuse) / REUSE_TOKENS


class PredictiveHotnessPolicy(ScoredPolicy):
    """Evicts min (0.7 recency + 0.3 max(0, 64 - reuse_window)/64, last_access, -size, id).

    Structures: the ``ScoredPolicy`` SortedList of (key, block id), smallest first, and the
    dict of each block's current entry.

    1. ``insert`` / ``access`` / ``update`` (a new reuse window): key =
       (0.7 last_access/horizon + 0.3 boost, last_access_us, -size, block id).
    2. ``choose_victims``: smallest keys first, skipping protected blocks.

    Why that key: while a block was read within the horizon, 0.7 recency(now) =
    0.7 - 0.7 (now - last_access)/horizon, and the part that depends on ``now`` is the same
    for every block; dropping it leaves a key that never goes stale, so it needs no
    rescan and is exact among all blocks read within the last horizon.

    Deviations: the clamp of recency at 0 is not applied, so a block idle longer than the
    horizon keeps losing recency: among blocks idle that long the seed orders by the reuse
    boost alone, this key still lets an older block go first (one unit of boost, 0.3, is
    worth 0.3/0.7 horizons of idleness). ``score`` reports the seed's score now.
    """

    name = "predictive_hotness"
    description = "kv_deadline_scheduler PredictiveHotness: lowest 0.7 recency + 0.3 reuse-window boost leaves first"
    Params = PredictiveHotnessParams

    # The seed's labels, set only by the kvds compatibility replay (broker.replay.kvds_compat).
    kvds: SeedLabels | None = None

    def key(self, block: Block) -> Key:
        w = self.params.recency_weight
        kvds = self.kvds
        if kvds is not None:
            # The seed's own recency label and last_access_step, and its key as it is.
            hotness = kvds.terms(block.block_id)[0] * w + reuse_boost(block) * (1.0 - w)
            return (hotness, kvds.last_access_step(block.block_id), -block.size, block.block_id)
        shifted = w * block.last_access_us / self.params.recency_horizon_us + (1.0 - w) * reuse_boost(block)
        return (shifted, block.last_access_us, -block.size, block.block_id)

    def score(self, block: Block) -> float:
        w = self.params.recency_weight
        return w * recency(block, self.ctx.clock.now_us, self.params.recency_horizon_us) + (1.0 - w) * reuse_boost(block)
