"""EvictionRequested: an engine's tier needs room now (vLLM's CachePolicy.evict). The policy
names exactly ``count`` victims, none protected, dropped with EVICT directives; when it
cannot, nothing changes and the event is rejected on ``count`` saying how many could be.

Tiers of 1000 / 2000 / 4000 bytes (tests.conftest.small_config); blocks of 100 bytes fit
nine in HBM under its 950-byte high watermark."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.model.core import Core, DirectiveKind
from kvbroker.v1 import intent_pb2 as pb
from policies.base import DROPPED
from tests.broker.model.test_core import check_model
from tests.builders import Driver, access, alloc, evict_request, free, update
from tests.conftest import small_config


def filled(policy: str = "lru", n: int = 5, size: int = 100) -> Driver:
    d = Driver(small_config(policy))
    d.send(*(alloc(f"b{i}", size=size, ts=i) for i in range(n)))
    return d


def test_the_policy_chooses_exactly_count_victims_skipping_protected_and_they_are_dropped() -> None:
    d = filled()
    d.send(access("b0", ts=10))  # b0 becomes the most recent: order b1 b2 b3 b4 b0
    out = d.send(evict_request(2, "b1", "not-a-block", ts=11))
    assert out.rejections == [] and out.accepted == 1
    assert [(x.kind, x.block_id, x.from_tier, x.to_tier) for x in out.directives] == [
        (DirectiveKind.EVICT, "b2", "hbm", ""),
        (DirectiveKind.EVICT, "b3", "hbm", ""),
    ]
    assert all(x.reason == "eviction requested by the engine" for x in out.directives)
    assert d.where("b2") == d.where("b3") == "" and d.core.blocks["b2"].tier == DROPPED
    assert d.used()[0] == 300 and d.used()[1] == 0  # dropped, never demoted
    assert d.core.stats.events["eviction_requested"] == 1 and d.core.stats.evictions == 2
    check_model(d)


def test_all_or_nothing_the_event_is_rejected_on_count_with_how_many_could_be() -> None:
    d = filled()
    d.send(update("b4", ts=5, pin_requested=True))  # pinned: never a victim
    before = (d.used(), sorted(d.core.blocks), d.core.clock.now_us)
    out = d.send(evict_request(3, "b0", "b1", ts=50))
    assert out.directives == [] and len(out.rejections) == 1
    rejection = out.rejections[0]
    assert (rejection.field, rejection.code) == ("eviction_requested.count", "RESOURCE_EXHAUSTED")
    assert "only 2 can be chosen" in rejection.reason and "nothing was evicted" in rejection.reason
    assert (d.used(), sorted(d.core.blocks), d.core.clock.now_us) == before  # time did not move either
    assert d.core.stats.evictions == 0
    # Exactly what can be chosen is granted.
    out = d.send(evict_request(2, "b0", "b1", ts=51))
    assert [x.block_id for x in out.directives] == ["b2", "b3"]


def test_count_zero_changes_nothing_and_an_unknown_tier_is_refused() -> None:
    d = filled()
    out = d.send(evict_request(0, ts=1), evict_request(1, tier="tape", ts=2), evict_request(1, tier="dram", ts=3))
    assert out.directives == []
    assert [(r.index, r.field) for r in out.rejections] == [(1, "eviction_requested.tier"), (2, "eviction_requested.count")]
    assert "unknown tier 'tape'" in out.rejections[0].reason
    assert "only 0 can be chosen" in out.rejections[1].reason  # dram holds nothing


def test_with_unequal_sizes_the_victims_are_the_first_count_of_the_policy_order() -> None:
    d = Driver(small_config("lru"))
    d.send(alloc("big", size=300, ts=0), alloc("mid", size=200, ts=1), alloc("small", size=50, ts=2), alloc("last", size=10, ts=3))
    out = d.send(evict_request(2, ts=4))
    assert [x.block_id for x in out.directives] == ["big", "mid"]
    check_model(d)


def test_a_tenant_batch_cannot_evict_another_tenants_blocks() -> None:
    core = Core(small_config("lru").core)
    from broker.model.apply import apply_batch

    def send(tenant: str, seq: int, *events: pb.Event) -> object:
        return apply_batch(core, pb.IntentBatch(client_id="e", batch_seq=seq, tenant=tenant, events=events))

    send("a", 1, alloc("a1", ts=1))
    send("b", 1, alloc("b1", ts=2))
    out = send("b", 2, evict_request(1, ts=3))  # lru's victim is a1, tenant a's
    assert [(r.field, r.code) for r in out.rejections] == [("eviction_requested.count", "PERMISSION_DENIED")]  # type: ignore[attr-defined]
    assert core.blocks["a1"].tier == 0
    out = send("a", 2, evict_request(1, ts=4))
    assert [x.block_id for x in out.directives] == ["a1"]  # type: ignore[attr-defined]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["lru", "arc", "s3fifo", "fifo", "sieve", "lfu", "priority_lru", "two_queue"]), st.integers(0, 2**32 - 1))
def test_any_policy_protected_never_chosen_and_rejections_change_nothing(policy: str, seed: int) -> None:
    """A random stream of allocations, accesses, frees and eviction requests (one-byte-unit
    blocks of 10 bytes): a granted request names exactly ``count`` distinct unprotected
    blocks of the tier, a refused one changes nothing, the model stays consistent."""
    rng = random.Random(seed)
    d = Driver(small_config(policy))
    live: list[str] = []
    for step in range(120):
        ts = step + 1
        roll = rng.random()
        hbm = [b for b in live if d.core.blocks[b].tier == 0]
        if roll < 0.45 and len(hbm) < 90:
            name = f"k{step}"
            d.send(alloc(name, size=10, ts=ts))
            live.append(name)
        elif roll < 0.65 and hbm:
            d.send(access(*rng.sample(hbm, min(len(hbm), 3)), ts=ts))
        elif roll < 0.75 and live:
            gone = live.pop(rng.randrange(len(live)))
            d.send(free(gone, ts=ts))
        else:
            protected = rng.sample(hbm, min(len(hbm), rng.randint(0, 5)))
            count = rng.randint(0, 8)
            before = (d.used(), {b: d.core.blocks[b].tier for b in live})
            out = d.send(evict_request(count, *protected, ts=ts))
            if out.rejections:
                assert out.directives == [] and before == (d.used(), {b: d.core.blocks[b].tier for b in live})
                assert len(hbm) - len(protected) < count
            else:
                victims = [x.block_id for x in out.directives]
                assert len(victims) == len(set(victims)) == count
                assert not set(victims) & set(protected) and set(victims) <= set(hbm)
                assert all(d.core.blocks[v].tier == DROPPED for v in victims)
        check_model(d)
