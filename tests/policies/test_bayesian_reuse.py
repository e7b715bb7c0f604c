"""bayesian_reuse: narrated scenarios of what it learns and when, and a run through the core.

Default parameters: prior Beta(1, 1), horizon 1 s. A block's key is the posterior mean of
its (type, transition) cell when the block was last keyed; the lowest leaves first, ties to
the least recently read.
"""

from __future__ import annotations

from typing import Any

import pytest

from broker.core import DirectiveKind
from policies.base import Block, Clock, Phase, PolicyContext, PolicyError, Priority, TierInfo
from policies.bayesian_reuse import BayesianReuseParams, BayesianReusePolicy, Transition
from policies.registry import make_params, policy_class
from tests.builders import Driver, access, alloc, free
from tests.conftest import small_config

HBM = TierInfo(0, "hbm", 10_000, 0.0, 1000.0)
DRAM = TierInfo(1, "dram", 20_000, 2.0, 25.0)
PROMPT = {"phase": Phase.PREFILL, "priority": Priority.WARM}
DRAFT = {"phase": Phase.PREFILL, "priority": Priority.WARM, "is_draft": True}


class Tier:
    """One tier driven directly; the block bookkeeping (reads, reuses, release) is the core's."""

    def __init__(self, index: int = 0, **params: Any) -> None:
        self.clock = Clock()
        tiers = (HBM, DRAM)
        self.policy = BayesianReusePolicy(PolicyContext(tiers[index], tiers, self.clock), BayesianReuseParams(**params))
        self.blocks: dict[str, Block] = {}

    def at(self, now_us: int) -> Tier:
        self.clock.now_us = now_us
        return self

    def insert(self, block_id: str, **intent: Any) -> Block:
        block = Block(block_id, 1)
        block.created_us = block.last_access_us = self.clock.now_us
        for name, value in intent.items():
            setattr(block, name, value)
        return self.put(block)

    def put(self, block: Block) -> Block:
        """Insert a block the test built (one the core has seen before)."""
        self.blocks[block.block_id] = block
        self.policy.insert(block)
        return block

    def read(self, block_id: str, *, prompt: bool = False) -> None:
        """A step reads the block; ``prompt``: a later prompt brought it (prefix reuse)."""
        block = self.blocks[block_id]
        block.accesses += 1
        block.last_access_us = self.clock.now_us
        if prompt:
            block.reuses += 1
            block.released = False
        self.policy.access(block)

    def release(self, block_id: str) -> None:
        block = self.blocks[block_id]
        block.released = True
        self.policy.update(block)

    def free(self, block_id: str) -> None:
        self.policy.remove(self.blocks.pop(block_id))

    def evict(self, count: int = 1) -> list[str]:
        victims = self.policy.choose_victims(count, frozenset())
        assert victims is not None
        for victim in victims:
            del self.blocks[victim.block_id]
            self.policy.evicted(victim)
        return [v.block_id for v in victims]

    def order(self) -> list[str]:
        victims = self.policy.choose_victims(len(self.blocks), frozenset())
        assert victims is not None
        return [b.block_id for b in victims]

    def p(self, block_id: str) -> float:
        return self.policy.score(self.blocks[block_id])

    def beta(self, transition: Transition, **intent: Any) -> tuple[float, float]:
        block = Block("probe", 1)
        for name, value in intent.items():
            setattr(block, name, value)
        return self.policy.posterior(self.policy.cell_of(block, transition))


def test_a_type_never_reused_is_evicted_first_even_when_more_recent() -> None:
    tier = Tier()
    # Before any learning: an early draft, keyed at the uniform prior's mean.
    tier.at(0).insert("early", **DRAFT)
    assert tier.p("early") == 0.5
    # Five rounds: a prompt block and a draft arrive; the prompt block is read 10 us
    # later (reused within the horizon), the draft is rejected and freed unread.
    for i in range(5):
        t = 100 + 100 * i
        tier.at(t).insert(f"a{i}", **PROMPT)
        tier.insert(f"d{i}", **DRAFT)
        tier.at(t + 10).read(f"a{i}")
        tier.at(t + 20).free(f"d{i}")
        tier.free(f"a{i}")
    # Newly allocated prompt blocks: Beta(6, 1); drafts: Beta(1, 6). A prompt block read
    # once and freed: Beta(1, 6) too, in the (prompt, READ) cell.
    assert tier.beta(Transition.ALLOCATED, **PROMPT) == (6, 1)
    assert tier.beta(Transition.ALLOCATED, **DRAFT) == (1, 6)
    assert tier.beta(Transition.READ, **PROMPT) == (1, 6)
    # t = 1000: a prompt block, then, more recent, a draft. LRU would evict the prompt
    # block; bayesian_reuse evicts the draft (1/7) before it (6/7).
    tier.at(1_000).insert("prompt", **PROMPT)
    tier.at(1_010).insert("draft", **DRAFT)
    assert (tier.p("prompt"), tier.p("draft")) == pytest.approx((6 / 7, 1 / 7))
    # The early draft still holds its key from t = 0: keys are fixed between a block's own
    # events, so it sits between the two.
    assert tier.order() == ["draft", "early", "prompt"]
    # Any event of its own re-keys it with what the cells learnt since: now it goes first
    # (same probability as the new draft, read longer ago).
    tier.policy.update(tier.blocks["early"])
    assert tier.p("early") == pytest.approx(1 / 7)
    assert tier.evict(2) == ["early", "draft"]
    # Evicted unread: two more failures for new drafts.
    assert tier.beta(Transition.ALLOCATED, **DRAFT) == (1, 8)


def test_a_read_after_the_horizon_counts_as_a_failure() -> None:
    tier = Tier(horizon_us=1_000)
    tier.at(0).insert("x", **PROMPT)
    # Read 2 ms later: it aged past the horizon unread, learnt lazily at the read.
    tier.at(2_000).read("x")
    assert tier.beta(Transition.ALLOCATED, **PROMPT) == (1, 2)
    tier.at(2_100).insert("y", **PROMPT)
    assert tier.p("y") == pytest.approx(1 / 3)
    # Read 400 us after its insert: within the horizon.
    tier.at(2_500).read("y")
    assert tier.beta(Transition.ALLOCATED, **PROMPT) == (2, 2)
    # x's trial since its read at 2 ms (READ) is still open: freed 1.5 ms later, a failure.
    tier.at(3_500).free("x")
    assert tier.beta(Transition.READ, **PROMPT) == (1, 2)


def test_release_then_prefix_reuse_learns_in_the_released_cell() -> None:
    tier = Tier()
    tier.at(0).insert("sys", **PROMPT)
    tier.at(10).read("sys")
    assert tier.beta(Transition.ALLOCATED, **PROMPT) == (2, 1)
    # The request ends and releases it: its READ trial is superseded (no outcome within the
    # horizon), and a RELEASED trial opens.
    tier.at(20).release("sys")
    assert tier.beta(Transition.READ, **PROMPT) == (1, 1)
    assert tier.p("sys") == 0.5
    # A later prompt brings it back: a success for released prompt blocks, and the block's
    # last transition is now a prefix reuse.
    tier.at(30).read("sys", prompt=True)
    assert tier.beta(Transition.RELEASED, **PROMPT) == (2, 1)
    assert tier.p("sys") == tier.policy.probability(tier.policy.cell_of(tier.blocks["sys"], Transition.PREFIX_REUSE)) == 0.5
    # The next released prompt block is now kept over an unknown one read as long ago.
    tier.at(40).insert("other", phase=Phase.DECODE)
    tier.insert("cached", **PROMPT)
    tier.release("cached")
    assert tier.p("cached") == pytest.approx(2 / 3)
    assert tier.order() == ["sys", "other", "cached"]


def test_removal_outcomes_pinned_read_and_freed() -> None:
    tier = Tier()
    tier.at(0).insert("pinned", **PROMPT)
    tier.insert("moved", **PROMPT)
    tier.insert("freed", **PROMPT)
    # Pinned (the core marks it pinned, then removes it from the policy): in use, no outcome.
    tier.blocks["pinned"].pin_requested = tier.blocks["pinned"].pinned = True
    tier.at(5).free("pinned")
    assert tier.beta(Transition.ALLOCATED, **PROMPT) == (1, 1)
    # Read, then removed (the core moving it up a tier): a reuse.
    moved = tier.blocks["moved"]
    moved.accesses += 1
    moved.last_access_us = 6
    tier.at(6).free("moved")
    assert tier.beta(Transition.ALLOCATED, **PROMPT) == (2, 1)
    # Freed unread: a failure.
    tier.at(7).free("freed")
    assert tier.beta(Transition.ALLOCATED, **PROMPT) == (2, 2)
    with pytest.raises(PolicyError):
        tier.policy.remove(Block("freed", 1))


def test_transitions_on_insert_and_ties_by_recency_then_id() -> None:
    top, low = Tier(0), Tier(1)
    # A new block: allocated. A block seen before (read once) entering a lower tier: pushed down.
    assert top.policy.transition(top.insert("new")) == Transition.ALLOCATED
    seen = Block("seen", 1)
    seen.accesses = 1
    assert low.policy.transition(low.put(seen)) == Transition.DEMOTED_IN
    # Entering the top tier: brought up; or, released, unpinned there.
    up = Block("up", 1)
    up.accesses = 1
    assert top.policy.transition(top.put(up)) == Transition.PROMOTED_IN
    rel = Block("rel", 1)
    rel.accesses, rel.released = 1, True
    assert top.policy.transition(top.put(rel)) == Transition.RELEASED
    # All at 0.5: least recently read first (new, up and rel were read at t = 0), then id.
    top.at(5).insert("a")
    assert top.order() == ["new", "rel", "up", "a"]


def test_params_are_validated_and_named() -> None:
    with pytest.raises(ValueError, match="prior_alpha"):
        BayesianReuseParams(prior_alpha=0)
    with pytest.raises(ValueError, match="prior_beta"):
        BayesianReuseParams(prior_beta=-1.0)
    with pytest.raises(ValueError, match="horizon_us"):
        BayesianReuseParams(horizon_us=0)
    cls = policy_class("bayesian_reuse")
    assert cls is BayesianReusePolicy
    assert make_params(cls, {"prior_alpha": 2, "horizon_us": 500}) == BayesianReuseParams(prior_alpha=2.0, horizon_us=500)
    tier = Tier(prior_alpha=3.0, prior_beta=1.0)
    tier.insert("x")
    assert tier.p("x") == 0.75


def test_core_demotes_a_recent_draft_before_older_prompt_blocks() -> None:
    # small_config: HBM 1000 B (high 950, low 900); blocks of 100 B.
    for policy, victim in (("lru", "c0"), ("bayesian_reuse", "d_new")):
        d = Driver(small_config(policy))
        # Five speculative steps: a committed block is read 1 us after it is written; the
        # draft beside it is rejected and freed unread.
        for i in range(5):
            t = 10 * i
            d.send(alloc(f"c{i}", ts=t), alloc(f"d{i}", ts=t, is_draft=True))
            d.send(access(f"c{i}", ts=t + 1), free(f"d{i}", ts=t + 2))
        # t = 100: three more committed blocks and a draft: HBM holds nine blocks.
        d.send(*(alloc(f"c{i}", ts=100) for i in range(5, 8)), alloc("d_new", ts=100, is_draft=True))
        # t = 101: a tenth block goes over the high watermark; one must go down. LRU takes
        # c0, the oldest; bayesian_reuse the draft (1/7), newer than c0 (0.5: its read
        # opened a trial with no outcome yet) and all others (6/7).
        out = d.send(alloc("c8", ts=101))
        assert [(x.kind, x.block_id, x.to_tier) for x in out.directives] == [(DirectiveKind.DEMOTE, victim, "dram")]
