"""predictive_hotness (kv_deadline_scheduler's PredictiveHotness): narrated scenarios."""

from __future__ import annotations

from typing import Any

import pytest

from policies.base import Block, Clock, PolicyContext, PolicyError, TierInfo
from policies.predictive_hotness import PredictiveHotnessParams, PredictiveHotnessPolicy
from policies.registry import make_params, policy_class


class Tier:
    """One tier driven directly, stamping blocks the way the core does."""

    def __init__(self, **params: Any) -> None:
        info = TierInfo(0, "hbm", 10_000, 0.0, 1000.0)
        self.clock = Clock()
        self.policy = PredictiveHotnessPolicy(PolicyContext(info, (info,), self.clock), PredictiveHotnessParams(**params))
        self.blocks: dict[str, Block] = {}

    def insert(self, block_id: str, size: int = 1, **intent: Any) -> Block:
        block = Block(block_id, size)
        block.created_us = block.last_access_us = self.clock.now_us
        for name, value in intent.items():
            setattr(block, name, value)
        self.blocks[block_id] = block
        self.policy.insert(block)
        return block

    def read(self, block_id: str) -> None:
        block = self.blocks[block_id]
        block.accesses += 1
        block.last_access_us = self.clock.now_us
        self.policy.access(block)

    def order(self) -> list[str]:
        victims = self.policy.choose_victims(sum(b.size for b in self.blocks.values()), frozenset())
        assert victims is not None
        return [b.block_id for b in victims]


def test_a_short_reuse_window_protects_an_older_block() -> None:
    tier = Tier()
    # t = 0: a, to be reused within 0 tokens (full boost, 0.3).
    tier.insert("a", reuse_window=0)
    # t = 10: b, no reuse hint (None counts as 64: no boost).
    tier.clock.now_us = 10
    tier.insert("b")
    # Scores at t = 10: a = 0.7 x 0.9999 + 0.3 ~ 1.0, b = 0.7 x 1 = 0.7: b, the younger, leaves first.
    assert tier.policy.score(tier.blocks["a"]) == pytest.approx(0.7 * (1 - 10 / 100_000) + 0.3)
    assert tier.policy.score(tier.blocks["b"]) == pytest.approx(0.7)
    assert tier.order() == ["b", "a"]


def test_recency_outweighs_a_weak_hint() -> None:
    tier = Tier()
    # t = 0: a with reuse 32 (boost 0.5 -> 0.15).
    tier.insert("a", reuse_window=32)
    # t = 40 ms: c with reuse 32; t = 50 ms: b without a hint.
    tier.clock.now_us = 40_000
    tier.insert("c", reuse_window=32)
    tier.clock.now_us = 50_000
    tier.insert("b")
    # At t = 50 ms: a = 0.7 x 0.5 + 0.15 = 0.50, c = 0.7 x 0.9 + 0.15 = 0.78, b = 0.70.
    assert [tier.policy.score(tier.blocks[x]) for x in "acb"] == pytest.approx([0.50, 0.78, 0.70])
    assert tier.order() == ["a", "b", "c"]
    # At t = 60 ms the order is the same (a shift of time shifts every score alike).
    tier.clock.now_us = 60_000
    assert [tier.policy.score(tier.blocks[x]) for x in "acb"] == pytest.approx([0.43, 0.71, 0.63])
    assert tier.order() == ["a", "b", "c"]
    # a is read at t = 60 ms: recency 1, score 0.85, the hottest.
    tier.read("a")
    assert tier.order() == ["b", "c", "a"]


def test_an_update_of_the_reuse_window_rekeys_the_block() -> None:
    tier = Tier()
    tier.insert("a")
    tier.clock.now_us = 10
    tier.insert("b")
    assert tier.order() == ["a", "b"]
    # The engine now says a is reused within 8 tokens: boost 56/64 protects it.
    tier.blocks["a"].reuse_window = 8
    tier.policy.update(tier.blocks["a"])
    assert tier.order() == ["b", "a"]
    # ... and then that it is not (window 200 > 64: no boost): back to recency alone.
    tier.blocks["a"].reuse_window = 200
    tier.policy.update(tier.blocks["a"])
    assert tier.order() == ["a", "b"]


def test_equal_scores_tie_on_last_access_then_size_then_id() -> None:
    tier = Tier()
    # Same instant, same hint: the larger block first, then by id.
    tier.insert("q", 1, reuse_window=16)
    tier.insert("p", 1, reuse_window=16)
    tier.insert("r", 4, reuse_window=16)
    assert tier.order() == ["r", "p", "q"]


def test_past_the_horizon_recency_keeps_falling_documented_deviation() -> None:
    tier = Tier(recency_horizon_us=100)
    # a (full boost) at t = 0, b (no hint) at t = 500.
    tier.insert("a", reuse_window=0)
    tier.clock.now_us = 500
    tier.insert("b")
    # At t = 1000 both are idle past the horizon: the seed scores a 0.3 and b 0.0 and would
    # evict b; this policy does not clamp recency, so a (idle five horizons longer) goes first.
    tier.clock.now_us = 1000
    assert tier.policy.score(tier.blocks["a"]) == pytest.approx(0.3)
    assert tier.policy.score(tier.blocks["b"]) == 0.0
    assert tier.order() == ["a", "b"]


def test_params_are_validated() -> None:
    with pytest.raises(ValueError, match="recency_horizon_us"):
        PredictiveHotnessParams(recency_horizon_us=0)
    with pytest.raises(ValueError, match="recency_weight"):
        PredictiveHotnessParams(recency_weight=1.5)
    with pytest.raises(PolicyError, match="recency_weight"):
        make_params(policy_class("predictive_hotness"), {"recency_weight": -1})
