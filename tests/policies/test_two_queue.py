"""two_queue: narrated scenarios; the active queue is capped at half the tier's bytes."""

from __future__ import annotations

import pytest

from policies.base import Block, PolicyError
from policies.two_queue import TwoQueueParams, TwoQueuePolicy
from tests.policies.harness import BURST, HOT, SimTier, scan_burst


def active(tier: SimTier) -> list[str]:
    policy = tier.policy
    assert isinstance(policy, TwoQueuePolicy)
    return [b for b in tier.order() if policy.is_active(tier.blocks[b])]


def test_inactive_first_promotion_and_demotion() -> None:
    # 8 unit blocks; the active queue may hold 4.
    tier = SimTier("two_queue", 8)
    for block_id in "abcdef":
        tier.insert(block_id)
    # a and b are read again while inactive: promoted.
    tier.access("a", "b")
    # Victims: the inactive queue (c..f, oldest first), then the active one (a, b).
    assert tier.order() == ["c", "d", "e", "f", "a", "b"]
    # c, d and e are read and promoted; with e the active queue would hold 5 > 4 blocks,
    # so its oldest, a, is demoted to the newest end of the inactive queue.
    tier.access("c", "d", "e")
    assert active(tier) == ["b", "c", "d", "e"]
    assert tier.order() == ["f", "a", "b", "c", "d", "e"]
    # a must earn its place again: one read promotes it, demoting b.
    tier.access("a")
    assert tier.order() == ["f", "b", "c", "d", "e", "a"]
    # A read of an active block refreshes it inside the active queue only.
    tier.access("c")
    assert tier.order() == ["f", "b", "d", "e", "a", "c"]
    # Two new blocks fill the tier; a third evicts from the inactive queue: f.
    tier.insert("g")
    tier.insert("h")
    assert tier.insert("i") == ["f"]


def test_cap_is_in_bytes() -> None:
    # 8 bytes, so the active queue may hold 4 bytes.
    tier = SimTier("two_queue", 8)
    tier.insert("a")
    tier.insert("b")
    tier.insert("c", 3)
    # a (1 byte) and b (1 byte) are promoted: 2 bytes active.
    tier.access("a", "b")
    # c (3 bytes) makes 5 > 4: the oldest active block, a, is demoted; 4 bytes fit.
    tier.access("c")
    assert active(tier) == ["b", "c"]
    assert tier.order() == ["a", "b", "c"]
    # e (3 bytes) is promoted: 7 > 4, so b and then c are demoted, oldest first, to the
    # newest end of the inactive queue (after a), until e's 3 bytes fit.
    tier.insert("e", 3)
    tier.access("e")
    assert active(tier) == ["e"]
    assert tier.order() == ["a", "b", "c", "e"]


def test_promote_after_two_reads() -> None:
    tier = SimTier("two_queue", 4, {"promote_after": 2})
    for block_id in "abc":
        tier.insert(block_id)
    # One read moves a to the newest end of the inactive queue but does not promote it.
    tier.access("a")
    assert active(tier) == []
    assert tier.order() == ["b", "c", "a"]
    # The second read does.
    tier.access("a")
    assert active(tier) == ["a"]


def test_protected_and_unknown() -> None:
    tier = SimTier("two_queue", 4)
    for block_id in "abcd":
        tier.insert(block_id)
    tier.access("a")
    # Protected inactive blocks are stepped over; then the active queue gives a.
    assert tier.victims(2, {"b", "c"}) == ["d", "a"]
    assert tier.victims(2, {"b", "c"}) == ["d", "a"]
    # Not enough unprotected bytes: None.
    assert tier.victims(3, {"b", "c"}) is None
    tier.remove("a")
    assert active(tier) == []
    with pytest.raises(PolicyError):
        tier.policy.remove(Block("a", 1))


def test_scan_burst_leaves_the_hot_prefix_in_the_active_queue() -> None:
    # The 64 hot blocks were reused: they sit in the active queue (64 <= 128 blocks), and
    # the 1,984 one-time blocks only ever churn the inactive queue.
    tier = scan_burst("two_queue")
    assert set(HOT) <= tier.resident()
    assert active(tier) == HOT
    # The inactive queue holds the newest 192 burst blocks: the rest were its victims.
    assert tier.order()[:192] == BURST[-192:]
    assert tier.evictions == BURST[:-192]


def test_params_are_validated() -> None:
    with pytest.raises(ValueError, match="active_ratio"):
        TwoQueueParams(active_ratio=0.0)
    with pytest.raises(ValueError, match="active_ratio"):
        TwoQueueParams(active_ratio=1.5)
    with pytest.raises(ValueError, match="promote_after"):
        TwoQueueParams(promote_after=0)
