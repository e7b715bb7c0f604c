"""windowed_recency (kv-hierarchy-lab): narrated scenarios; the step is clock.event_index."""

from __future__ import annotations

from typing import Any

import pytest

from policies.base import Block, Clock, PolicyContext, PolicyError, TierInfo
from policies.registry import make_params, policy_class
from policies.windowed_recency import WindowedRecencyParams, WindowedRecencyPolicy


class Tier:
    """One tier driven directly; each call is one event (its own step)."""

    def __init__(self, **params: Any) -> None:
        info = TierInfo(0, "hbm", 10_000, 0.0, 1000.0)
        self.clock = Clock()
        self.policy = WindowedRecencyPolicy(PolicyContext(info, (info,), self.clock), WindowedRecencyParams(**params))
        self.blocks: dict[str, Block] = {}

    def at(self, step: int) -> Tier:
        self.clock.event_index = step
        return self

    def insert(self, block_id: str, size: int = 1) -> None:
        block = self.blocks.get(block_id) or Block(block_id, size)
        self.blocks[block_id] = block
        self.policy.insert(block)

    def read(self, block_id: str) -> None:
        block = self.blocks[block_id]
        block.accesses += 1
        self.policy.access(block)

    def scores(self) -> dict[str, float]:
        return {b: self.policy.score(self.blocks[b]) for b in self.blocks if b in self.policy}

    def order(self) -> list[str]:
        victims = self.policy.choose_victims(sum(b.size for b in self.blocks.values() if b.block_id in self.policy), frozenset())
        assert victims is not None
        return [b.block_id for b in victims]


def test_hits_in_the_window_then_last_step() -> None:
    tier = Tier(window=3)
    # Steps 0-2: a, b, c arrive; no hits yet, so the last step orders them.
    for step, block_id in enumerate("abc"):
        tier.at(step).insert(block_id)
    assert tier.scores() == {"a": 0, "b": 1, "c": 2}
    # Step 3: a read (window [a]): 1 hit x 1e6 + 3.
    tier.at(3).read("a")
    assert tier.order() == ["b", "c", "a"]
    # Steps 4, 5: b read twice (window [a, b, b]): 2e6 + 5.
    tier.at(4).read("b")
    tier.at(5).read("b")
    assert tier.scores() == {"a": 1_000_003, "b": 2_000_005, "c": 2}
    # Step 6: c read; the window keeps 3 reads, so a's read falls out: a is back to 3.
    tier.at(6).read("c")
    assert tier.scores() == {"a": 3, "b": 2_000_005, "c": 1_000_006}
    assert tier.order() == ["a", "c", "b"]
    # Step 7: c read again; b's first read falls out (window [b, c, c]): b 1e6 + 5, c 2e6 + 7.
    tier.at(7).read("c")
    assert tier.scores() == {"a": 3, "b": 1_000_005, "c": 2_000_007}
    assert tier.order() == ["a", "b", "c"]


def test_a_block_that_comes_back_keeps_its_hits_in_the_window() -> None:
    tier = Tier(window=3)
    tier.at(0).insert("a")
    tier.at(1).insert("b")
    # Steps 2, 3: b read twice.
    tier.at(2).read("b")
    tier.at(3).read("b")
    # Step 4: b is chosen and evicted.
    victims = tier.policy.choose_victims(1, {"a"})
    assert victims is not None and [v.block_id for v in victims] == ["b"]
    tier.at(4).policy.evicted(victims[0])
    assert tier.order() == ["a"]
    # Step 5: a read (window [b, b, a]); step 6: b comes back, its two reads still in the window.
    tier.at(5).read("a")
    tier.at(6).insert("b")
    assert tier.scores() == {"a": 1_000_005, "b": 2_000_006}
    # Step 7: a read pushes one of b's reads out while b is resident: b is re-keyed.
    tier.at(7).read("a")
    assert tier.scores() == {"a": 2_000_007, "b": 1_000_006}
    assert tier.order() == ["b", "a"]


def test_the_default_window_is_32_reads() -> None:
    tier = Tier()
    tier.at(0).insert("a")
    tier.at(1).insert("b")
    tier.at(2).read("a")
    # 31 reads of b: a's read is still among the last 32.
    for step in range(3, 34):
        tier.at(step).read("b")
    assert tier.policy.hits("a") == 1 and tier.order() == ["a", "b"]
    assert tier.policy.score(tier.blocks["a"]) == 1_000_002
    # The 32nd read of b pushes it out: a scores its last step alone.
    tier.at(34).read("b")
    assert tier.policy.hits("a") == 0 and tier.policy.hits("b") == 32
    assert tier.policy.score(tier.blocks["a"]) == 2


def test_updates_keep_the_order_and_unknown_blocks_are_refused() -> None:
    tier = Tier()
    tier.at(0).insert("a")
    tier.at(1).insert("b")
    tier.at(5).policy.update(tier.blocks["a"])
    assert tier.order() == ["a", "b"]
    tier.policy.remove(tier.blocks["a"])
    with pytest.raises(PolicyError):
        tier.policy.remove(tier.blocks["a"])
    with pytest.raises(PolicyError):
        tier.read("a")


def test_params_are_validated() -> None:
    with pytest.raises(ValueError, match="window"):
        WindowedRecencyParams(window=0)
    with pytest.raises(ValueError, match="hit_weight"):
        WindowedRecencyParams(hit_weight=-1)
    with pytest.raises(PolicyError, match="window"):
        make_params(policy_class("windowed_recency"), {"window": 0})
