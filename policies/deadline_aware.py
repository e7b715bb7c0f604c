"""deadline_aware: kv_deadline_scheduler's DeadlineAware policy (IntentAware plus deadline terms)."""

from __future__ import annotations

import dataclasses

from policies.base import Block, Phase, Priority
from policies.intent_aware import IntentAwarePolicy, IntentParams
from policies.params import bounded


@dataclasses.dataclass(frozen=True)
class DeadlineParams(IntentParams):
    """IntentAware's parameters plus the prefetch rule's thresholds: a block qualifies when
    its deadline is within ``prefetch_deadline_us``, or its slack is at most
    ``prefetch_slack_us``, or its reuse window is at most ``prefetch_reuse_tokens``."""

    prefetch_deadline_us: int = bounded(5000, 0, 10**12)
    prefetch_slack_us: int = bounded(2000, 0, 10**12)
    prefetch_reuse_tokens: int = bounded(8, 0, 2**32 - 1)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("prefetch_deadline_us", "prefetch_slack_us", "prefetch_reuse_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


class DeadlineAwarePolicy(IntentAwarePolicy):
    """Evicts the highest DeadlineAware score; prefetches urgent blocks over colder ones.

    score = the IntentAware eviction score, plus: deadline <= 1000: -320, <= 5000: -140,
    else -25; slack <= 500: -260, <= 2000: -120; request_priority >= 80: -90;
    recompute_cost >= 4000: -80; DECODE: -110; DECODE_CRITICAL: -400; -risk/18; DONE: +40;
    COLD without deadline: +35.

    Structures: those of ``IntentAwarePolicy`` (a SortedList of (-score, last_access_us,
    -size, block id) and the dict of each block's current entry); no more.

    1. ``insert`` / ``access`` / ``update``: compute the score at the event's time, re-key.
    2. ``choose_victims``: highest score first (ties: least recently read, then largest,
       then block id), skipping protected blocks.
    3. ``admit_prefetch(candidate, victims)``: the core offers a lower-tier block whose
       deadline is within transfer time + margin. Admit it when it has prefetch_ok, is HOT
       or DECODE_CRITICAL or in DECODE, and its deadline is within 5000 us or its slack is
       <= 2000 or its reuse window <= 8 (the seed's rule), and every victim's score (as
       the victim is keyed in the order) is strictly higher than the candidate's score now:
       only blocks this policy would rather lose make room for it.

    Mapping from the seed and the frozen-score deviation: as ``IntentAwarePolicy``. Terms
    that need a deadline (including "else -25") do not apply to a block without one; a
    passed deadline counts as 0.

    Deviations: besides IntentAware's, the victim check in step 3 is ours: the seed
    prefetches without weighing what leaves. The core asks ``admit_prefetch`` only when
    room must be made; a prefetch into free room is the core's decision.
    """

    name = "deadline_aware"
    description = "kv_deadline_scheduler DeadlineAware: IntentAware plus deadline, slack and decode terms; prefetches urgent blocks"
    Params = DeadlineParams

    def eviction_score(self, block: Block, now_us: int) -> float:
        s, risk = self.score_and_risk(block, now_us)
        deadline = self.terms(block, now_us)[2]
        if deadline is not None:
            s += -320.0 if deadline <= 1000 else -140.0 if deadline <= 5000 else -25.0
        slack = block.slack_us
        if slack is not None:
            s += -260.0 if slack <= 500 else -120.0 if slack <= 2000 else 0.0
        if block.request_priority >= 80:
            s -= 90.0
        if block.recompute_cost_us is not None and block.recompute_cost_us >= 4000:
            s -= 80.0
        if block.phase == Phase.DECODE:
            s -= 110.0
        if block.priority == Priority.DECODE_CRITICAL:
            s -= 400.0
        s -= risk / 18
        if block.phase == Phase.DONE:
            s += 40.0
        if block.priority == Priority.COLD and deadline is None:
            s += 35.0
        return s

    def wants_prefetch(self, block: Block) -> bool:
        """The seed's prefetch rule: prefetch_ok, urgent class or phase, and near use."""
        p = self.params
        if not block.prefetch_ok:
            return False
        if not (block.priority in (Priority.HOT, Priority.DECODE_CRITICAL) or block.phase == Phase.DECODE):
            return False
        deadline = self.terms(block, self.ctx.clock.now_us)[2]
        return (
            (deadline is not None and deadline <= p.prefetch_deadline_us)
            or (block.slack_us is not None and block.slack_us <= p.prefetch_slack_us)
            or (block.reuse_window is not None and block.reuse_window <= p.prefetch_reuse_tokens)
        )

    def admit_prefetch(self, candidate: Block, victims: list[Block]) -> bool:
        if not self.wants_prefetch(candidate):
            return False
        mine = self.eviction_score(candidate, self.ctx.clock.now_us)
        return all(self.stored_score(v) > mine for v in victims)
