"""prefix_aware: narrated scenarios on the real core (chain facts come from the core)."""

from __future__ import annotations

from broker.model.core import DirectiveKind
from tests.builders import Driver, alloc, release
from tests.conftest import small_config


def evicted(d: Driver) -> list[str]:
    return [x.block_id for x in d.directives if x.kind in (DirectiveKind.DEMOTE, DirectiveKind.EVICT) and x.from_tier == "hbm"]


def test_chain_tails_leave_before_older_blocks_with_children() -> None:
    d = Driver(small_config("prefix_aware"))
    # Request r1: a chain a0 -> a1 -> a2; a2, its last block, is the chain's tail.
    d.send(alloc("a0", ts=0), alloc("a1", ts=1, parent_block_id="a0"), alloc("a2", ts=2, parent_block_id="a1"))
    # Six unrelated single blocks follow (each its own tail), filling HBM to 900.
    d.send(*(alloc(f"x{i}", ts=3 + i) for i in range(6)))
    # The tenth block forces one out: not a0 (oldest, but it has a child) but a2, the
    # oldest tail.
    d.send(alloc("y", ts=20))
    assert evicted(d) == ["a2"]


def test_a_burst_of_one_time_prompts_does_not_flush_a_reused_prefix() -> None:
    d = Driver(small_config("prefix_aware"))
    # A system prompt s0 -> s1 -> s2 is brought by two requests: after the first releases
    # it, the second takes it again (prefix reuse).
    d.send(alloc("s0", ts=0), alloc("s1", ts=0, parent_block_id="s0"), alloc("s2", ts=0, parent_block_id="s1"))
    d.send(release("s0", "s1", "s2", ts=1))
    d.send(alloc("s0", ts=2), alloc("s1", ts=2, parent_block_id="s0"), alloc("s2", ts=2, parent_block_id="s1"))
    assert all(d.core.blocks[b].reuses == 1 for b in ("s0", "s1", "s2"))
    # Then a burst of 30 one-time prompts of two blocks each.
    for i in range(30):
        d.send(alloc(f"q{i}a", ts=10 + i), alloc(f"q{i}b", ts=10 + i, parent_block_id=f"q{i}a"))
    # The reused prefix is still in HBM; LRU would have lost it in the first few prompts.
    assert [d.where(b) for b in ("s0", "s1", "s2")] == ["hbm", "hbm", "hbm"]
    lru = Driver(small_config("lru"))
    lru.send(alloc("s0", ts=0), alloc("s1", ts=0, parent_block_id="s0"), alloc("s2", ts=0, parent_block_id="s1"))
    lru.send(release("s0", "s1", "s2", ts=1))
    lru.send(alloc("s0", ts=2), alloc("s1", ts=2, parent_block_id="s0"), alloc("s2", ts=2, parent_block_id="s1"))
    for i in range(30):
        lru.send(alloc(f"q{i}a", ts=10 + i), alloc(f"q{i}b", ts=10 + i, parent_block_id=f"q{i}a"))
    assert lru.where("s0") != "hbm"


def test_a_parent_becomes_a_tail_again_when_its_last_child_is_freed() -> None:
    from tests.builders import free

    d = Driver(small_config("prefix_aware"))
    d.send(alloc("p", ts=0), alloc("c", ts=1, parent_block_id="p"))
    assert d.core.blocks["p"].children == 1
    d.send(free("c", ts=2))
    assert d.core.blocks["p"].children == 0
    # Eight more single blocks: p is the oldest tail now and goes first.
    d.send(*(alloc(f"x{i}", ts=3 + i) for i in range(9)))
    assert evicted(d)[0] == "p"
