"""intent_aware: kv_deadline_scheduler's IntentAware policy (a weighted sum of intent terms)."""

from __future__ import annotations

import dataclasses

from policies.base import Block, Phase, Priority
from policies.params import bounded
from policies.scored import Key, ScoredPolicy, SeedLabels, descending, recency, until_deadline

# Priority terms of the eviction score and of the risk; UNSPECIFIED counts as WARM.
_CLASS_TERM: dict[int, float] = {
    Priority.UNSPECIFIED: 55.0,
    Priority.COLD: 110.0,
    Priority.WARM: 55.0,
    Priority.HOT: 15.0,
    Priority.DECODE_CRITICAL: -900.0,
}
_CLASS_RISK: dict[int, float] = {
    Priority.UNSPECIFIED: 30.0,
    Priority.WARM: 30.0,
    Priority.HOT: 80.0,
    Priority.DECODE_CRITICAL: 300.0,
}
_PHASE_TERM: dict[int, float] = {Phase.DONE: 120.0, Phase.IDLE: 50.0}
_PHASE_DEADLINE: dict[int, float] = {Phase.DECODE: 120.0, Phase.VERIFY: 30.0}
_PHASE_RISK: dict[int, float] = {Phase.DONE: -140.0, Phase.IDLE: -60.0}


@dataclasses.dataclass(frozen=True)
class IntentParams:
    """``us_per_step``: event-time microseconds per seed step (for age and steps to the
    target decode step); ``recency_horizon_us``: idle time after which recency_score is 0."""

    us_per_step: int = bounded(1000, 1, 10**12)
    recency_horizon_us: int = bounded(100_000, 1, 10**12)

    def __post_init__(self) -> None:
        if not isinstance(self.us_per_step, int) or self.us_per_step < 1:
            raise ValueError(f"us_per_step must be an integer >= 1, got {self.us_per_step!r}")
        if not isinstance(self.recency_horizon_us, int) or self.recency_horizon_us < 1:
            raise ValueError(f"recency_horizon_us must be an integer >= 1, got {self.recency_horizon_us!r}")


class IntentAwarePolicy(ScoredPolicy):
    """Evicts the block with the highest eviction score (the seed's IntentAware).

    eviction score = +110 COLD / +55 WARM / +15 HOT / -900 DECODE_CRITICAL; -900 if pinned;
    +120 DONE / +50 IDLE; +(100 - request_priority); +min(reuse/6, 120); +30 recompute_ok;
    +20 compression_ok; +45 uncommitted draft; -min(recompute_cost/40, 180); -60 recency;
    +min(age/4, 35); -max(risk, 0)/40, with ``risk`` as in ``risk`` below.

    Structures: the ``ScoredPolicy`` SortedList of (key, block id), smallest first, and the
    dict of each block's current entry; the key is (-eviction score, last_access_us, -size,
    block id), so the highest score leaves first.

    1. ``insert`` / ``access`` / ``update``: compute the eviction score at the event's time
       and re-key the block.
    2. ``choose_victims``: highest score first (ties: least recently read, then largest,
       then block id), skipping protected blocks.
    3. ``admit_prefetch``: never (the seed's IntentAware does not prefetch).

    Mapping from the seed's intent snapshot: deadline = deadline_us - now (a passed deadline
    counts as 0; no deadline: the deadline terms are 0); steps to target_decode_step =
    deadline / us_per_step (no deadline: that term is 0); age = (now - created_us) /
    us_per_step; recency = max(0, 1 - (now - last_access_us) / recency_horizon_us); an
    unknown reuse window, slack or recompute cost makes its terms 0; UNSPECIFIED priority
    counts as WARM.

    Deviations: recency, age and the deadline terms change with time, and an exact order
    would need a rescan on every event; instead a block's score is computed when it is
    inserted, read or updated, at that event's time, and kept until its next event, so
    between events the order drifts from the seed's (a deadline drawing near does not raise
    a block it was not given with). The seed breaks ties by the largest block, then the
    largest object id; this policy by least recent read, then largest, then id. ``score``
    reports minus the eviction score (higher = kept), as the block was last keyed.

    kvds compatibility (``kvds`` set by broker/replay/kvds_compat.py, replay only): the same
    formula, fed the seed's own labels (recency_score as decayed, static deadline_us,
    target_decode_step, age from last_access_step) and keyed with the seed's tie rule; the
    compatibility replay scores every candidate at the step it chooses, as the seed does.
    """

    name = "intent_aware"
    description = "kv_deadline_scheduler IntentAware: highest intent eviction score (priority, phase, reuse, cost, risk) leaves first"
    Params = IntentParams
    # The seed's labels, set only by the kvds compatibility replay (broker.replay.kvds_compat).
    kvds: SeedLabels | None = None

    def terms(self, block: Block, now_us: int) -> tuple[float, float, int | None, float | None]:
        """The time-dependent inputs of the seed's formulas: (recency 0..1, steps since the
        block's age origin, time until its deadline in us, steps to its target decode step).

        kvbroker's mapping (module docstring) from our Block, or, in the kvds compatibility
        replay (``self.kvds`` set by ``broker.replay.kvds_compat``), the seed's own labels."""
        kvds = self.kvds
        if kvds is not None:
            return kvds.terms(block.block_id)
        p = self.params
        deadline = until_deadline(block, now_us)
        return (
            recency(block, now_us, p.recency_horizon_us),
            (now_us - block.created_us) / p.us_per_step,
            deadline,
            None if deadline is None else deadline / p.us_per_step,
        )

    def risk(self, block: Block, now_us: int) -> float:
        """The seed's risk: effective_deadline_score + 40 recency + 15 committed - 35
        uncommitted draft - 25 recompute_ok - 15 compression_ok - min(reuse/8, 80) - 140 DONE
        / - 60 IDLE (summed in the seed's order, so that equal scores stay equal)."""
        rec, _, deadline, steps = self.terms(block, now_us)
        return self._risk(block, rec, deadline, steps)

    def _risk(self, block: Block, rec: float, deadline: int | None, steps: float | None) -> float:
        effective = 0.0
        if deadline is not None:
            effective += max(0.0, 10_000.0 - deadline) / 20.0
        if block.slack_us is not None:
            effective += max(0.0, 5000.0 - block.slack_us) / 10.0
        if steps is not None:
            effective += max(0.0, 64.0 - steps)
        effective += block.request_priority * 2.0
        effective += _PHASE_DEADLINE.get(block.phase, 0.0)
        effective += _CLASS_RISK.get(block.priority, 0.0)
        if block.recompute_cost_us is not None:
            effective += min(block.recompute_cost_us / 25.0, 250.0)
        if block.pinned:
            effective += 400.0
        risk = effective + rec * 40.0
        if block.is_committed:
            risk += 15.0
        if block.is_draft and not block.is_committed:
            risk -= 35.0
        if block.recompute_ok:
            risk -= 25.0
        if block.compression_ok:
            risk -= 15.0
        if block.reuse_window is not None:
            risk -= min(block.reuse_window / 8.0, 80.0)
        return risk + _PHASE_RISK.get(block.phase, 0.0)

    def eviction_score(self, block: Block, now_us: int) -> float:
        """The seed's IntentAware eviction score at ``now_us`` (higher leaves first)."""
        return self.score_and_risk(block, now_us)[0]

    def score_and_risk(self, block: Block, now_us: int) -> tuple[float, float]:
        """The IntentAware eviction score and the risk it used (a subclass adds to both)."""
        rec, age, deadline, steps = self.terms(block, now_us)
        risk = self._risk(block, rec, deadline, steps)
        s = _CLASS_TERM.get(block.priority, 55.0)
        if block.pinned:
            s -= 900.0
        s += _PHASE_TERM.get(block.phase, 0.0)
        s += 100 - block.request_priority
        if block.reuse_window is not None:
            s += min(block.reuse_window / 6, 120.0)
        if block.recompute_ok:
            s += 30.0
        if block.compression_ok:
            s += 20.0
        if block.is_draft and not block.is_committed:
            s += 45.0
        if block.recompute_cost_us is not None:
            s -= min(block.recompute_cost_us / 40, 180.0)
        s -= 60.0 * rec
        s += min(age / 4, 35.0)
        s -= max(risk, 0.0) / 40
        return s, risk

    def key(self, block: Block) -> Key:
        score = self.eviction_score(block, self.ctx.clock.now_us)
        if self.kvds is not None:
            # The seed's tie rule: max by (score, size, object id), so the largest id first.
            return (-score, -block.size, descending(block.block_id))
        return (-score, block.last_access_us, -block.size, block.block_id)

    def stored_score(self, block: Block) -> float:
        """The eviction score the block holds in the order, or its score now if not held."""
        key = self.stored_key(block.block_id)
        return self.eviction_score(block, self.ctx.clock.now_us) if key is None else -float(key[0])

    def score(self, block: Block) -> float:
        return -self.stored_score(block)
