"""Narrated scenarios of the core: tiers of 1000 / 2000 / 4000 bytes, watermarks 0.95/0.90.

HBM goes over its high watermark (950) when it would hold more than 950 bytes; it is then
brought down to the low one (900).
"""

from __future__ import annotations

import random
from collections.abc import Set as AbstractSet

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.model.core import DirectiveKind
from kvbroker.v1 import intent_pb2 as pb
from policies.base import DROPPED, Block, Policy
from tests.builders import Driver, access, ack, alloc, clear, free, release, update
from tests.conftest import small_config

DC = pb.PRIORITY_DECODE_CRITICAL


def check_model(d: Driver) -> None:
    """The tier model is consistent and never over capacity."""
    core = d.core
    for tier in core.tiers:
        members = [b for b in core.blocks.values() if b.tier == tier.index]
        assert tier.used == sum(b.size for b in members)
        assert tier.blocks == len(members)
        assert tier.used <= tier.capacity, f"{tier.name} over capacity: {tier.used} > {tier.capacity}"
        assert tier.pinned_bytes == sum(b.size for b in members if b.pinned)
        assert len(tier.policy) == sum(1 for b in members if not b.pinned)
        for b in members:
            assert (b.block_id in tier.policy) != b.pinned


def guard_pins(d: Driver) -> None:
    """Fail the test the moment a pinned block is chosen as a victim: every tier's policy
    (still empty) is replaced by a subclass that checks each choice. A subclass, not a
    patched method: the core may be compiled (broker/native.py), and a compiled core calls
    its own methods directly but a policy's through the policy's class."""
    for tier in d.core.tiers:
        assert len(tier.policy) == 0
        tier.policy = _pin_guarded(type(tier.policy))(tier.policy.ctx, tier.policy.params)


def _pin_guarded(cls: type[Policy]) -> type[Policy]:
    class PinGuarded(cls):  # type: ignore[valid-type,misc]
        def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
            victims: list[Block] | None = super().choose_victims(bytes_needed, protected)
            for victim in victims or ():
                assert not victim.pinned, f"pinned block {victim.block_id} chosen as a victim"
            return victims

    return PinGuarded


def test_lru_demotes_least_recently_used_block_when_hbm_passes_high_watermark() -> None:
    d = Driver(small_config("lru"))
    # Nine blocks fill HBM to 900: under the high watermark, nothing moves.
    out = d.send(*(alloc(f"b{i}", ts=i) for i in range(9)))
    assert out.directives == []
    # b0 is read again: it becomes the most recent.
    d.send(access("b0", ts=10))
    # b9 would bring HBM to 1000 > 950: one block must go to get back to 900: b1, the LRU.
    out = d.send(alloc("b9", ts=11))
    assert [(x.kind, x.block_id, x.from_tier, x.to_tier) for x in out.directives] == [(DirectiveKind.DEMOTE, "b1", "hbm", "dram")]
    assert d.where("b1") == "dram" and d.where("b0") == "hbm"
    check_model(d)


def test_demotion_cascades_down_and_drops_at_the_bottom() -> None:
    d = Driver(small_config("lru"))
    # 80 blocks of 100 bytes: 8000 bytes into 7000 bytes of tiers.
    for i in range(80):
        d.send(alloc(f"b{i}", ts=i))
        check_model(d)
    kinds = {x.kind for x in d.directives}
    assert kinds == {DirectiveKind.DEMOTE, DirectiveKind.EVICT}
    evicted = [x for x in d.directives if x.kind == DirectiveKind.EVICT]
    # Drops happen only from the bottom tier, oldest first.
    assert {x.from_tier for x in evicted} == {"nvme"}
    assert evicted[0].block_id == "b0"
    assert d.core.dropped_blocks() == len(evicted) >= 8
    assert d.core.stats.evictions == len(evicted)


def test_pinned_and_decode_critical_blocks_are_never_victims() -> None:
    d = Driver(small_config("lru"))
    guard_pins(d)
    # The two oldest blocks: one decode-critical, one with a pin requested.
    d.send(alloc("dc", ts=0, priority=DC), alloc("pin", ts=1, pin_requested=True))
    for i in range(60):
        d.send(alloc(f"b{i}", ts=2 + i))
    named = {x.block_id for x in d.directives}
    assert "dc" not in named and "pin" not in named
    assert d.where("dc") == "hbm" and d.where("pin") == "hbm"
    check_model(d)


def test_full_pinned_tier_refuses_an_allocation_with_resource_exhausted_and_keeps_the_rest() -> None:
    d = Driver(small_config("lru"))
    # Ten pinned blocks: HBM is full of blocks nobody may evict.
    d.send(*(alloc(f"p{i}", ts=i, pin_requested=True) for i in range(10)))
    out = d.send(alloc("x", ts=20), alloc("y", ts=21, tier="dram"))
    assert [(r.index, r.field, r.code) for r in out.rejections] == [(0, "allocated.tier", "RESOURCE_EXHAUSTED")]
    assert "full" in out.rejections[0].reason and "pinned" in out.rejections[0].reason
    # The second event of the batch still applied.
    assert d.where("y") == "dram" and "x" not in d.core.blocks
    check_model(d)


def test_access_to_a_demoted_block_counts_a_miss_and_brings_it_back_up() -> None:
    d = Driver(small_config("lru"))
    d.send(*(alloc(f"b{i}", ts=i) for i in range(10)))  # b0 demoted by the tenth
    assert d.where("b0") == "dram"
    d.send(access("b0", ts=20))
    # The engine had to load b0 to use it: it is in HBM now, served from DRAM.
    assert d.where("b0") == "hbm"
    assert d.core.stats.accesses_by_tier[:2] == [0, 1]
    assert d.core.stats.bytes_up == 100
    # Making room for it pushed the next LRU block (b1) down.
    assert d.directives[-1].block_id == "b1" and d.directives[-1].kind == DirectiveKind.DEMOTE
    check_model(d)


def test_decode_critical_miss_rate_is_per_decode_critical_access() -> None:
    d = Driver(small_config("lru"))
    d.send(*(alloc(f"b{i}", ts=i) for i in range(10)))  # b0 in DRAM, b1..b9 in HBM
    d.send(update("b0", ts=10, priority=DC), update("b5", ts=10, priority=DC))
    d.send(access("b0", "b5", ts=11))
    s = d.core.stats
    assert (s.dc_accesses, s.dc_misses) == (2, 1)
    assert s.dc_miss_rate() == 0.5


def test_release_makes_a_block_evictable_and_allocation_after_release_is_prefix_reuse() -> None:
    d = Driver(small_config("lru"))
    d.send(alloc("sys", ts=0, pin_requested=True))
    # A second allocation of a live block is a duplicate.
    out = d.send(alloc("sys", ts=1))
    assert [(r.field, r.code) for r in out.rejections] == [("allocated.intent.block_id", "ALREADY_EXISTS")]
    # Released: still cached, no longer pinned.
    d.send(release("sys", ts=2))
    assert d.core.blocks["sys"].pinned is False and d.where("sys") == "hbm"
    # A new request allocates the same content: reuse, counted as an access (a hit here).
    out = d.send(alloc("sys", ts=3, request_id="r2", pin_requested=True))
    assert out.rejections == []
    block = d.core.blocks["sys"]
    assert block.request_id == "r2" and block.pinned and d.core.stats.reuses == 1
    assert d.core.stats.accesses_by_tier[0] == 1
    check_model(d)


def test_free_returns_bytes_and_clear_drops_only_the_clients_own_blocks() -> None:
    d = Driver(small_config("lru"))
    d.send(alloc("a1", ts=0), alloc("a2", ts=0, pin_requested=True), client="engine-a")
    d.send(alloc("b1", ts=0), client="engine-b")
    d.send(free("a1", ts=1), client="engine-a")
    assert "a1" not in d.core.blocks and d.used()[0] == 200
    d.send(clear(ts=2), client="engine-a")
    assert set(d.core.blocks) == {"b1"}
    assert d.used()[0] == 100
    check_model(d)


def test_failed_ack_puts_the_block_back_where_the_client_says_it_is() -> None:
    d = Driver(small_config("lru"))
    d.send(*(alloc(f"b{i}", ts=i) for i in range(10)))
    demote = d.directives[0]
    assert (demote.block_id, demote.to_tier) == ("b0", "dram")
    # The engine could not move b0: it is still in HBM.
    out = d.send(ack(demote.directive_id, failed=True, actual="hbm", ts=20))
    assert out.rejections == []
    assert d.where("b0") == "hbm"
    assert d.core.stats.acks_failed == 1
    # The same directive cannot be acked twice; an unknown id is refused.
    out = d.send(ack(demote.directive_id, ts=21), ack(999, ts=21))
    assert [(r.index, r.field, r.code) for r in out.rejections] == [
        (0, "acked.directive_id", "FAILED_PRECONDITION"),
        (1, "acked.directive_id", "FAILED_PRECONDITION"),
    ]
    check_model(d)


def test_failed_ack_reporting_the_block_gone_drops_it_from_the_model() -> None:
    d = Driver(small_config("lru"))
    d.send(*(alloc(f"b{i}", ts=i) for i in range(10)))
    d.send(ack(d.directives[0].directive_id, failed=True, actual="", ts=20))
    assert d.core.blocks["b0"].tier == DROPPED
    check_model(d)


def test_intent_policy_prefetches_a_block_whose_deadline_comes_within_reach() -> None:
    d = Driver(small_config("priority_lru"))
    # b0 is COLD; nine HOT blocks then fill HBM, and the coldest block, b0, goes down.
    d.send(alloc("b0", ts=0, priority=pb.PRIORITY_COLD))
    d.send(*(alloc(f"h{i}", ts=1 + i, priority=pb.PRIORITY_HOT) for i in range(9)))
    assert d.where("b0") == "dram"
    # The engine says b0 is decode-critical and needed at t=300: within transfer + margin (500).
    out = d.send(update("b0", ts=100, priority=DC, deadline_us=300))
    # Room is made by demoting the least recent HOT block, which ranks below DECODE_CRITICAL.
    assert [(x.kind, x.block_id, x.from_tier, x.to_tier, x.arrive_by_us) for x in out.directives] == [
        (DirectiveKind.DEMOTE, "h0", "hbm", "dram", 0),
        (DirectiveKind.PREFETCH, "b0", "dram", "hbm", 300),
    ]
    assert d.where("b0") == "hbm"
    # The access at the deadline is a hit.
    d.send(access("b0", ts=300))
    assert (d.core.stats.dc_accesses, d.core.stats.dc_misses) == (1, 0)
    check_model(d)


def test_lru_never_prefetches() -> None:
    d = Driver(small_config("lru"))
    d.send(*(alloc(f"b{i}", ts=i) for i in range(10)))
    out = d.send(update("b0", ts=100, priority=DC, deadline_us=300))
    assert [x for x in out.directives if x.kind == DirectiveKind.PREFETCH] == []
    assert d.where("b0") == "dram"


def test_event_time_only_moves_forward() -> None:
    d = Driver(small_config("lru"))
    d.send(alloc("a", ts=500))
    d.send(alloc("b", ts=100))  # another client's clock may lag: time does not go back
    assert d.core.clock.now_us == 500
    assert d.core.blocks["b"].created_us == 500


# ---- random streams ------------------------------------------------------------------------

_ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "alloc", "alloc", "access", "update", "release", "free", "ack"]),
        st.integers(0, 40),  # block number
        st.sampled_from([50, 100, 150, 300]),  # size
        st.sampled_from([0, 1, 2, 3, 4]),  # priority
        st.booleans(),  # pin
    ),
    min_size=1,
    max_size=120,
)


def _run(policy: str, ops: list[tuple[str, int, int, int, bool]]) -> Driver:
    d = Driver(small_config(policy))
    guard_pins(d)
    for ts, (op, n, size, priority, pin) in enumerate(ops):
        bid = f"b{n}"
        if op == "alloc":
            event = alloc(bid, size=size, ts=ts, priority=priority, pin_requested=pin, deadline_us=ts + 400)
        elif op == "access":
            event = access(bid, ts=ts)
        elif op == "update":
            event = update(bid, ts=ts, priority=priority, pin_requested=pin, deadline_us=ts + 100)
        elif op == "release":
            event = release(bid, ts=ts)
        elif op == "free":
            event = free(bid, ts=ts)
        else:
            event = ack(d.directives[n % len(d.directives)].directive_id if d.directives else 1, ts=ts)
        d.send(event)
        check_model(d)
    return d


@settings(max_examples=60, deadline=None)
@given(_ops, st.sampled_from(["lru", "priority_lru"]))
def test_random_streams_keep_the_model_consistent_and_pins_safe(ops: list[tuple[str, int, int, int, bool]], policy: str) -> None:
    _run(policy, ops)


@settings(max_examples=25, deadline=None)
@given(_ops, st.sampled_from(["lru", "priority_lru"]))
def test_the_same_stream_gives_the_same_directives(ops: list[tuple[str, int, int, int, bool]], policy: str) -> None:
    first = [x.key() for x in _run(policy, ops).directives]
    second = [x.key() for x in _run(policy, ops).directives]
    assert first == second


def test_a_shared_block_needs_every_reference_released_before_it_is_evictable() -> None:
    d = Driver(small_config("lru"))
    d.send(alloc("sys", ts=0, request_id="r1", pin_requested=True))
    # A second request with the same prefix takes another reference: a prefix hit.
    out = d.send(alloc("sys", ts=1, request_id="r2", priority=DC, reuse=True))
    assert out.rejections == []
    block = d.core.blocks["sys"]
    assert block.refs == 2 and block.priority == DC  # the most demanding intent wins
    s = d.core.stats
    assert (s.prompt_blocks, s.prefix_hits_top, s.prefix_hits_any) == (2, 1, 1)
    d.send(release("sys", ts=2))
    assert block.pinned and not block.released  # r2 still holds it
    d.send(release("sys", ts=3))
    assert block.released and not block.pinned and "sys" in d.core.tiers[0].policy
    check_model(d)


def test_an_access_can_carry_the_next_deadline_of_its_blocks() -> None:
    d = Driver(small_config("priority_lru"))
    d.send(alloc("a", ts=0), alloc("b", ts=0))
    d.send(pb.Event(ts_us=10, accessed=pb.BlocksAccessed(block_ids=["a", "b"], next_use_us=1_010)))
    assert d.core.blocks["a"].deadline_us == 1_010 and d.core.blocks["b"].deadline_us == 1_010
    out = d.send(pb.Event(ts_us=11, accessed=pb.BlocksAccessed(block_ids=["a"], next_use_us=-1)))
    assert out.rejections[0].field == "accessed.next_use_us"


def test_prefix_hit_rate_counts_prompt_blocks_found_in_the_top_tier_and_in_any_tier() -> None:
    d = Driver(small_config("lru"))
    # Request 1 brings p0..p9 (all new), then releases them; p0 was pushed down to DRAM.
    d.send(*(alloc(f"p{i}", ts=i) for i in range(10)), release(*(f"p{i}" for i in range(10)), ts=10))
    assert d.where("p0") == "dram"
    # Request 2 brings p0 (in DRAM), p9 (in HBM) and q (new).
    d.send(alloc("p0", ts=20), alloc("p9", ts=20), alloc("q", ts=20))
    s = d.core.stats
    assert s.prompt_blocks == 13
    assert (s.prefix_hits_top, s.prefix_hits_any) == (1, 2)
    assert s.prefix_hit_rate() == 1 / 13


def test_a_policy_can_prefer_dropping_a_victim_to_demoting_it() -> None:
    from broker.config import parse_config

    config = parse_config(
        '[policy]\nname = "deadline_edf"\n'
        "[[tiers]]\nname = 'hbm'\ncapacity = 1000\n"
        "[[tiers]]\nname = 'dram'\ncapacity = 2000\nread_latency_us = 10.0\n"
    )
    d = Driver(config)
    # b0 is cheap to recompute (1 µs); a DRAM reload costs 10 µs: it is dropped, not demoted.
    d.send(alloc("b0", ts=0, recompute_cost_us=1), *(alloc(f"b{i}", ts=i, recompute_cost_us=10**6) for i in range(1, 10)))
    first = d.directives[0]
    assert (first.block_id, first.kind, first.reason) == ("b0", DirectiveKind.EVICT, "recompute cheaper than reload")
    assert d.core.blocks["b0"].tier == DROPPED
    check_model(d)


def test_request_blocks_follow_allocations_frees_and_prefix_reuse_across_requests() -> None:
    """by_request keeps ids lazily (core.RequestBlocks): what request_blocks returns is still
    exactly the request's live blocks, by id, and each list stays within twice them."""
    rng = random.Random(3)
    d = Driver(small_config("lru"))
    requests = ("r0", "r1", "r2", "")
    for ts in range(3000):
        bid, rid = f"b{rng.randrange(40)}", rng.choice(requests)
        roll = rng.random()
        block = d.core.blocks.get(bid)
        if roll < 0.5:
            # A new block, or, when it is cached, a prefix reuse that may move it to another request.
            event = alloc(bid, size=10, ts=ts, request_id=rid)
        elif roll < 0.75:
            event = release(bid, ts=ts)
        elif roll < 0.98:
            event = free(bid, ts=ts)
        else:
            event = clear(ts=ts)
        if block is not None or roll < 0.5 or roll >= 0.98:
            d.send(event)
        live = {r: sorted(b.block_id for b in d.core.blocks.values() if b.request_id == r) for r in requests if r}
        for r, ids in live.items():
            assert [b.block_id for b in d.core.request_blocks(r)] == ids
        assert set(d.core.by_request) == {r for r, ids in live.items() if ids}
        for r, entry in d.core.by_request.items():
            assert entry.live == len(live[r]) and len(entry.ids) <= 2 * entry.live


def test_an_event_error_survives_pickling_with_its_field_reason_and_code() -> None:
    """A replay worker's error reaches the parent process whole (compiled or not)."""
    import pickle

    from broker.model.core import EventError

    back = pickle.loads(pickle.dumps(EventError("accessed.block_ids[0]", "unknown block 'x'", "FAILED_PRECONDITION")))
    assert isinstance(back, EventError)
    assert (back.field, back.reason, back.code, str(back)) == (
        "accessed.block_ids[0]",
        "unknown block 'x'",
        "FAILED_PRECONDITION",
        "accessed.block_ids[0]: unknown block 'x'",
    )
