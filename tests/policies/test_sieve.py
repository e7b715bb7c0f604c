"""SIEVE: narrated scenarios on a tier of 5 unit blocks, and a reference model."""

from __future__ import annotations

import random

import pytest

from policies.base import Block, PolicyError
from policies.sieve import SievePolicy
from tests.policies.harness import HOT, SimTier, scan_burst


def sieve(tier: SimTier) -> SievePolicy:
    assert isinstance(tier.policy, SievePolicy)
    return tier.policy


def test_hand_clears_visited_blocks_and_evicts_the_first_unvisited() -> None:
    tier = SimTier("sieve", 5)
    # a..e, oldest first; a and c are read (visited bits set; nothing moves).
    for block_id in "abcde":
        tier.insert(block_id)
    tier.access("a", "c")
    # f needs room. The hand starts at the oldest end: a is visited, so its bit is cleared
    # and it stays; b is not: b is the victim. The hand rests on c.
    assert tier.insert("f") == ["b"]
    assert sieve(tier).hand() == "c"
    assert not sieve(tier).visited("a")
    # g: c is visited (cleared, stays), d is the victim; the hand rests on e.
    assert tier.insert("g") == ["d"]
    assert sieve(tier).hand() == "e"
    # h: e was never read: victim at once. The hand rests on f.
    assert tier.insert("h") == ["e"]
    # f and g are read. i: the hand clears f and g and takes h, the newest block: SIEVE
    # demotes new blocks that were not reused quickly. The hand then wraps to the oldest.
    tier.access("f", "g")
    assert tier.insert("i") == ["h"]
    assert sieve(tier).hand() is None
    # j: from the oldest end again: a (cleared by the first pass) is now the victim.
    assert tier.insert("j") == ["a"]


def test_choose_victims_changes_nothing_and_steps_over_protected() -> None:
    tier = SimTier("sieve", 5)
    for block_id in "abcde":
        tier.insert(block_id)
    tier.access("a", "b")
    # Plan for 2 bytes with c protected: a and b are cleared in passing, c is stepped over,
    # d and e are taken.
    assert tier.victims(2, {"c"}) == ["d", "e"]
    # Nothing changed: the bits are still set and the hand has not moved.
    assert sieve(tier).visited("a") and sieve(tier).visited("b")
    assert sieve(tier).hand() is None
    assert tier.victims(2, {"c"}) == ["d", "e"]
    # With c, d, e protected, the walk goes round: a and b, cleared on the first pass, are
    # taken on the second.
    assert tier.victims(2, {"c", "d", "e"}) == ["a", "b"]
    assert tier.victims(3, {"c", "d", "e"}) is None
    # The core evicts d and e: now the bits are cleared and the hand rests after e (wraps).
    assert tier.make_room(2, {"c"}) == ["d", "e"]
    assert not sieve(tier).visited("a") and not sieve(tier).visited("b")
    assert sieve(tier).hand() is None
    assert tier.order() == ["a", "b", "c"]


def test_removing_the_block_under_the_hand_moves_the_hand_on() -> None:
    tier = SimTier("sieve", 4)
    for block_id in "abcd":
        tier.insert(block_id)
    tier.access("a")
    assert tier.make_room(1) == ["b"]
    assert sieve(tier).hand() == "c"
    tier.remove("c")
    assert sieve(tier).hand() == "d"
    with pytest.raises(PolicyError):
        tier.policy.remove(Block("c", 1))


def test_scan_burst_keeps_the_hot_prefix() -> None:
    # The first eviction clears the 64 hot bits once; after that the hand only ever meets
    # unvisited burst blocks and never wraps back, so the hot prefix stays.
    tier = scan_burst("sieve")
    assert set(HOT) <= tier.resident()


class ReferenceSieve:
    """SIEVE evicting in place, as in the paper (list and hand by id; sizes in bytes)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.queue: list[str] = []  # oldest first
        self.sizes: dict[str, int] = {}
        self.visited: dict[str, bool] = {}
        self.hand: str | None = None

    def evict_one(self) -> tuple[str, int]:
        i = self.queue.index(self.hand) if self.hand is not None else 0
        while self.visited[self.queue[i]]:
            self.visited[self.queue[i]] = False
            i = (i + 1) % len(self.queue)
        victim = self.queue.pop(i)
        self.hand = self.queue[i] if i < len(self.queue) else None
        del self.visited[victim]
        return victim, self.sizes.pop(victim)

    def make_room(self, bytes_needed: int) -> list[str] | None:
        if sum(self.sizes.values()) < bytes_needed:
            return None
        victims, freed = [], 0
        while freed < bytes_needed:
            victim, size = self.evict_one()
            victims.append(victim)
            freed += size
        return victims

    def insert(self, block_id: str, size: int) -> list[str]:
        victims = self.make_room(sum(self.sizes.values()) + size - self.capacity) or []
        self.queue.append(block_id)
        self.sizes[block_id] = size
        self.visited[block_id] = False
        return victims

    def remove(self, block_id: str) -> None:
        i = self.queue.index(block_id)
        if self.hand == block_id:
            self.hand = self.queue[i + 1] if i + 1 < len(self.queue) else None
        self.queue.pop(i)
        del self.sizes[block_id], self.visited[block_id]


@pytest.mark.parametrize("seed", range(40))
def test_victims_match_the_reference(seed: int) -> None:
    # Seeded streams long enough for the hand to wrap many times, with removals under it.
    rng = random.Random(seed)
    capacity = rng.randint(6, 30)
    tier = SimTier("sieve", capacity)
    model = ReferenceSieve(capacity)
    for _ in range(300):
        op = rng.choice(["insert", "insert", "read", "read", "remove", "room"])
        block_id, size = f"b{rng.randint(0, 24)}", rng.randint(1, 3)
        if op == "insert" and block_id not in tier.blocks:
            assert tier.insert(block_id, size) == model.insert(block_id, size)
        elif op == "read" and block_id in tier.blocks:
            tier.access(block_id)
            model.visited[block_id] = True
        elif op == "remove" and block_id in tier.blocks:
            tier.remove(block_id)
            model.remove(block_id)
        elif op == "room":
            assert tier.make_room(3 * size) == model.make_room(3 * size)
        assert sieve(tier).hand() == model.hand
