"""deadline_edf: narrated scenarios of its order and its prefetch rule, a model check as the
clock moves, and three runs through the real core.

Unless a test says otherwise the policy serves HBM above a DRAM tier that reads at 2 us +
25,000 B/us, so a 2 MB block takes 82 us to come back (a 1 MB block 42 us), and the
default parameters hold: guard_us 500, stale_after_us 10,000, default_recompute_us 4,000.
A block is NEAR (protected) once ``now >= deadline - reload - guard``.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.config import parse_config
from broker.model.core import DirectiveKind
from kvbroker.v1 import intent_pb2 as pb
from policies.base import Block, Clock, PolicyContext, PolicyError, Priority, TierInfo
from policies.deadline_edf import DeadlineEDFParams, DeadlineEDFPolicy
from policies.priority_lru import PriorityLRUPolicy
from policies.registry import make_params, policy_class
from tests.builders import Driver, access, alloc, release, update
from tests.conftest import small_config

MB = 1_000_000
HBM = TierInfo(0, "hbm", 100 * MB, 0.0, 2_000_000.0)
DRAM = TierInfo(1, "dram", 400 * MB, 2.0, 25_000.0)


class Tier:
    """One tier driven directly, stamping blocks the way the core does."""

    def __init__(self, tiers: tuple[TierInfo, ...] = (HBM, DRAM), index: int = 0, **params: Any) -> None:
        self.clock = Clock()
        self.policy = DeadlineEDFPolicy(PolicyContext(tiers[index], tiers, self.clock), DeadlineEDFParams(**params))
        self.blocks: dict[str, Block] = {}

    def at(self, now_us: int) -> Tier:
        self.clock.now_us = now_us
        return self

    def insert(self, block_id: str, size: int = 2 * MB, **intent: Any) -> Block:
        block = make_block(block_id, self.clock.now_us, size, **intent)
        self.blocks[block_id] = block
        self.policy.insert(block)
        return block

    def read(self, block_id: str) -> None:
        block = self.blocks[block_id]
        block.accesses += 1
        block.last_access_us = self.clock.now_us
        self.policy.access(block)

    def update(self, block_id: str, **intent: Any) -> None:
        block = self.blocks[block_id]
        for name, value in intent.items():
            setattr(block, name, value)
        self.policy.update(block)

    def victims(self, bytes_needed: int, protected: frozenset[str] = frozenset()) -> list[str]:
        chosen = self.policy.choose_victims(bytes_needed, protected)
        assert chosen is not None
        return [b.block_id for b in chosen]

    def order(self) -> list[str]:
        return self.victims(sum(b.size for b in self.blocks.values()))

    def near(self) -> list[str]:
        return sorted(b for b, block in self.blocks.items() if self.policy.is_near(block))


def make_block(block_id: str, now_us: int, size: int = 2 * MB, **intent: Any) -> Block:
    block = Block(block_id, size)
    block.created_us = block.last_access_us = now_us
    for name, value in intent.items():
        setattr(block, name, value)
    return block


# ---- the order -----------------------------------------------------------------------------


def test_a_block_needed_before_it_could_come_back_survives_until_its_deadline_is_stale() -> None:
    tier = Tier()
    # t = 0: "soon" is needed at t = 1000; back from DRAM in 82 us, so its latest start is
    # 918 and it becomes near at 418 (guard 500). Then two blocks without a deadline.
    tier.at(0).insert("soon", priority=Priority.WARM, deadline_us=1_000)
    tier.at(100).insert("old", priority=Priority.WARM)
    tier.at(200).insert("new", priority=Priority.WARM)
    # t = 300: the deadline is far, so soon is not protected; but within its class a block
    # with a pending deadline stays over blocks without one: old, new, then soon.
    tier.at(300)
    assert tier.near() == [] and tier.order() == ["old", "new", "soon"]
    # t = 950: soon is needed in 50 us, less than its 82 us reload: the older LRU block
    # without a deadline leaves instead, and soon goes last.
    tier.at(950)
    assert tier.near() == ["soon"]
    assert tier.victims(1) == ["old"]
    assert tier.order() == ["old", "new", "soon"]
    # t = 1000 and up to 10 ms after: a deadline just passed is still near (the step is late).
    tier.at(11_000)
    assert tier.order() == ["old", "new", "soon"]
    # t = 11,001: passed by more than stale_after_us: soon is no longer protected (no
    # event touched it; the clock alone moved it), but it was never read: a promise not yet
    # kept, it still ranks by its deadline in the free order, after the undated blocks.
    tier.at(11_001)
    assert tier.near() == [] and tier.order() == ["old", "new", "soon"]
    # Read at last (at or after its deadline), it is an ordinary block, the most recent.
    tier.at(11_002).read("soon")
    tier.at(11_003).read("new")
    assert tier.order() == ["old", "soon", "new"]


def test_the_protection_boundary_is_the_reload_time_plus_the_guard() -> None:
    tier = Tier(guard_us=0, stale_after_us=0)
    # Needed at t = 1000; 2 MB reloads in 82 us, 1 MB in 42 us: latest starts 918 and 958.
    tier.at(0).insert("big", deadline_us=1_000)
    tier.insert("small", size=MB, deadline_us=1_000)
    tier.insert("plain")
    assert tier.at(917).near() == []
    # t = 918: big is needed in 82 us, what it would take to come back: protected.
    assert tier.at(918).near() == ["big"]
    # Free: plain (no deadline) before small (a pending one); then the near big.
    assert tier.order() == ["plain", "small", "big"]
    assert tier.at(958).near() == ["big", "small"]
    # Both near: the latest start leaves first (small: late by 0 us if evicted now, big by 40).
    assert tier.order() == ["plain", "small", "big"]
    # stale_after_us 0: once the deadline has passed, neither is protected; unread, both
    # still rank by their (equal) deadline over plain, then by recency.
    assert tier.at(1_000).near() == ["big", "small"]
    assert tier.at(1_001).near() == []
    assert tier.order() == ["plain", "big", "small"]


def test_free_blocks_leave_by_class_then_deadline_then_request_priority_then_recency() -> None:
    tier = Tier()
    tier.at(0).insert("x", priority=Priority.HOT)
    tier.at(1).insert("y", priority=Priority.COLD)
    tier.at(2).insert("z", priority=Priority.WARM, request_priority=90)
    tier.at(3).insert("w", priority=Priority.WARM, request_priority=10)
    # A COLD block needed in a second: far, not protected; COLD leaves first, and within
    # it the undated y before far, which has a pending deadline.
    tier.at(4).insert("far", priority=Priority.COLD, deadline_us=1_000_004)
    # UNSPECIFIED counts as WARM (priority_lru's classes), request priority 50 by default.
    tier.at(5).insert("u")
    assert tier.order() == ["y", "far", "w", "u", "z", "x"]
    # A read makes y the most recent COLD block. z becomes COLD: undated, it leaves before
    # far; with request priority 90 after y (50); at 50 it keeps its recency (its insert
    # at t = 2, before y's read): an intent change is not a use.
    tier.at(6).read("y")
    tier.update("z", priority=Priority.COLD)
    assert tier.order() == ["y", "z", "far", "w", "u", "x"]
    tier.update("z", request_priority=50)
    assert tier.order() == ["z", "y", "far", "w", "u", "x"]


def test_a_released_block_leaves_before_any_block_a_request_holds() -> None:
    """Released (cached, no request holds it): below every class, whatever its label said.
    Among released blocks the usual order holds; a reuse makes a block ordinary again."""
    tier = Tier()
    tier.at(0).insert("done-hot", priority=Priority.HOT, request_priority=90)
    tier.at(1).insert("done-warm", priority=Priority.WARM)
    tier.at(2).insert("running-cold", priority=Priority.COLD)
    tier.at(3).insert("running-warm", priority=Priority.WARM, request_priority=10)
    assert tier.order() == ["running-cold", "running-warm", "done-warm", "done-hot"]
    # The two finished requests release their blocks (the core sets released and tells
    # the policy with update): both now leave before the COLD block a request still reads,
    # the WARM one first (class, then request priority, then recency, among released).
    tier.at(4).update("done-hot", released=True)
    tier.update("done-warm", released=True)
    assert tier.order() == ["done-warm", "done-hot", "running-cold", "running-warm"]
    # A new request brings done-hot again (a prefix hit): referenced, HOT, most recent.
    tier.blocks["done-hot"].released = False
    tier.at(5).read("done-hot")
    assert tier.order() == ["done-warm", "running-cold", "running-warm", "done-hot"]


def test_near_blocks_go_last_latest_start_first_and_protected_ids_are_stepped_over() -> None:
    tier = Tier()
    # a: 2 MB needed at 1000 (latest start 918); b: 1 MB needed at 1000 (958);
    # c: 2 MB needed at 1100 (1018); f: 1 MB, no deadline, the most recent.
    tier.at(0).insert("a", deadline_us=1_000)
    tier.insert("b", size=MB, deadline_us=1_000)
    tier.insert("c", deadline_us=1_100)
    tier.at(10).insert("f", size=MB)
    tier.at(990)
    assert tier.near() == ["a", "b", "c"]
    assert tier.order() == ["f", "c", "b", "a"]
    # 3 MB while the core protects c: f (1 MB), b (1 MB), then a (2 MB).
    assert tier.victims(3 * MB, frozenset({"c"})) == ["f", "b", "a"]
    # Asking changed nothing.
    assert tier.order() == ["f", "c", "b", "a"]


def test_an_intent_update_rekeys_and_a_cleared_deadline_makes_a_block_ordinary() -> None:
    tier = Tier()
    tier.at(0).insert("p", deadline_us=500)
    tier.at(1).insert("q")
    assert tier.near() == ["p"] and tier.order() == ["q", "p"]
    # The engine postpones p to t = 5000: far again, not protected, but a pending deadline
    # still keeps it over q, which has none.
    tier.at(2).update("p", deadline_us=5_000)
    assert tier.order() == ["q", "p"]
    # ... then brings it forward to t = 300, then clears it.
    tier.at(3).update("p", deadline_us=300)
    assert tier.order() == ["q", "p"]
    tier.update("p", deadline_us=None)
    assert tier.order() == ["p", "q"]
    # Removing, and removing what is not held.
    tier.policy.remove(tier.blocks.pop("p"))
    assert tier.order() == ["q"] and "p" not in tier.policy and len(tier.policy) == 1
    with pytest.raises(PolicyError):
        tier.policy.remove(make_block("p", 0))


@pytest.mark.parametrize(
    ("change", "order", "near"),
    [
        # undated -> near (a share's or a reuse's deadline): protected, last
        ({"deadline_us": 300}, ["a", "b", "d", "c"], ["c"]),
        # a lower class, released (below every class), a lower request priority: first
        ({"priority": Priority.COLD}, ["c", "a", "b", "d"], []),
        ({"released": True}, ["c", "a", "b", "d"], []),
        ({"request_priority": 10}, ["c", "a", "b", "d"], []),
        # higher: the most recent of the class above (the lazy path keeps a placeholder)
        ({"priority": Priority.HOT, "request_priority": 90}, ["a", "b", "d", "c"], []),
        # nothing changed: the most recent WARM block
        ({}, ["a", "b", "d", "c"], []),
    ],
)
@pytest.mark.parametrize("lazy", [True, False])
def test_a_read_after_fields_changed_orders_the_block_by_its_fields_now(
    change: dict[str, Any], order: list[str], near: list[str], lazy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The core changes a block's fields and then reads it, with no update between (a
    share or a reuse, core._touch): the read must re-key it. The lazy path skips keying a
    read block whose entry can stay as its placeholder, so this checks that it sees the
    changed fields; the eager path is the reference."""
    monkeypatch.setattr(DeadlineEDFPolicy, "lazy", lazy)
    tier = Tier()
    for i, name in enumerate(["a", "b", "c", "d"]):
        tier.at(i).insert(name, priority=Priority.WARM)
    assert tier.order() == ["a", "b", "c", "d"]  # read once: every block filed
    block = tier.blocks["c"]
    for name, value in change.items():
        setattr(block, name, value)
    tier.at(10).read("c")
    assert tier.order() == order and tier.near() == near


def test_in_the_bottom_tier_the_reload_time_is_the_recompute_cost() -> None:
    # The policy serves DRAM, the last tier: a dropped block must be recomputed.
    tier = Tier(index=1, guard_us=0)
    tier.at(0).insert("given", recompute_cost_us=300, deadline_us=1_000)
    tier.insert("default", deadline_us=5_000)  # default_recompute_us 4000: latest start 1000
    tier.insert("plain")
    assert tier.at(699).near() == []
    assert tier.at(700).near() == ["given"]
    assert tier.at(1_000).near() == ["default", "given"]
    assert tier.order() == ["plain", "default", "given"]


# ---- prefetch admission and drop versus demote --------------------------------------------


def test_prefetch_is_admitted_over_deadline_free_victims_but_not_over_an_earlier_deadline() -> None:
    tier = Tier()
    tier.at(0).insert("free", priority=Priority.WARM)
    tier.insert("hot", priority=Priority.HOT)
    tier.insert("earlier", priority=Priority.WARM, deadline_us=1_100)  # latest start 1018
    tier.insert("later", priority=Priority.WARM, deadline_us=1_400)  # latest start 1318
    tier.insert("far", priority=Priority.WARM, deadline_us=9_000)  # far at t = 1000
    tier.at(1_000)
    b = tier.blocks

    def cand(**intent: Any) -> Block:
        # A 2 MB WARM block in DRAM: its load takes 82 us, so needed at 1200 it must
        # start by 1118.
        block = make_block("cand", 0, **{"priority": Priority.WARM, "deadline_us": 1_200, **intent})
        block.tier = 1
        return block

    admit = tier.policy.admit_prefetch
    assert admit(cand(), [b["free"]]) is True
    assert admit(cand(), [b["free"], b["later"], b["far"]]) is True
    # earlier must start by 1018, before the candidate: it stays.
    assert admit(cand(), [b["free"], b["earlier"]]) is False
    # Never over a higher class; a HOT or DECODE_CRITICAL candidate may go over it.
    assert admit(cand(), [b["hot"]]) is False
    assert admit(cand(priority=Priority.HOT), [b["hot"]]) is True
    assert admit(cand(priority=Priority.DECODE_CRITICAL), [b["hot"], b["free"]]) is True
    # No deadline, or one already passed: nothing to prefetch for.
    assert admit(cand(deadline_us=None), [b["free"]]) is False
    assert admit(cand(deadline_us=999), [b["free"]]) is False
    # A victim whose deadline went stale counts as having none.
    tier.at(11_200)
    assert admit(cand(deadline_us=11_300), [b["earlier"]]) is True


def test_prefer_drop_when_recompute_is_cheaper_than_the_reload() -> None:
    tier = Tier()
    # A 2 MB block comes back from DRAM in 82 us.
    assert tier.policy.prefer_drop(make_block("x", 0, recompute_cost_us=30)) is True
    assert tier.policy.prefer_drop(make_block("x", 0, recompute_cost_us=82)) is False
    assert tier.policy.prefer_drop(make_block("x", 0)) is False  # default 4000 us
    assert tier.policy.prefer_drop(make_block("x", 0, size=MB, recompute_cost_us=41)) is True
    # Below the bottom tier there is nowhere to demote to: dropping is the only way.
    assert Tier(index=1).policy.prefer_drop(make_block("x", 0, recompute_cost_us=10**9)) is True


def test_params_are_validated_and_named() -> None:
    with pytest.raises(ValueError, match="stale_after_us"):
        DeadlineEDFParams(stale_after_us=-1)
    with pytest.raises(ValueError, match="guard_us"):
        DeadlineEDFParams(guard_us=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="default_recompute_us"):
        DeadlineEDFParams(default_recompute_us=True)
    cls = policy_class("deadline_edf")
    assert cls is DeadlineEDFPolicy
    assert make_params(cls, {"guard_us": 1000}) == DeadlineEDFParams(guard_us=1000)
    with pytest.raises(PolicyError, match="guard_us"):
        make_params(cls, {"guard_us": -5})


# ---- the order against a model, as the clock moves ----------------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 9), st.sampled_from([MB, 2 * MB]), st.sampled_from([None, 0, 300, 900, 2_000])),
        st.tuples(st.just("read"), st.integers(0, 9)),
        st.tuples(st.just("update"), st.integers(0, 9), st.sampled_from([None, 100, 600, 5_000]), st.integers(0, 4)),
        st.tuples(st.just("remove"), st.integers(0, 9)),
        st.tuples(st.just("tick"), st.sampled_from([1, 50, 400, 3_000])),
    ),
    max_size=60,
)


def model_order(tier: Tier, stamps: dict[str, int]) -> list[str]:
    """The order recomputed from scratch at the current time: free blocks by (class rank,
    pending deadline (none first, then the latest), request priority, stamp), then near
    ones by latest start, latest first."""
    now, p = tier.clock.now_us, tier.policy.params
    free, near = [], []
    for block_id, block in tier.blocks.items():
        d = block.deadline_us
        start = None if d is None else d - DRAM.transfer_us(block.size)
        if d is None or start is None or now - d > p.stale_after_us or now < start - p.guard_us:
            rank, request_priority = PriorityLRUPolicy.key(block)
            pending = d is not None and block.last_access_us < d
            free.append((rank, (1, -d) if pending else (0, 0), request_priority, stamps[block_id], block_id))
        else:
            near.append((start, -stamps[block_id], block_id))
    return [k[-1] for k in sorted(free)] + [k[-1] for k in sorted(near, reverse=True)]


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_the_order_matches_a_rescan_at_every_time(ops: list[tuple[Any, ...]]) -> None:
    tier = Tier(stale_after_us=1_000)
    stamps: dict[str, int] = {}
    stamp = 0
    for op in ops:
        block_id = f"b{op[1]}" if op[0] != "tick" else ""
        if op[0] == "tick":
            tier.at(tier.clock.now_us + op[1])
        elif op[0] == "insert" and block_id not in tier.blocks:
            deadline = None if op[3] is None else tier.clock.now_us + op[3]
            tier.insert(block_id, op[2], deadline_us=deadline)
            stamps[block_id], stamp = stamp, stamp + 1
        elif op[0] == "read" and block_id in tier.blocks:
            tier.read(block_id)
            stamps[block_id], stamp = stamp, stamp + 1
        elif op[0] == "update" and block_id in tier.blocks:
            deadline = None if op[2] is None else tier.clock.now_us + op[2]
            tier.update(block_id, deadline_us=deadline, priority=op[3])
        elif op[0] == "remove" and block_id in tier.blocks:
            tier.policy.remove(tier.blocks.pop(block_id))
        assert tier.order() == model_order(tier, stamps)
        assert len(tier.policy) == len(tier.blocks)


# ---- through the real core -------------------------------------------------------------------


def test_core_demotes_the_next_lru_block_instead_of_one_needed_soon() -> None:
    # small_config: HBM 1000 B (high 950, low 900), DRAM 2000 B, 25 GB/s: a 100 B block
    # reloads in 0.004 us, so with the 500 us guard a block is near 500.004 us ahead.
    for policy, expected in (("lru", "b0"), ("deadline_edf", "b1")):
        d = Driver(small_config(policy))
        # b0, needed at t = 1000, then b1..b8: HBM holds 900 bytes.
        d.send(alloc("b0", ts=0, deadline_us=1_000), *(alloc(f"b{i}", ts=i) for i in range(1, 9)))
        # t = 600: b9 takes HBM over the high watermark: one block must go down. LRU picks
        # b0, the oldest; deadline_edf sees b0 needed in 400 us and takes b1.
        out = d.send(alloc("b9", ts=600))
        assert [(x.kind, x.block_id, x.to_tier) for x in out.directives] == [(DirectiveKind.DEMOTE, expected, "dram")]
    # t = 11,001: b0's deadline passed more than 10 ms ago: no longer protected, but never
    # read, so still kept over the blocks without a deadline: b2, the oldest of those, goes.
    out = d.send(alloc("b10", ts=11_001))
    assert [(x.kind, x.block_id) for x in out.directives] == [(DirectiveKind.DEMOTE, "b2")]
    # Once read, b0 is ordinary: the next block to go is the least recent, b3.
    out = d.send(access("b0", ts=11_002), alloc("b11", ts=11_003))
    assert [(x.kind, x.block_id) for x in out.directives] == [(DirectiveKind.DEMOTE, "b3")]


def test_core_demotes_a_finished_requests_cached_block_not_a_running_requests() -> None:
    """A finished HOT request's released blocks and a running WARM request's blocks share
    HBM; a new block needs room. priority_lru, the labels-only baseline, demotes the running
    request's block (WARM < HOT) and the next decode step must read it back; deadline_edf
    demotes the released one. (The bench workload with released prompts: deadline_edf
    thrashed at a 0.60 hit rate before this rule, as priority_lru still does.)"""
    for policy, expected in (("priority_lru", "run0"), ("deadline_edf", "done0")):
        d = Driver(small_config(policy))
        d.send(*(alloc(f"done{i}", ts=i, priority=pb.PRIORITY_HOT, request_id="r1") for i in range(4)))
        d.send(
            *(alloc(f"run{i}", ts=10 + i, priority=pb.PRIORITY_WARM, request_id="r2") for i in range(5)),
            release(*(f"done{i}" for i in range(4)), ts=20),
        )
        out = d.send(alloc("run5", ts=30, priority=pb.PRIORITY_WARM, request_id="r2"))
        assert [(x.kind, x.block_id, x.to_tier) for x in out.directives] == [(DirectiveKind.DEMOTE, expected, "dram")], policy


def test_core_prefetches_over_a_block_of_the_same_class_that_priority_lru_would_keep() -> None:
    for policy in ("priority_lru", "deadline_edf"):
        d = Driver(small_config(policy))
        # Nine HOT blocks fill HBM to 900; x, HOT too, sits in DRAM and is needed at t = 2000.
        d.send(*(alloc(f"b{i}", ts=0, priority=pb.PRIORITY_HOT) for i in range(9)))
        d.send(alloc("x", ts=0, tier="dram", priority=pb.PRIORITY_HOT, deadline_us=2_000))
        # t = 1500: x's deadline is within transfer + the 500 us margin: the core proposes
        # it, which needs b0 (the LRU block, no deadline) to go down.
        out = d.send(access("b8", ts=1_500))
        moves = [(x.kind, x.block_id, x.from_tier, x.to_tier, x.arrive_by_us) for x in out.directives]
        if policy == "priority_lru":
            # priority_lru prefetches only over a strictly lower (class, request priority).
            assert moves == [] and d.where("x") == "dram"
        else:
            # deadline_edf: b0 has no deadline, and is not in a higher class: admitted.
            assert moves == [
                (DirectiveKind.DEMOTE, "b0", "hbm", "dram", 0),
                (DirectiveKind.PREFETCH, "x", "dram", "hbm", 2_000),
            ]
            assert d.where("x") == "hbm"


CYCLIC = """
[broker]
listen = "127.0.0.1:0"
[policy]
name = "{policy}"
{params}
[prefetch]
margin_us = 1000
[[tiers]]
name = "hbm"
capacity = "10MB"
bandwidth_gb_per_s = 2000.0
[[tiers]]
name = "dram"
capacity = "40MB"
read_latency_us = 2.0
bandwidth_gb_per_s = 25.0
[[tiers]]
name = "nvme"
capacity = "1GB"
read_latency_us = 80.0
bandwidth_gb_per_s = 6.0
"""
STEP_US = 1_000


def cyclic_decode(policy: str, params: str = "") -> Driver:
    """Four requests of three 1 MB blocks decode in round robin, one request per 1 ms step,
    on an HBM that holds nine blocks (high watermark 9.5 MB) above DRAM (42 us a block).

    The engine announces each block's next use with its read (next_use_us: four steps on);
    the request it runs is DECODE_CRITICAL for its step and HOT otherwise, like all others.
    """
    d = Driver(parse_config(CYCLIC.format(policy=policy, params=params)))
    requests = [[f"r{r}b{k}" for k in range(3)] for r in range(4)]
    hot, dc = pb.PRIORITY_HOT, pb.PRIORITY_DECODE_CRITICAL
    # t = 0: prefill; request r is first decoded at step r + 1.
    d.send(*(alloc(b, size=MB, ts=0, priority=hot, deadline_us=(r + 1) * STEP_US) for r, blocks in enumerate(requests) for b in blocks))
    for step in range(1, 17):
        now = step * STEP_US
        blocks = requests[(step - 1) % 4]
        d.send(
            *(update(b, ts=now, priority=dc) for b in blocks),
            pb.Event(ts_us=now, accessed=pb.BlocksAccessed(block_ids=blocks, next_use_us=now + 4 * STEP_US)),
            *(update(b, ts=now, priority=hot) for b in blocks),
        )
    return d


def test_cyclic_decode_with_announced_deadlines_deadline_edf_misses_nothing_lru_misses_everything() -> None:
    # LRU: twelve blocks cycle through nine slots: every block is read right after it was
    # pushed down, so all 48 decode-critical reads miss.
    lru = cyclic_decode("lru").core.stats
    assert (lru.dc_accesses, lru.dc_misses, lru.prefetches) == (48, 48, 0)
    # deadline_edf, its guard matched to the core's 1 ms prefetch margin.
    d = cyclic_decode("deadline_edf", "[policy.params]\nguard_us = 1000")
    edf = d.core.stats
    assert (edf.dc_accesses, edf.dc_misses, edf.prefetches) == (48, 0, 22)
    moves = [(x.kind, x.block_id, x.arrive_by_us) for x in d.directives]
    # Prefill, twelve blocks for nine slots: each block over the watermark pushes down the
    # free block needed last, r2's first (r3's were still to come), then r3's; r0, needed
    # first, is near and stays. At t = 1 ms r0 is read and is needed again four steps on:
    # now the latest deadline, its blocks go down for those needed soonest (r2's, then
    # r3's), and so on round the cycle: a prefetch only for a block that had to go.
    assert moves[:9] == [
        (DirectiveKind.DEMOTE, "r2b0", 0),
        (DirectiveKind.DEMOTE, "r3b0", 0),
        (DirectiveKind.DEMOTE, "r3b1", 0),
        (DirectiveKind.DEMOTE, "r0b0", 0),
        (DirectiveKind.PREFETCH, "r2b0", 3_000),
        (DirectiveKind.DEMOTE, "r1b0", 0),
        (DirectiveKind.PREFETCH, "r3b0", 4_000),
        (DirectiveKind.DEMOTE, "r1b1", 0),
        (DirectiveKind.PREFETCH, "r3b1", 4_000),
    ]
    # With the default guard (500 us) it still misses nothing.
    assert cyclic_decode("deadline_edf").core.stats.dc_misses == 0
