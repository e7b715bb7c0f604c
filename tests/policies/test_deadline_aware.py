"""deadline_aware (kv_deadline_scheduler's DeadlineAware): narrated scenarios, its prefetch
rule, and a deadline prefetch through the real core.

Default parameters: us_per_step 1000, recency_horizon_us 100,000. The highest eviction
score leaves first; a block's score is taken at its own insert, read or update.
"""

from __future__ import annotations

from typing import Any

import pytest

from broker.model.core import DirectiveKind
from kvbroker.v1 import intent_pb2 as pb
from policies.base import Block, Clock, Phase, PolicyContext, PolicyError, Priority, TierInfo
from policies.deadline_aware import DeadlineAwarePolicy, DeadlineParams
from policies.registry import make_params, policy_class
from tests.builders import Driver, alloc, update
from tests.conftest import small_config


class Tier:
    """One tier driven directly, stamping blocks the way the core does."""

    def __init__(self, **params: Any) -> None:
        info = TierInfo(0, "hbm", 10_000, 0.0, 1000.0)
        self.clock = Clock()
        self.policy = DeadlineAwarePolicy(PolicyContext(info, (info,), self.clock), DeadlineParams(**params))
        self.blocks: dict[str, Block] = {}

    def at(self, now_us: int) -> Tier:
        self.clock.now_us = now_us
        return self

    def insert(self, block_id: str, size: int = 1, **intent: Any) -> Block:
        block = make_block(block_id, self.clock.now_us, size, **intent)
        self.blocks[block_id] = block
        self.policy.insert(block)
        return block

    def order(self) -> list[str]:
        victims = self.policy.choose_victims(sum(b.size for b in self.blocks.values()), frozenset())
        assert victims is not None
        return [b.block_id for b in victims]


def make_block(block_id: str, now_us: int, size: int = 1, **intent: Any) -> Block:
    block = Block(block_id, size)
    block.created_us = block.last_access_us = now_us
    for name, value in intent.items():
        setattr(block, name, value)
    return block


def three_blocks() -> Tier:
    tier = Tier()
    # t = 0: D, WARM, in DECODE, needed at t = 3 ms. IntentAware part: 55 + 50 - 60 - risk/40
    # with risk = 100 + 350 (10000 - 3000)/20 + 61 (64 - 3 steps) + 120 DECODE + 30 WARM + 40
    # = 701, so 27.475; then -140 (deadline <= 5000) - 110 DECODE - 701/18: -261.47.
    tier.at(0).insert("D", priority=Priority.WARM, phase=Phase.DECODE, deadline_us=3000)
    # t = 1 ms: C, COLD, DONE, no deadline: 110 + 120 + 50 - 60 (risk 0), + 40 DONE
    # + 35 COLD without deadline: 295.
    tier.at(1000).insert("C", priority=Priority.COLD, phase=Phase.DONE)
    # t = 2 ms: L, WARM, needed in 1 s: 40.75 (risk 170), - 25 (a far deadline) - 170/18: 6.31.
    tier.at(2000).insert("L", priority=Priority.WARM, deadline_us=1_002_000)
    return tier


def test_an_older_deadline_near_block_survives_younger_ones() -> None:
    tier = three_blocks()
    assert [tier.policy.score(tier.blocks[x]) for x in "DCL"] == pytest.approx([261.4694, -295.0, -6.3056], abs=1e-3)
    # LRU would take D, the oldest; DeadlineAware takes C, then L, and keeps D.
    assert tier.order() == ["C", "L", "D"]
    assert [b.block_id for b in tier.policy.choose_victims(2, {"C"}) or []] == ["L", "D"]


def test_deadline_terms_added_to_intent_aware() -> None:
    tier = Tier()
    # F: every IntentAware term set (IntentAware score 34.25, risk 1030; see its tests),
    # plus -140 (deadline 4 ms) - 120 (slack 1 ms) - 80 (recompute 8 ms) - 1030/18.
    tier.at(1000).insert(
        "F",
        priority=Priority.WARM,
        phase=Phase.PREFILL,
        deadline_us=5000,
        slack_us=1000,
        reuse_window=600,
        recompute_cost_us=8000,
        recompute_ok=True,
        compression_ok=True,
        is_draft=True,
    )
    assert tier.policy.score(tier.blocks["F"]) == pytest.approx(-(34.25 - 140 - 120 - 80 - 1030 / 18))
    # Two COLD DONE blocks: the one with a (far) deadline loses +35 and gains -25.
    tier.insert("free", priority=Priority.COLD, phase=Phase.DONE)
    tier.insert("dated", priority=Priority.COLD, phase=Phase.DONE, deadline_us=10_000_000)
    assert tier.policy.score(tier.blocks["free"]) == -295.0
    assert tier.policy.score(tier.blocks["dated"]) == -235.0
    # A high request priority (-90 and 2 x 90 in the risk) keeps an otherwise equal block.
    tier.insert("vip", priority=Priority.COLD, phase=Phase.DONE, request_priority=90)
    assert tier.order() == ["free", "dated", "vip", "F"]


def test_prefetch_rule() -> None:
    tier = three_blocks()
    c, d = tier.blocks["C"], tier.blocks["D"]

    def cand(**intent: Any) -> Block:
        # A block in a lower tier, last read at t = 0; the clock is at t = 2 ms.
        return make_block("p", 0, **{"prefetch_ok": True, "priority": Priority.HOT, **intent})

    # HOT, needed in 4 ms (<= 5 ms): admitted over C, which the policy would rather lose.
    assert tier.policy.admit_prefetch(cand(deadline_us=6000), [c]) is True
    # ... but not over D: D (-261.5) ranks above the candidate (about -180.0).
    assert tier.policy.score(d) > -tier.policy.eviction_score(cand(deadline_us=6000), 2000) > 0
    assert tier.policy.admit_prefetch(cand(deadline_us=6000), [c, d]) is False
    # Needed in 5001 us, no slack or reuse hint: not urgent enough; 5000 us is.
    assert tier.policy.admit_prefetch(cand(deadline_us=7001), [c]) is False
    assert tier.policy.admit_prefetch(cand(deadline_us=7000), [c]) is True
    # Without prefetch_ok: never.
    assert tier.policy.admit_prefetch(cand(deadline_us=6000, prefetch_ok=False), [c]) is False
    # WARM outside DECODE: never, however near; WARM in DECODE: yes.
    assert tier.policy.admit_prefetch(cand(deadline_us=6000, priority=Priority.WARM), [c]) is False
    assert tier.policy.admit_prefetch(cand(deadline_us=6000, priority=Priority.WARM, phase=Phase.DECODE), [c]) is True
    # No deadline: slack <= 2000 qualifies, 2001 does not.
    assert tier.policy.admit_prefetch(cand(slack_us=2000), [c]) is True
    assert tier.policy.admit_prefetch(cand(slack_us=2001), [c]) is False
    # No deadline, no slack: a reuse window <= 8 tokens qualifies, 9 does not.
    assert tier.policy.admit_prefetch(cand(reuse_window=8), [c]) is True
    assert tier.policy.admit_prefetch(cand(reuse_window=9), [c]) is False
    # DECODE_CRITICAL qualifies like HOT.
    assert tier.policy.admit_prefetch(cand(reuse_window=0, priority=Priority.DECODE_CRITICAL), [c]) is True


def test_core_prefetches_a_demoted_block_when_its_deadline_nears() -> None:
    d = Driver(small_config("deadline_aware"))
    # b0 (COLD, prefetch_ok) then nine HOT blocks fill HBM; the tenth block takes it over the
    # high watermark and the highest score, b0 (COLD without deadline), goes down.
    d.send(alloc("b0", ts=0, priority=pb.PRIORITY_COLD, prefetch_ok=True))
    d.send(*(alloc(f"h{i}", ts=1 + i, priority=pb.PRIORITY_HOT) for i in range(9)))
    assert d.where("b0") == "dram"
    # t = 100: b0 turns HOT, needed at t = 300: within transfer + margin, the core offers it.
    # The victim is h0 (the HOT blocks tie; the least recent goes), which ranks below b0 now.
    out = d.send(update("b0", ts=100, priority=pb.PRIORITY_HOT, deadline_us=300))
    assert [(x.kind, x.block_id, x.from_tier, x.to_tier, x.arrive_by_us) for x in out.directives] == [
        (DirectiveKind.DEMOTE, "h0", "hbm", "dram", 0),
        (DirectiveKind.PREFETCH, "b0", "dram", "hbm", 300),
    ]
    assert d.where("b0") == "hbm" and d.where("h0") == "dram"


def test_core_does_not_prefetch_without_prefetch_ok() -> None:
    d = Driver(small_config("deadline_aware"))
    d.send(alloc("b0", ts=0, priority=pb.PRIORITY_COLD))
    d.send(*(alloc(f"h{i}", ts=1 + i, priority=pb.PRIORITY_HOT) for i in range(9)))
    out = d.send(update("b0", ts=100, priority=pb.PRIORITY_HOT, deadline_us=300))
    assert out.directives == []
    assert d.where("b0") == "dram"


def test_params_are_validated() -> None:
    with pytest.raises(ValueError, match="prefetch_slack_us"):
        DeadlineParams(prefetch_slack_us=-1)
    with pytest.raises(ValueError, match="us_per_step"):
        DeadlineParams(us_per_step=0)
    with pytest.raises(PolicyError, match="prefetch_deadline_us"):
        make_params(policy_class("deadline_aware"), {"prefetch_deadline_us": -2})
