"""regret_aware (kv-hierarchy-lab): narrated scenarios; the step is clock.event_index.

Score = 1.5 reads + last/step + 6.0 regret, taken at the block's own insert or read (where
last/step = 1); ties go to the least recent step, then the block id. H = 24.
"""

from __future__ import annotations

from typing import Any

import pytest

from policies.base import Block, Clock, PolicyContext, PolicyError, TierInfo
from policies.registry import make_params, policy_class
from policies.regret_aware import RegretAwareParams, RegretAwarePolicy


class Tier:
    """One tier driven directly; each call is one event (its own step)."""

    def __init__(self, **params: Any) -> None:
        info = TierInfo(0, "hbm", 10_000, 0.0, 1000.0)
        self.clock = Clock()
        self.policy = RegretAwarePolicy(PolicyContext(info, (info,), self.clock), RegretAwareParams(**params))
        self.blocks: dict[str, Block] = {}

    def at(self, step: int) -> Tier:
        self.clock.event_index = step
        return self

    def insert(self, block_id: str) -> None:
        block = self.blocks.get(block_id) or Block(block_id, 1)
        self.blocks[block_id] = block
        self.policy.insert(block)

    def read(self, block_id: str) -> None:
        block = self.blocks[block_id]
        block.accesses += 1
        self.policy.access(block)

    def evict(self, count: int = 1) -> list[str]:
        """As the core does: choose, then tell the policy about each victim."""
        victims = self.policy.choose_victims(count, frozenset())
        assert victims is not None
        for victim in victims:
            self.policy.evicted(victim)
        return [v.block_id for v in victims]

    def order(self) -> list[str]:
        victims = self.policy.choose_victims(len(self.policy), frozenset())
        assert victims is not None
        return [b.block_id for b in victims]


def test_a_block_evicted_too_early_comes_back_protected() -> None:
    tier = Tier()
    # Steps 1, 2: a, b arrive: both score 1.0; a, the older, leaves first.
    tier.at(1).insert("a")
    tier.at(2).insert("b")
    assert tier.order() == ["a", "b"]
    # Step 3: a is evicted (the history remembers step 3). Step 4: c arrives.
    assert tier.at(3).evict() == ["a"]
    tier.at(4).insert("c")
    # Step 9: a comes back 6 steps after its eviction: regret (24 - 6 + 1)/24 = 19/24,
    # score 1 + 6 x 19/24 = 5.75.
    tier.at(9).insert("a")
    assert tier.policy.regret("a") == pytest.approx(19 / 24)
    assert tier.policy.score(tier.blocks["a"]) == pytest.approx(5.75)
    # Step 10: d arrives (1.0). a, with its regret, outlives d although d is newer.
    tier.at(10).insert("d")
    assert tier.order() == ["b", "c", "d", "a"]


def test_regret_decays_on_reads_and_survives_a_late_return() -> None:
    tier = Tier()
    tier.at(1).insert("a")
    tier.at(2).evict()
    tier.at(3).insert("a")
    # Back after 1 step: regret 24/24 = 1.
    assert tier.policy.regret("a") == pytest.approx(1.0)
    # Steps 4, 5: two reads decay it x 0.98 each: 0.9604; score 1.5 x 2 + 1 + 6 x 0.9604.
    tier.at(4).read("a")
    tier.at(5).read("a")
    assert tier.policy.regret("a") == pytest.approx(0.9604)
    assert tier.policy.score(tier.blocks["a"]) == pytest.approx(3 + 1 + 6 * 0.9604)
    # Step 6: a is evicted again; its regret is remembered with it.
    tier.at(6).evict()
    assert tier.policy.regret("a") == pytest.approx(0.9604)
    # Step 31: back after 25 steps (> H): no new regret, the old is kept.
    tier.at(31).insert("a")
    assert tier.policy.regret("a") == pytest.approx(0.9604)


def test_the_regret_window_ends_at_h_steps() -> None:
    tier = Tier()
    for block_id in "xy":
        tier.at(0).insert(block_id)
    tier.at(1).evict(2)
    # x back after exactly 24 steps: (24 - 24 + 1)/24; y after 25: nothing.
    tier.at(25).insert("x")
    tier.at(26).insert("y")
    assert tier.policy.regret("x") == pytest.approx(1 / 24)
    assert tier.policy.regret("y") == 0.0
    # x's regret (+0.25) outweighs y's later step: y leaves first.
    assert tier.order() == ["y", "x"]


def test_remove_forgets_and_the_history_is_bounded() -> None:
    tier = Tier(max_history=1)
    for block_id in "abc":
        tier.at(0).insert(block_id)
    # a is removed (freed), not evicted: its return is no regret.
    tier.at(1).policy.remove(tier.blocks["a"])
    tier.at(2).insert("a")
    assert tier.policy.regret("a") == 0.0
    # b then c are evicted; the history holds one entry, so b is forgotten.
    assert tier.at(3).evict(2) == ["b", "c"]
    tier.at(4).insert("b")
    tier.at(5).insert("c")
    assert tier.policy.regret("b") == 0.0
    assert tier.policy.regret("c") == pytest.approx(23 / 24)
    with pytest.raises(PolicyError):
        tier.policy.remove(Block("zz", 1))


def test_params_are_validated() -> None:
    with pytest.raises(ValueError, match="horizon"):
        RegretAwareParams(horizon=0)
    with pytest.raises(ValueError, match="decay"):
        RegretAwareParams(decay=1.5)
    with pytest.raises(ValueError, match="max_history"):
        RegretAwareParams(max_history=-1)
    with pytest.raises(PolicyError, match="regret_weight"):
        make_params(policy_class("regret_aware"), {"regret_weight": -6})
