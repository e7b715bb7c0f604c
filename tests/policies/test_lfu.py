"""Aged LFU: narrated scenarios on a tier of 4 unit blocks."""

from __future__ import annotations

import random

import pytest

from policies.base import Block, PolicyError
from policies.lfu import LFUParams
from policies.registry import make_params, policy_class
from tests.policies.harness import SimTier


def test_least_frequent_first_ties_by_lru() -> None:
    tier = SimTier("lfu", 4)
    # a, b, c, d: frequency 1 each; among equals, the least recent goes first.
    for block_id in "abcd":
        tier.insert(block_id)
    assert tier.order() == ["a", "b", "c", "d"]
    # Reads: a twice, b once, d once -> a 3, b 2, c 1, d 2 (b reached 2 before d).
    tier.access("a", "a", "b", "d")
    assert [tier.policy.score(tier.blocks[x]) for x in "abcd"] == [3.0, 2.0, 1.0, 2.0]
    assert tier.order() == ["c", "b", "d", "a"]
    # e needs room: c (frequency 1) leaves although a is older in insertion.
    assert tier.insert("e") == ["c"]
    # e enters at frequency 1, the lowest, so it is next (LFU's known bias against newcomers).
    assert tier.insert("f") == ["e"]


def test_frequencies_halve_every_age_every_accesses() -> None:
    tier = SimTier("lfu", 4, {"age_every": 4})
    for block_id in "abcd":
        tier.insert(block_id)
    # Four reads (a, a, b, d) reach age_every: after them every frequency halves:
    # a 3 -> 1, b 2 -> 1, d 2 -> 1, c 1 -> 0.
    tier.access("a", "a", "b", "d")
    assert [tier.policy.score(tier.blocks[x]) for x in "abcd"] == [1.0, 1.0, 0.0, 1.0]
    # Level 1 now holds the old level 2 (b, d) then the old level 3 (a): ties by old frequency.
    assert tier.order() == ["c", "b", "d", "a"]
    # One read of c takes it to 1, the newest of its level: a's old popularity no longer
    # outranks c's recent use (without aging c would sit below a).
    tier.access("c")
    assert tier.order() == ["b", "d", "a", "c"]


def test_frequency_is_capped() -> None:
    tier = SimTier("lfu", 2, {"max_freq": 3})
    tier.insert("a")
    tier.insert("b")
    # a read 10 times stops at 3; b read 3 times reaches 3 later: b is the more recent at 3.
    tier.access(*["a"] * 10)
    tier.access("b", "b", "b")
    assert tier.policy.score(tier.blocks["a"]) == 3.0
    assert tier.order() == ["a", "b"]


def test_protected_blocks_are_stepped_over_and_choose_changes_nothing() -> None:
    tier = SimTier("lfu", 4)
    for block_id in "abcd":
        tier.insert(block_id)
    tier.access("d", "d")
    assert tier.victims(2, {"a"}) == ["b", "c"]
    assert tier.victims(2, {"a"}) == ["b", "c"]
    assert tier.victims(5) is None
    with pytest.raises(PolicyError):
        tier.policy.remove(Block("zz", 1))


def test_params_are_validated() -> None:
    with pytest.raises(ValueError, match="age_every"):
        LFUParams(age_every=0)
    with pytest.raises(ValueError, match="max_freq"):
        LFUParams(max_freq=0)
    with pytest.raises(PolicyError, match="age_every"):
        make_params(policy_class("lfu"), {"age_every": -1})


class ReferenceLFU:
    """Aged LFU done eagerly: explicit counters, halved one by one at every aging."""

    def __init__(self, age_every: int, max_freq: int) -> None:
        self.age_every, self.max_freq = age_every, max_freq
        self.levels: dict[int, list[str]] = {}
        self.freq: dict[str, int] = {}
        self.accesses = 0

    def move(self, block_id: str, level: int) -> None:
        old = self.freq.pop(block_id, None)
        if old is not None:
            self.levels[old].remove(block_id)
        if level >= 0:
            self.freq[block_id] = level
            self.levels.setdefault(level, []).append(block_id)

    def access(self, block_id: str) -> None:
        self.move(block_id, min(self.max_freq, self.freq[block_id] + 1))
        self.accesses += 1
        if self.accesses % self.age_every == 0:
            halved: dict[int, list[str]] = {}
            for level in sorted(self.levels):
                halved.setdefault(level // 2, []).extend(self.levels[level])
            self.levels = halved
            self.freq = {b: f // 2 for b, f in self.freq.items()}

    def order(self) -> list[str]:
        return [b for level in sorted(self.levels) for b in self.levels[level]]


@pytest.mark.parametrize("seed", range(30))
def test_lazy_aging_matches_eager_halving(seed: int) -> None:
    # The policy never touches a block to age it; the model halves every counter. Orders
    # and frequencies must agree after every step, through many agings.
    rng = random.Random(seed)
    age_every, max_freq = rng.randint(1, 8), rng.randint(1, 6)
    tier = SimTier("lfu", 1000, {"age_every": age_every, "max_freq": max_freq})
    model = ReferenceLFU(age_every, max_freq)
    for _ in range(300):
        block_id = f"b{rng.randint(0, 11)}"
        op = rng.choice(["insert", "read", "read", "read", "remove"])
        if op == "insert" and block_id not in tier.blocks:
            tier.insert(block_id)
            model.move(block_id, 1)
        elif op == "read" and block_id in tier.blocks:
            tier.access(block_id)
            model.access(block_id)
        elif op == "remove" and block_id in tier.blocks:
            tier.remove(block_id)
            model.move(block_id, -1)
        assert tier.order() == model.order()
        assert {b: int(tier.policy.score(tier.blocks[b])) for b in tier.blocks} == model.freq
