"""hotcold (kv_deadline_scheduler's HotCold): narrated scenarios, the policy driven directly."""

from __future__ import annotations

import pytest

from policies.base import Block, Clock, PolicyContext, PolicyError, TierInfo
from policies.hotcold import HotColdParams, HotColdPolicy
from policies.registry import make_params, policy_class


def make(**params: int) -> tuple[HotColdPolicy, Clock, dict[str, Block]]:
    info = TierInfo(0, "hbm", 10_000, 0.0, 1000.0)
    clock = Clock()
    return HotColdPolicy(PolicyContext(info, (info,), clock), HotColdParams(**params)), clock, {}


def insert(policy: HotColdPolicy, clock: Clock, blocks: dict[str, Block], block_id: str, size: int = 1) -> None:
    # As the core allocates: created and last read now.
    block = Block(block_id, size)
    block.created_us = block.last_access_us = clock.now_us
    blocks[block_id] = block
    policy.insert(block)


def read(policy: HotColdPolicy, clock: Clock, block: Block) -> None:
    # As the core reads a block: count it, stamp it, then tell the policy.
    block.accesses += 1
    block.last_access_us = clock.now_us
    policy.access(block)


def order(policy: HotColdPolicy, blocks: dict[str, Block]) -> list[str]:
    victims = policy.choose_victims(sum(b.size for b in blocks.values() if b.block_id in policy), frozenset())
    assert victims is not None
    return [b.block_id for b in victims]


def test_coldest_leaves_first_and_a_read_makes_a_block_hot() -> None:
    policy, clock, blocks = make()
    # a, b, c arrive at t = 0, 10, 20: a is the coldest.
    for t, block_id in ((0, "a"), (10, "b"), (20, "c")):
        clock.now_us = t
        insert(policy, clock, blocks, block_id)
    assert order(policy, blocks) == ["a", "b", "c"]
    # a is read at t = 30: recency 1, the hottest; b is now the coldest.
    clock.now_us = 30
    read(policy, clock, blocks["a"])
    assert order(policy, blocks) == ["b", "c", "a"]
    # Two bytes needed: b then c; asking again gives the same answer (nothing changed).
    assert [b.block_id for b in policy.choose_victims(2, frozenset()) or []] == ["b", "c"]
    assert [b.block_id for b in policy.choose_victims(2, frozenset()) or []] == ["b", "c"]
    # With b protected, c and a are the two coldest left.
    assert [b.block_id for b in policy.choose_victims(2, {"b"}) or []] == ["c", "a"]
    assert policy.choose_victims(3, {"b"}) is None


def test_ties_on_recency_go_to_the_larger_block_then_the_id() -> None:
    policy, clock, blocks = make()
    # Three blocks arrive at the same instant: equal recency and last access.
    insert(policy, clock, blocks, "y", 1)
    insert(policy, clock, blocks, "x", 2)
    insert(policy, clock, blocks, "z", 1)
    # min(recency, last_access, -size, id): x (the largest) first, then y before z.
    assert order(policy, blocks) == ["x", "y", "z"]


def test_order_stays_exact_as_time_passes() -> None:
    policy, clock, blocks = make(recency_horizon_us=100)
    # a at t = 0, b at t = 50.
    insert(policy, clock, blocks, "a")
    clock.now_us = 50
    insert(policy, clock, blocks, "b")
    # At t = 60 the seed's recency_score is 0.4 for a, 0.9 for b.
    clock.now_us = 60
    assert policy.score(blocks["a"]) == pytest.approx(0.4)
    assert policy.score(blocks["b"]) == pytest.approx(0.9)
    assert order(policy, blocks) == ["a", "b"]
    # At t = 1000 both are past the horizon: recency 0 for both, last access decides: a first.
    clock.now_us = 1000
    assert policy.score(blocks["a"]) == policy.score(blocks["b"]) == 0.0
    assert order(policy, blocks) == ["a", "b"]
    # An intent update does not change heat.
    policy.update(blocks["a"])
    assert order(policy, blocks) == ["a", "b"]


def test_remove_and_evicted_forget_the_block() -> None:
    policy, clock, blocks = make()
    for block_id in "abc":
        insert(policy, clock, blocks, block_id)
    policy.remove(blocks["b"])
    policy.evicted(blocks["a"])
    assert len(policy) == 1 and "c" in policy and "a" not in policy
    with pytest.raises(PolicyError):
        policy.remove(blocks["a"])
    with pytest.raises(PolicyError):
        policy.access(blocks["b"])


def test_params_are_validated() -> None:
    with pytest.raises(ValueError, match="recency_horizon_us"):
        HotColdParams(recency_horizon_us=0)
    with pytest.raises(PolicyError, match="recency_horizon_us"):
        make_params(policy_class("hotcold"), {"recency_horizon_us": -5})
