"""ARC: narrated scenarios on a tier of 4 unit blocks, then bounds and scan resistance."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.arc import ARCPolicy
from policies.base import Block, PolicyError
from tests.policies.harness import BURST, HOT, SimTier, scan_burst


def arc(tier: SimTier) -> ARCPolicy:
    assert isinstance(tier.policy, ARCPolicy)
    return tier.policy


def test_recency_frequency_and_ghost_hits_steer_p() -> None:
    tier = SimTier("arc", 4)
    # a, b, c, d: seen once, all in T1; p (T1's target) starts at 0.
    for block_id in "abcd":
        tier.insert(block_id)
    # a and b are read again: T2.
    tier.access("a", "b")
    assert [arc(tier).list_of(x) for x in "abcd"] == ["T2", "T2", "T1", "T1"]
    # e needs room: T1 (2 blocks) exceeds p = 0, so T1's oldest, c, goes; its ghost joins B1.
    assert tier.insert("e") == ["c"]
    assert arc(tier).list_of("c") == "B1"
    # c comes back: the B1 hit says T1 was too small: p grows by 1 (|B1| >= |B2|) before
    # room is made; T1 (d, e: 2) still exceeds p = 1, so d goes to B1, and c joins T2.
    assert tier.insert("c") == ["d"]
    assert arc(tier).p == 1
    assert arc(tier).list_of("c") == "T2"
    # f needs room: T1 holds e alone, 1 byte, not more than p = 1, so T2's oldest, a, goes to B2.
    assert tier.insert("f") == ["a"]
    assert arc(tier).list_of("a") == "B2"
    # a comes back: the B2 hit says T2 was too small: p shrinks by 1 x |B1| / |B2| = 2,
    # floored at 0; then room: T1 = e, f = 2 > 0, so e goes to B1.
    assert tier.insert("a") == ["e"]
    assert arc(tier).p == 0
    assert arc(tier).list_bytes() == {"T1": 1, "T2": 3, "B1": 2, "B2": 0}
    # Order now: T1 (f) while it exceeds p, then T2 oldest first.
    assert tier.order() == ["f", "b", "c", "a"]


def test_p_grown_by_b1_hits_lets_t1_keep_its_blocks() -> None:
    tier = SimTier("arc", 4)
    for block_id in "abcd":
        tier.insert(block_id)
    tier.access("a", "b")
    # e and f push c and d out of T1 into B1 (T1 exceeds p = 0 each time).
    assert tier.insert("e") == ["c"]
    assert tier.insert("f") == ["d"]
    # c comes back: the B1 hit makes p = 1; T1 (e, f) exceeds it: e goes to B1.
    assert tier.insert("c") == ["e"]
    assert arc(tier).p == 1
    # d comes back: the B1 hit makes p = 2; T1 holds only f (1 byte, not above p), so
    # T2's oldest, a, makes room.
    assert tier.insert("d") == ["a"]
    assert arc(tier).p == 2
    # With p = 2, T1 keeps up to 2 bytes of newcomers: g joins f in T1 and T2 pays.
    assert tier.insert("g") == ["b"]
    assert tier.insert("h") == ["c"]
    # Only now, at 3 bytes, does T1 exceed p: its oldest first, then T2, then the rest of T1.
    assert tier.order() == ["f", "d", "g", "h"]


def test_a_ghost_hit_moves_p_before_the_victim_is_chosen() -> None:
    # The paper adapts p first, then REPLACE: the incoming block is told by the core's
    # ``incoming`` hook before ``choose_victims``.
    tier = SimTier("arc", 4)
    for block_id in "abcd":
        tier.insert(block_id)
    tier.access("a", "b", "c")
    assert tier.insert("e") == ["d"]  # T1 = d alone, 1 > p = 0
    assert arc(tier).list_of("d") == "B1"
    # d comes back: p becomes 1 first, so T1 (e alone, 1) no longer exceeds it and T2's
    # oldest pays. Choosing before adapting (p still 0) would have evicted e.
    assert tier.insert("d") == ["a"]
    assert arc(tier).p == 1
    assert [arc(tier).list_of(x) for x in "abcde"] == ["B2", "T2", "T2", "T2", "T1"]


def test_an_arrival_counts_only_during_its_event() -> None:
    # A block the core made room for but never inserted (it arrived pinned) must not steer
    # a later eviction that makes room for nothing (an engine's EvictionRequested).
    tier = SimTier("arc", 4)
    for block_id in "abcd":
        tier.insert(block_id)
    tier.access("a", "b", "c")
    assert tier.insert("e") == ["d"]
    tier.clock.event_index = 5
    tier.policy.incoming(Block("d", 1))  # d, a B1 ghost, arrives: during event 5, p would be 1
    assert tier.victims(1) == ["a"]
    tier.clock.event_index = 6  # d never joined: in a later event the victims ignore it
    assert tier.victims(1) == ["e"]
    assert tier.make_room(1) == ["e"]
    assert arc(tier).p == 0 and arc(tier).list_of("d") == "B1"


def test_replace_takes_from_t1_on_a_tie_when_the_block_was_in_b2() -> None:
    # REPLACE's tie rule: |T1| = p and the incoming block is a B2 ghost: T1 pays.
    tier = SimTier("arc", 3)
    tier.insert("e")
    tier.insert("b")
    tier.access("e")  # T2 = e; T1 = b
    tier.insert("d")
    assert tier.insert("a") == ["b"]  # T1 (b, d) > p = 0; b -> B1
    assert tier.insert("b") == ["d"]  # B1 hit: p = 1; T1 (d, a) = 2 > 1; d -> B1
    assert tier.insert("d") == ["e"]  # B1 hit: p = 2; T1 (a) = 1 <= 2; T2's oldest, e -> B2
    assert arc(tier).p == 2
    # e comes back from B2: p = 2 - max(|B1| / |B2|, 1) = 1 = |T1|. A tie, and e was in B2,
    # so T1's a leaves (without the rule, T2's oldest, b, would).
    assert tier.insert("e") == ["a"]
    assert arc(tier).p == 1
    assert arc(tier).list_of("e") == "T2"


def test_a_miss_drops_the_oldest_b1_ghost_when_t1_and_b1_fill_the_cache() -> None:
    # Case IV.A: |T1| + |B1| would pass c with the new block: B1's oldest ghost goes first.
    tier = SimTier("arc", 3)
    for block_id in "abc":
        tier.insert(block_id)
    assert tier.insert("d") == ["a"]  # T1 + B1 + 1 = 4 > 3, B1 empty: a leaves, no ghost
    assert arc(tier).list_of("a") is None
    tier.access("b")  # T2 = b; T1 = c, d
    assert tier.insert("e") == ["c"]  # T1 + B1 + 1 = 3: case IV.B, REPLACE: c -> B1
    assert arc(tier).list_of("c") == "B1"
    assert tier.insert("f") == ["d"]  # T1 (d, e) + B1 (c) + 1 = 4 > 3: c dropped, d -> B1
    assert arc(tier).list_of("c") is None
    assert arc(tier).list_bytes() == {"T1": 2, "T2": 1, "B1": 1, "B2": 0}


def test_remove_is_not_a_ghost_and_protected_blocks_stay() -> None:
    tier = SimTier("arc", 4)
    for block_id in "abcd":
        tier.insert(block_id)
    tier.access("d")
    # a is freed (remove), not evicted: ARC did not judge it, so no ghost.
    tier.remove("a")
    assert arc(tier).list_of("a") is None
    # With b protected, T1's next is c; T1 then has only b, so T2 gives d.
    assert tier.victims(2, {"b"}) == ["c", "d"]
    assert tier.victims(2, {"b"}) == ["c", "d"]
    assert tier.victims(4) is None
    with pytest.raises(PolicyError):
        tier.policy.remove(Block("a", 1))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 11), st.integers(1, 3), st.booleans()), max_size=80))
def test_ghosts_never_hold_more_than_twice_the_tier(ops: list[tuple[int, int, bool]]) -> None:
    # Random inserts (ids come back, so ghosts hit) and reads; sizes 1..3 on 10 bytes.
    tier = SimTier("arc", 10)
    for i, size, read in ops:
        block_id = f"b{i}"
        if block_id in tier.blocks:
            if read:
                tier.access(block_id)
        else:
            tier.insert(block_id, size)
        sizes = arc(tier).list_bytes()
        assert sizes["T1"] + sizes["T2"] == tier.used
        assert sizes["B1"] + sizes["B2"] <= 20
        assert 0 <= arc(tier).p <= 10


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 15), st.booleans()), max_size=120))
def test_unit_blocks_keep_the_papers_invariants(ops: list[tuple[int, bool]]) -> None:
    # With uniform blocks, the cases alone keep |T1| + |B1| <= c and the four lists <= 2c.
    tier = SimTier("arc", 6)
    for i, read in ops:
        block_id = f"b{i}"
        if block_id in tier.blocks:
            if read:
                tier.access(block_id)
        else:
            tier.insert(block_id)
        sizes = arc(tier).list_bytes()
        assert sizes["T1"] + sizes["B1"] <= 6
        assert sum(sizes.values()) <= 12


def test_scan_burst_leaves_the_hot_prefix_in_t2() -> None:
    # The hot blocks were read again: T2. The burst is seen once: T1. No burst block ever
    # comes back, so no ghost hit moves p off 0 and every victim comes from T1.
    tier = scan_burst("arc")
    assert set(HOT) <= tier.resident()
    assert all(arc(tier).list_of(b) == "T2" for b in HOT)
    assert arc(tier).p == 0
    assert tier.evictions == BURST[:-192]
