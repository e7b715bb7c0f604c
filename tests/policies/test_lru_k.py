"""LRU-K (K = 2): narrated scenarios; reference times count the policy's own references."""

from __future__ import annotations

import pytest

from policies.base import Block, PolicyError
from policies.lru_k import LRUKParams, LRUKPolicy
from tests.policies.harness import HOT, SimTier, scan_burst


def lru_k(tier: SimTier) -> LRUKPolicy:
    assert isinstance(tier.policy, LRUKPolicy)
    return tier.policy


def test_fewer_than_k_references_go_first_then_oldest_kth() -> None:
    tier = SimTier("lru_k", 4)
    # Inserts are references 1..4: a(1) b(2) c(3) d(4).
    for block_id in "abcd":
        tier.insert(block_id)
    # Reads: a(5), c(6), a(7). a's last two references are 5 and 7, c's 3 and 6.
    tier.access("a", "c", "a")
    assert lru_k(tier).references("a") == (5, 7)
    # b and d have one reference (infinite backward 2-distance): first, by LRU (b, then d).
    # Then by the 2nd most recent reference: c (3) before a (5).
    assert tier.order() == ["b", "d", "c", "a"]
    # e needs room: b.
    assert tier.insert("e") == ["b"]
    # d is read (reference 9): now c (3), d (4), a (5) by their 2nd most recent; e (8) has
    # one reference and goes first.
    tier.access("d")
    assert tier.order() == ["e", "c", "d", "a"]


def test_evicted_blocks_keep_their_history() -> None:
    tier = SimTier("lru_k", 3)
    # z referenced twice (1, 2); b (3) and w (4) once.
    tier.insert("z")
    tier.access("z")
    tier.insert("b")
    tier.insert("w")
    # y (5) needs room: b, the oldest single-reference block, goes; its history is retained.
    assert tier.insert("y") == ["b"]
    # b comes back (6) and needs room: w goes. With its retained reference 3, b has two
    # references and ranks by the older one, 3.
    assert tier.insert("b") == ["w"]
    assert lru_k(tier).references("b") == (3, 6)
    # Order: y (one reference) first, then z (2nd most recent 1), then b (3). Without the
    # retained history b would have had one reference and gone before z.
    assert tier.order() == ["y", "z", "b"]


def test_retained_history_can_be_off() -> None:
    tier = SimTier("lru_k", 3, {"retained_ratio": 0.0})
    tier.insert("z")
    tier.access("z")
    tier.insert("b")
    tier.insert("w")
    tier.insert("y")
    tier.insert("b")
    # b starts over with one reference (6): single-reference blocks y (5) and b (6) first.
    assert tier.order() == ["y", "b", "z"]


def test_removed_blocks_are_forgotten_and_protected_skipped() -> None:
    tier = SimTier("lru_k", 4)
    for block_id in "abcd":
        tier.insert(block_id)
    tier.access("a")
    # Freed, not evicted: no retained history.
    tier.remove("b")
    assert lru_k(tier).references("b") == ()
    assert tier.victims(2, {"c"}) == ["d", "a"]
    assert tier.victims(2, {"c"}) == ["d", "a"]
    assert tier.victims(4) is None
    with pytest.raises(PolicyError):
        tier.policy.remove(Block("b", 1))


def test_k1_is_lru() -> None:
    tier = SimTier("lru_k", 3, {"k": 1})
    for block_id in "abc":
        tier.insert(block_id)
    tier.access("a")
    assert tier.order() == ["b", "c", "a"]


def test_scan_burst_keeps_the_hot_prefix() -> None:
    # Hot blocks have four references; burst blocks one: infinite distance, evicted first.
    tier = scan_burst("lru_k")
    assert set(HOT) <= tier.resident()


def test_params_are_validated() -> None:
    with pytest.raises(ValueError, match="k must"):
        LRUKParams(k=0)
    with pytest.raises(ValueError, match="retained_ratio"):
        LRUKParams(retained_ratio=-1.0)
