"""LRU: narrated scenarios on a tier of 4 unit blocks."""

from __future__ import annotations

import pytest

from policies.base import Block, PolicyError
from tests.policies.harness import SimTier


def test_the_least_recently_used_block_leaves_first() -> None:
    tier = SimTier("lru", 4)
    # a, b, c, d fill the tier, oldest first.
    for block_id in "abcd":
        tier.insert(block_id)
    # a is read again: b becomes the least recent.
    tier.access("a")
    assert tier.order() == ["b", "c", "d", "a"]
    # e needs one block: b leaves; f: then c.
    assert tier.insert("e") == ["b"]
    assert tier.insert("f") == ["c"]
    assert tier.order() == ["d", "a", "e", "f"]


def test_protected_blocks_are_stepped_over_and_sizes_add_up() -> None:
    tier = SimTier("lru", 8)
    for block_id, size in [("a", 2), ("b", 1), ("c", 3), ("d", 2)]:
        tier.insert(block_id, size)
    # Three bytes with a (the least recent) protected: b then c.
    assert tier.victims(3, {"a"}) == ["b", "c"]
    # Not enough outside the protected set: None, and nothing changed.
    assert tier.victims(7, {"c"}) is None
    assert tier.order() == ["a", "b", "c", "d"]


def test_removing_an_unknown_block_is_a_clear_error() -> None:
    tier = SimTier("lru", 4)
    with pytest.raises(PolicyError, match="not held"):
        tier.policy.remove(Block("ghost", 1))
