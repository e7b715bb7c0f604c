"""BlocksAccessed.refresh_only: blocks used but not read (a request finished with chunks it
stored). Through the real core: not counted as an access; lru refreshes recency as an access
does; arc keeps a refreshed T1 block in T1 (an access promotes it to T2); every other policy
takes it as an access, as before the flag existed; bad combinations are refused by field."""

from __future__ import annotations

import pytest

from broker.model.apply import apply_batch
from broker.model.core import Core
from kvbroker.v1 import intent_pb2 as pb
from vllm_integration.decisions_to_vllm.settings import OffloadSettings


class Tier:
    """A one-tier core of ``capacity`` one-byte chunks running ``policy``."""

    def __init__(self, policy: str, capacity: int = 100) -> None:
        self.core = Core(OffloadSettings().core_config(capacity, policy))
        self.seq = 0

    def send(self, *events: pb.Event) -> list[tuple[str, str]]:
        """Apply the events as one batch; the rejections as (field, reason)."""
        self.seq += 1
        timed = [pb.Event(ts_us=self.seq, **{e.WhichOneof("kind"): getattr(e, e.WhichOneof("kind"))}) for e in events]
        out = apply_batch(self.core, pb.IntentBatch(client_id="c", batch_seq=self.seq, events=timed).SerializeToString())
        return [(r.field, r.reason) for r in out.rejections]

    def order(self) -> list[str]:
        policy = self.core.tiers[0].policy
        chosen = policy.choose_victims(len(policy), frozenset())
        assert chosen is not None
        return [b.block_id for b in chosen]


def alloc(block_id: str) -> pb.Event:
    return pb.Event(allocated=pb.BlockAllocated(intent=pb.MemoryIntent(block_id=block_id, size_bytes=1)))


def access(*ids: str, refresh: bool = False, ends: str = "", scope: str = "", next_use: int | None = None) -> pb.Event:
    a = pb.BlocksAccessed(
        block_ids=ids, refresh_only=refresh, ends_scope=ends, scope=scope, token_positions=[0] * len(ids) if scope else []
    )
    if next_use is not None:
        a.next_use_us = next_use
    return pb.Event(accessed=a)


def evict(count: int) -> pb.Event:
    return pb.Event(eviction_requested=pb.EvictionRequested(count=count))


def test_a_refresh_is_not_an_access() -> None:
    t = Tier("lru")
    assert t.send(alloc("a"), alloc("b")) == []
    stats = t.core.stats
    before = (list(stats.accesses_by_tier), stats.dc_accesses, stats.deadline_accesses)
    assert t.send(access("a", refresh=True)) == []
    assert (list(stats.accesses_by_tier), stats.dc_accesses, stats.deadline_accesses) == before
    assert t.send(access("a")) == []
    assert sum(stats.accesses_by_tier) == sum(before[0]) + 1


def test_lru_refreshes_recency_as_an_access_does() -> None:
    for refresh in (False, True):
        t = Tier("lru")
        assert t.send(alloc("a"), alloc("b"), alloc("c")) == []
        assert t.send(access("a", refresh=refresh)) == []
        assert t.order() == ["b", "c", "a"]


def test_arc_keeps_a_refreshed_t1_block_in_t1_where_an_access_promotes_it() -> None:
    """Three chunks, then a used again: accessed, a goes to T2 (arc evicts T1 first, so a
    leaves last); refreshed, it stays in T1, at its newest end."""
    accessed, refreshed = Tier("arc", 3), Tier("arc", 3)
    for t, refresh in ((accessed, False), (refreshed, True)):
        assert t.send(alloc("a"), alloc("b"), alloc("c")) == []
        assert t.send(access("a", refresh=refresh)) == []
    # Accessed: a is in T2, so b (T1's oldest) leaves first and a last.
    assert accessed.order()[-1] == "a"
    assert accessed.core.tiers[0].policy._t2.keys() == {"a"}
    # Refreshed: a stays in T1, at its newest end: b, c, then a, all in T1.
    assert refreshed.core.tiers[0].policy._t2.keys() == set()
    assert refreshed.order() == ["b", "c", "a"]
    # A later access still promotes it.
    assert refreshed.send(access("a")) == []
    assert refreshed.core.tiers[0].policy._t2.keys() == {"a"}


@pytest.mark.parametrize("policy", ["fifo", "s3fifo", "sieve", "lfu", "two_queue", "prefix_aware", "adaptive", "priority_lru"])
def test_every_other_policy_takes_a_refresh_as_an_access(policy: str) -> None:
    """Their victims after a refresh are those after an access (they do not tell the two
    apart), over a stream with evictions."""
    orders = []
    for refresh in (False, True):
        t = Tier(policy, 8)
        victims = []
        for n in range(40):
            assert t.send(alloc(f"b{n}")) == []
            if n % 3 == 0:
                assert t.send(access(f"b{n - n % 6}", refresh=refresh)) == []
            if len(t.core.tiers[0].policy) >= 8:
                t.send(evict(2))
                victims.append(t.order()[:2])
        assert len(victims) > 5
        orders.append((victims, t.order()))
    assert orders[0] == orders[1]


def test_bad_combinations_are_refused_by_field_and_change_nothing() -> None:
    t = Tier("lru")
    assert t.send(alloc("a"), alloc("b")) == []
    assert t.send(access("a", refresh=True, scope="r")) == [("accessed.refresh_only", "not with a scope (a scoped use ranks the blocks)")]
    assert t.send(access("a", refresh=True, next_use=5)) == [
        ("accessed.refresh_only", "not with next_use_us (a refresh is not a step's read)")
    ]
    assert t.send(access(refresh=True)) == [("accessed.block_ids", "empty: name at least one block")]
    assert t.order() == ["a", "b"]
    # With ends_scope, no block ids is fine (a finish with nothing resident).
    assert t.send(access(refresh=True, ends="r")) == []
    assert t.order() == ["a", "b"]
