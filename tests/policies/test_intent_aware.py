"""intent_aware (kv_deadline_scheduler's IntentAware): narrated scenarios, driven directly.

Default parameters: us_per_step 1000, recency_horizon_us 100,000. A block's score is taken
at its own insert, read or update; the highest eviction score leaves first.
"""

from __future__ import annotations

from typing import Any

import pytest

from policies.base import Block, Clock, Phase, PolicyContext, PolicyError, Priority, TierInfo
from policies.intent_aware import IntentAwarePolicy, IntentParams
from policies.registry import make_params, policy_class


class Tier:
    """One tier driven directly, stamping blocks the way the core does."""

    def __init__(self, **params: Any) -> None:
        info = TierInfo(0, "hbm", 10_000, 0.0, 1000.0)
        self.clock = Clock()
        self.policy = IntentAwarePolicy(PolicyContext(info, (info,), self.clock), IntentParams(**params))
        self.blocks: dict[str, Block] = {}

    def at(self, now_us: int) -> Tier:
        self.clock.now_us = now_us
        return self

    def insert(self, block_id: str, size: int = 1, **intent: Any) -> Block:
        block = Block(block_id, size)
        block.created_us = block.last_access_us = self.clock.now_us
        for name, value in intent.items():
            setattr(block, name, value)
        self.blocks[block_id] = block
        self.policy.insert(block)
        return block

    def update(self, block_id: str, **intent: Any) -> None:
        block = self.blocks[block_id]
        for name, value in intent.items():
            setattr(block, name, value)
        self.policy.update(block)

    def order(self) -> list[str]:
        victims = self.policy.choose_victims(sum(b.size for b in self.blocks.values()), frozenset())
        assert victims is not None
        return [b.block_id for b in victims]


def test_an_older_hot_decode_block_survives_a_younger_cold_done_block() -> None:
    tier = Tier()
    # t = 0: H, HOT, in DECODE. 15 + (100 - 50) - 60 x recency 1 - risk/40, where
    # risk = 2 x 50 + 120 DECODE + 80 HOT + 40 x recency = 340: score -3.5.
    tier.at(0).insert("H", priority=Priority.HOT, phase=Phase.DECODE)
    # t = 10 ms: C, COLD, DONE. 110 + 120 + 50 - 60; risk = 100 + 40 - 140 = 0: score 220.
    tier.at(10_000).insert("C", priority=Priority.COLD, phase=Phase.DONE)
    # t = 20 ms: W, no priority (counts as WARM). 55 + 50 - 60 - (100 + 30 + 40)/40: 40.75.
    tier.at(20_000).insert("W")
    assert [tier.policy.score(tier.blocks[x]) for x in "HCW"] == [3.5, -220.0, -40.75]
    # LRU would take H, the oldest; IntentAware takes C, then W, and keeps H.
    assert tier.order() == ["C", "W", "H"]
    assert [b.block_id for b in tier.policy.choose_victims(1, frozenset()) or []] == ["C"]
    # With C protected, W goes.
    assert [b.block_id for b in tier.policy.choose_victims(1, {"C"}) or []] == ["W"]


def test_every_term_of_the_score() -> None:
    tier = Tier()
    # A WARM prefill block with every flag and cost set, needed 4 ms from now, slack 1 ms:
    #   55 WARM + 50 (100 - 50) + 100 min(600/6, 120) + 30 recompute_ok + 20 compression_ok
    #   + 45 uncommitted draft - 180 min(8000/40, 180) - 60 recency + 0 age - risk/40, where
    #   risk = 300 (10000 - 4000)/20 + 60 (64 - 4 steps) + 400 (5000 - 1000)/10 + 100 (2 x 50)
    #   + 30 WARM + 250 min(8000/25, 250) + 40 recency - 35 draft - 25 - 15 - 75 min(600/8, 80)
    #   = 1030: 34.25.
    tier.at(1000).insert(
        "F",
        priority=Priority.WARM,
        phase=Phase.PREFILL,
        deadline_us=5000,
        slack_us=1000,
        reuse_window=600,
        recompute_cost_us=8000,
        recompute_ok=True,
        compression_ok=True,
        is_draft=True,
    )
    assert tier.policy.risk(tier.blocks["F"], 1000) == pytest.approx(1030.0)
    assert tier.policy.score(tier.blocks["F"]) == pytest.approx(-34.25)


def test_a_near_deadline_raises_the_risk_and_keeps_the_block() -> None:
    tier = Tier()
    # t = 0: D, WARM, needed at t = 1 ms: its risk gains (10000 - 1000)/20 + (64 - 1) = 513.
    tier.at(0).insert("D", deadline_us=1000)
    # t = 10: N, the same without a deadline: 40.75.
    tier.at(10).insert("N")
    # D scores 40.75 - 513/40 = 27.925 and stays, although it is the older.
    assert tier.policy.score(tier.blocks["D"]) == pytest.approx(-27.925)
    assert tier.order() == ["N", "D"]


def test_an_update_rekeys_at_the_update_time() -> None:
    tier = Tier()
    tier.at(0).insert("H", priority=Priority.HOT, phase=Phase.DECODE)
    tier.at(10_000).insert("C", priority=Priority.COLD, phase=Phase.DONE)
    tier.at(20_000).insert("W")
    assert tier.order() == ["C", "W", "H"]
    # t = 30 ms: H's request is done and it turns COLD. Keyed now: 110 + 120 + 50
    # - 60 x 0.7 (read 30 ms ago) + 30 steps/4 = 245.5 (risk 100 + 28 - 140 < 0 counts 0).
    tier.at(30_000).update("H", priority=Priority.COLD, phase=Phase.DONE)
    assert tier.policy.score(tier.blocks["H"]) == pytest.approx(-245.5)
    assert tier.order() == ["H", "C", "W"]
    # C and W keep the scores they were keyed with (the documented deviation).
    assert tier.policy.score(tier.blocks["C"]) == -220.0


def test_an_unpinned_decode_critical_block_is_kept_to_the_last() -> None:
    tier = Tier()
    # A released DECODE_CRITICAL block is unpinned, so it reaches the policy: -900.
    dc = Block("R", 1)
    dc.priority = Priority.DECODE_CRITICAL
    dc.released = True
    tier.policy.insert(dc)
    tier.blocks["R"] = dc
    tier.insert("W")
    assert tier.order() == ["W", "R"]


def test_equal_scores_leave_least_recent_first_then_largest_then_by_id() -> None:
    tier = Tier()
    # The same intent keyed at its own insert scores the same at any time.
    tier.at(0).insert("c")
    tier.at(10).insert("a")
    tier.at(20).insert("b", 1)
    tier.insert("e", 3)
    tier.insert("d", 1)
    assert tier.policy.score(tier.blocks["c"]) == tier.policy.score(tier.blocks["d"])
    assert tier.order() == ["c", "a", "e", "b", "d"]


def test_never_prefetches_and_refuses_unknown_blocks() -> None:
    tier = Tier()
    cand = Block("p", 1)
    cand.priority, cand.prefetch_ok, cand.deadline_us = Priority.HOT, True, 10
    tier.insert("W", priority=Priority.COLD)
    assert tier.policy.admit_prefetch(cand, [tier.blocks["W"]]) is False
    with pytest.raises(PolicyError):
        tier.policy.remove(cand)
    with pytest.raises(PolicyError):
        tier.policy.update(cand)


def test_params_are_validated() -> None:
    with pytest.raises(ValueError, match="us_per_step"):
        IntentParams(us_per_step=0)
    with pytest.raises(ValueError, match="recency_horizon_us"):
        IntentParams(recency_horizon_us=0)
    with pytest.raises(PolicyError, match="us_per_step"):
        make_params(policy_class("intent_aware"), {"us_per_step": -1})
