"""cost_aware (kv-hierarchy-lab): narrated scenarios; the step is clock.event_index.

Score = 2.0 reads + last/step - 0.4 KiB, taken at the block's own insert or read (where
last = step, so last/step = 1); ties go to the least recent step, then the block id.
"""

from __future__ import annotations

from typing import Any

import pytest

from policies.base import Block, Clock, PolicyContext, PolicyError, TierInfo
from policies.cost_aware import CostAwareParams, CostAwarePolicy
from policies.registry import make_params, policy_class


class Tier:
    """One tier driven directly; each call is one event (its own step)."""

    def __init__(self, **params: Any) -> None:
        info = TierInfo(0, "hbm", 1 << 20, 0.0, 1000.0)
        self.clock = Clock()
        self.policy = CostAwarePolicy(PolicyContext(info, (info,), self.clock), CostAwareParams(**params))
        self.blocks: dict[str, Block] = {}

    def at(self, step: int) -> Tier:
        self.clock.event_index = step
        return self

    def insert(self, block_id: str, size: int) -> None:
        block = self.blocks.get(block_id) or Block(block_id, size)
        self.blocks[block_id] = block
        self.policy.insert(block)

    def read(self, block_id: str) -> None:
        block = self.blocks[block_id]
        block.accesses += 1
        self.policy.access(block)

    def order(self) -> list[str]:
        victims = self.policy.choose_victims(sum(b.size for b in self.blocks.values() if b.block_id in self.policy), frozenset())
        assert victims is not None
        return [b.block_id for b in victims]


def test_big_and_rarely_read_blocks_leave_first() -> None:
    tier = Tier()
    # Step 1: a (1 KiB): 0 + 1 - 0.4 = 0.6. Step 2: b (4 KiB): 0 + 1 - 1.6 = -0.6.
    # Step 3: c (1 KiB): 0.6, a tie with a broken by the last step.
    tier.at(1).insert("a", 1024)
    tier.at(2).insert("b", 4096)
    tier.at(3).insert("c", 1024)
    assert [tier.policy.score(tier.blocks[x]) for x in "abc"] == pytest.approx([0.6, -0.6, 0.6])
    assert tier.order() == ["b", "a", "c"]
    # Step 4: a read: 2 + 1 - 0.4 = 2.6.
    tier.at(4).read("a")
    assert tier.order() == ["b", "c", "a"]
    # Step 5: b read: 2 + 1 - 1.6 = 1.4: read once, still below a, but above the unread c.
    tier.at(5).read("b")
    assert tier.policy.score(tier.blocks["b"]) == pytest.approx(1.4)
    assert tier.order() == ["c", "b", "a"]
    # Step 6: d (512 B, unread): 1 - 0.2 = 0.8, between c and b.
    tier.at(6).insert("d", 512)
    assert tier.order() == ["c", "d", "b", "a"]
    # Three KiB needed with c protected: d (512) + b (4096).
    assert [v.block_id for v in tier.policy.choose_victims(3072, {"c"}) or []] == ["d", "b"]


def test_a_big_block_read_often_outlives_a_small_one_read_once() -> None:
    tier = Tier()
    tier.at(1).insert("big", 8192)
    tier.at(2).insert("small", 1024)
    # big: 0 + 1 - 3.2 = -2.2; small: 0.6.
    assert tier.order() == ["big", "small"]
    # Reads: big three times (6 + 1 - 3.2 = 3.8), small once (2.6).
    for step in (3, 4, 5):
        tier.at(step).read("big")
    tier.at(6).read("small")
    assert tier.order() == ["small", "big"]


def test_weights_are_parameters() -> None:
    # Without the size penalty, the older of two unread blocks leaves first whatever the size.
    tier = Tier(size_weight=0.0)
    tier.at(1).insert("small", 1)
    tier.at(2).insert("big", 100_000)
    assert tier.order() == ["small", "big"]
    tier.at(3).policy.update(tier.blocks["small"])
    assert tier.order() == ["small", "big"]


def test_params_are_validated() -> None:
    with pytest.raises(ValueError, match="size_weight"):
        CostAwareParams(size_weight=-0.1)
    with pytest.raises(ValueError, match="freq_weight"):
        CostAwareParams(freq_weight=-1.0)
    with pytest.raises(PolicyError, match="freq_weight"):
        make_params(policy_class("cost_aware"), {"freq_weight": "two"})
