"""heavy_hitter (kv-hierarchy-lab): narrated scenarios; the step is clock.event_index."""

from __future__ import annotations

from typing import Any

import pytest

from policies.base import Block, Clock, PolicyContext, PolicyError, TierInfo
from policies.heavy_hitter import HeavyHitterParams, HeavyHitterPolicy
from policies.registry import make_params, policy_class


class Tier:
    """One tier driven directly; each call is one event (its own step)."""

    def __init__(self, **params: Any) -> None:
        info = TierInfo(0, "hbm", 10_000, 0.0, 1000.0)
        self.clock = Clock()
        self.policy = HeavyHitterPolicy(PolicyContext(info, (info,), self.clock), HeavyHitterParams(**params))
        self.blocks: dict[str, Block] = {}

    def at(self, step: int) -> Tier:
        self.clock.event_index = step
        return self

    def insert(self, block_id: str, size: int = 1) -> None:
        block = self.blocks.get(block_id) or Block(block_id, size)
        self.blocks[block_id] = block
        self.policy.insert(block)

    def read(self, block_id: str) -> None:
        # The core counts the read in block.accesses before telling the policy.
        block = self.blocks[block_id]
        block.accesses += 1
        self.policy.access(block)

    def order(self) -> list[str]:
        victims = self.policy.choose_victims(sum(b.size for b in self.blocks.values() if b.block_id in self.policy), frozenset())
        assert victims is not None
        return [b.block_id for b in victims]


def test_reads_outweigh_ten_thousand_steps_of_recency() -> None:
    tier = Tier()
    # Steps 0-2: a, b, c arrive (no reads: score = last step).
    for step, block_id in enumerate("abc"):
        tier.at(step).insert(block_id)
    # Steps 3, 4: a read twice: 2 x 10000 + 4. Step 5: b read once: 10000 + 5.
    tier.at(3).read("a")
    tier.at(4).read("a")
    tier.at(5).read("b")
    assert [tier.policy.score(tier.blocks[x]) for x in "abc"] == [20_004, 10_005, 2]
    assert tier.order() == ["c", "b", "a"]
    # Step 15000: d arrives: 15000 outranks b's single read (10005) but not a's two.
    tier.at(15_000).insert("d")
    assert tier.order() == ["c", "b", "d", "a"]
    # Step 25000: e arrives: 25000 now outranks a's 20004: frequency never ages, but
    # recency keeps growing.
    tier.at(25_000).insert("e")
    assert tier.order() == ["c", "b", "d", "a", "e"]
    # Step 25001: c read once: 10000 + 25001, the top.
    tier.at(25_001).read("c")
    assert tier.order() == ["b", "d", "a", "e", "c"]
    # Protected blocks are stepped over; asking changes nothing.
    assert [v.block_id for v in tier.policy.choose_victims(2, {"b"}) or []] == ["d", "a"]
    assert [v.block_id for v in tier.policy.choose_victims(2, {"b"}) or []] == ["d", "a"]


def test_ties_go_by_block_id_and_updates_change_nothing() -> None:
    tier = Tier()
    # One event inserts three blocks (a demotion batch): same step, same reads.
    tier.at(7).insert("y")
    tier.insert("x")
    tier.insert("z")
    assert tier.order() == ["x", "y", "z"]
    tier.at(8).policy.update(tier.blocks["x"])
    assert tier.order() == ["x", "y", "z"]


def test_freq_weight_zero_is_plain_recency() -> None:
    tier = Tier(freq_weight=0)
    tier.at(0).insert("a")
    tier.at(1).insert("b")
    for step in range(2, 6):
        tier.at(step).read("a")
    tier.at(6).read("b")
    assert tier.order() == ["a", "b"]


def test_params_are_validated() -> None:
    with pytest.raises(ValueError, match="freq_weight"):
        HeavyHitterParams(freq_weight=-1)
    with pytest.raises(PolicyError, match="freq_weight"):
        make_params(policy_class("heavy_hitter"), {"freq_weight": 1.5})
