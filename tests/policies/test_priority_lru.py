"""priority_lru: class, then request priority, then recency; narrated on a tier of 4 blocks."""

from __future__ import annotations

from policies.base import Priority
from tests.policies.harness import SimTier


def test_class_then_request_priority_then_recency() -> None:
    tier = SimTier("priority_lru", 4)
    # hot (HOT, priority 50), cold (COLD, 50), warm-lo (WARM, 10), warm-hi (WARM, 90).
    for block_id, cls, rp in [
        ("hot", Priority.HOT, 50),
        ("cold", Priority.COLD, 50),
        ("warm-lo", Priority.WARM, 10),
        ("warm-hi", Priority.WARM, 90),
    ]:
        tier.insert(block_id)
        block = tier.blocks[block_id]
        block.priority, block.request_priority = cls, rp
        tier.policy.update(block)
    # The coldest class leaves first, whatever its recency; then the lower request priority.
    assert tier.victims(1) == ["cold"]
    assert tier.victims(2) == ["cold", "warm-lo"]
    assert tier.victims(4) == ["cold", "warm-lo", "warm-hi", "hot"]


def test_within_a_class_the_least_recent_leaves_first_and_an_update_moves_a_block() -> None:
    tier = SimTier("priority_lru", 4)
    for block_id in "abcd":
        tier.insert(block_id)  # all WARM (unspecified), request priority 50
    tier.access("a")
    assert tier.victims(1) == ["b"]
    # b becomes HOT: it now outranks every WARM block.
    b = tier.blocks["b"]
    b.priority = Priority.HOT
    tier.policy.update(b)
    assert tier.victims(3) == ["c", "d", "a"]
    # A prefetch is admitted only over blocks ranked strictly lower.
    cold_candidate = tier.blocks["c"]
    assert tier.policy.admit_prefetch(b, [cold_candidate])
    assert not tier.policy.admit_prefetch(cold_candidate, [b])
