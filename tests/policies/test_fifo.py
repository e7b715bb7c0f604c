"""FIFO: narrated scenarios on a tier of 4 unit blocks."""

from __future__ import annotations

import pytest

from policies.base import Block, PolicyError
from tests.policies.harness import SimTier


def test_first_in_first_out_and_reads_do_not_reorder() -> None:
    tier = SimTier("fifo", 4)
    # a, b, c, d fill the tier.
    for block_id in "abcd":
        tier.insert(block_id)
    # Reading a (many times) does not save it: FIFO keeps insertion order.
    tier.access("a", "a", "a")
    assert tier.order() == ["a", "b", "c", "d"]
    # e needs one block: the first inserted, a, leaves.
    assert tier.insert("e") == ["a"]
    # f: then b.
    assert tier.insert("f") == ["b"]
    assert tier.order() == ["c", "d", "e", "f"]


def test_sizes_protection_and_removal() -> None:
    tier = SimTier("fifo", 8)
    # a(2) b(1) c(3) d(2): the tier is full.
    for block_id, size in [("a", 2), ("b", 1), ("c", 3), ("d", 2)]:
        tier.insert(block_id, size)
    # Three bytes with a protected: b and c, in order (c alone would also do, but FIFO walks).
    assert tier.victims(3, {"a"}) == ["b", "c"]
    # Removing b (freed) closes the gap; a stays first.
    tier.remove("b")
    assert tier.order() == ["a", "c", "d"]
    # A 3-byte block needs 2 more bytes than free: a alone is enough.
    assert tier.insert("e", 3) == ["a"]
    # Asking for more than the unprotected blocks hold: None, and nothing changed.
    assert tier.victims(9) is None
    assert tier.order() == ["c", "d", "e"]


def test_remove_unknown_block_raises() -> None:
    tier = SimTier("fifo", 4)
    tier.insert("a")
    with pytest.raises(PolicyError, match="'zz'"):
        tier.policy.remove(Block("zz", 1))
