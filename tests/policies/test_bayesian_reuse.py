"""bayesian_reuse: narrated scenarios of what it learns, when, and the eviction order that follows.

Default parameters: prior Beta(1, 1), horizon one turnover. The tiers here hold 4 bytes and
every block is 1 byte, so the horizon is 4 evicted bytes: a trial opened when the tier had
evicted ``e`` bytes is a failure once it has evicted ``e + 5``. Blocks are grouped by their
current cell; groups leave lowest current posterior mean first, each least recent first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from broker.config import PolicyConfig
from broker.model.apply import apply_batch
from broker.model.core import Core
from broker.replay.sweep import single_tier
from kvbroker.v1 import intent_pb2 as pb
from policies.base import Block, Clock, Phase, PolicyContext, PolicyError, Priority, TierInfo
from policies.bayesian_reuse import BayesianReuseParams, BayesianReusePolicy, Transition
from policies.registry import make_params, policy_class
from tests.builders import alloc, release

HBM = TierInfo(0, "hbm", 4, 0.0, 1000.0)
DRAM = TierInfo(1, "dram", 8, 2.0, 25.0)
PROMPT = {"phase": Phase.PREFILL, "priority": Priority.WARM}
DRAFT = {"phase": Phase.PREFILL, "priority": Priority.WARM, "is_draft": True}
DECODE = {"phase": Phase.DECODE, "priority": Priority.WARM}


class Tier:
    """One tier driven directly; the block bookkeeping (reads, reuses, release) is the core's."""

    def __init__(self, index: int = 0, **params: Any) -> None:
        self.clock = Clock()
        tiers = (HBM, DRAM)
        self.policy = BayesianReusePolicy(PolicyContext(tiers[index], tiers, self.clock), BayesianReuseParams(**params))
        self.blocks: dict[str, Block] = {}
        self.gone: dict[str, Block] = {}  # evicted: the core still knows them

    def insert(self, block_id: str, **intent: Any) -> Block:
        block = Block(block_id, 1)
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
        if prompt:
            block.reuses += 1
            block.released = False
        self.policy.access(block)

    def back(self, block_id: str, *, prompt: bool = False) -> None:
        """An evicted block is read, and the core brings it back into this tier."""
        block = self.gone.pop(block_id)
        block.accesses += 1
        if prompt:
            block.reuses += 1
            block.released = False
        self.put(block)

    def release(self, block_id: str) -> None:
        block = self.blocks[block_id]
        block.released = True
        self.policy.update(block)

    def change(self, block_id: str, **fields: Any) -> None:
        block = self.blocks[block_id]
        for name, value in fields.items():
            setattr(block, name, value)
        self.policy.update(block)

    def free(self, block_id: str) -> None:
        self.policy.remove(self.blocks.pop(block_id))

    def evict(self, count: int = 1) -> list[str]:
        victims = self.policy.choose_victims(count, frozenset())
        assert victims is not None
        for victim in victims:
            self.gone[victim.block_id] = self.blocks.pop(victim.block_id)
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


def test_a_cell_is_keyed_by_what_it_learnt_since_so_its_older_blocks_leave_first() -> None:
    tier = Tier()
    # Before any learning: a draft, at the uniform prior's mean.
    tier.insert("early", **DRAFT)
    assert tier.p("early") == 0.5
    # Five rounds: a prompt block is read (reused), a draft is rejected and freed unread.
    for i in range(5):
        tier.insert(f"a{i}", **PROMPT)
        tier.insert(f"d{i}", **DRAFT)
        tier.read(f"a{i}")
        tier.free(f"d{i}")
        tier.free(f"a{i}")
    # New prompt blocks: Beta(6, 1); new drafts: Beta(1, 6); a prompt block read once and
    # then freed: Beta(1, 6), in the (prompt, READ) cell.
    assert tier.beta(Transition.ALLOCATED, **PROMPT) == (6, 1)
    assert tier.beta(Transition.ALLOCATED, **DRAFT) == (1, 6)
    assert tier.beta(Transition.READ, **PROMPT) == (1, 6)
    # A prompt block, then, more recent, a draft: LRU would evict the prompt block first.
    tier.insert("prompt", **PROMPT)
    tier.insert("draft", **DRAFT)
    assert (tier.p("prompt"), tier.p("draft")) == pytest.approx((6 / 7, 1 / 7))
    # The early draft had no event since it was keyed at 0.5, yet it is in the drafts' group
    # at their current 1/7, ahead of the newer draft: oldest of the least likely cell first.
    assert tier.p("early") == pytest.approx(1 / 7)
    assert tier.order() == ["early", "draft", "prompt"]
    assert tier.evict(2) == ["early", "draft"]
    # Evicted is not a failure yet: each is a ghost until its horizon runs out or it comes back.
    assert tier.beta(Transition.ALLOCATED, **DRAFT) == (1, 6)


def test_a_cell_whose_probability_rises_reorders_its_whole_group() -> None:
    tier = Tier()
    # One decode block is read after its allocation: new decode blocks Beta(2, 1) = 2/3.
    tier.insert("warmup", **DECODE)
    tier.read("warmup")
    tier.free("warmup")  # freed after its read: a failure for (decode, READ), 1/3
    # Three new prompt blocks (prior 1/2) and two new decode blocks (2/3).
    for block_id in ("a1", "a2", "a3"):
        tier.insert(block_id, **PROMPT)
    for block_id in ("b1", "b2"):
        tier.insert(block_id, **DECODE)
    assert tier.order() == ["a1", "a2", "a3", "b1", "b2"]
    # Two other new prompt blocks are read: the (prompt, ALLOCATED) cell learns two
    # successes, 3/4 > 2/3. (Each is freed: a failure for the (prompt, READ) cell only.)
    for block_id in ("a4", "a5"):
        tier.insert(block_id, **PROMPT)
        tier.read(block_id)
        tier.free(block_id)
    # a1..a3 had no event of their own: their whole group moved, in its order.
    assert tier.order() == ["b1", "b2", "a1", "a2", "a3"]
    # The cells, lowest first: (prompt, READ) 1/4 and (decode, READ) 1/3, both empty, then
    # the two groups.
    assert [(round(p, 4), n) for p, _, n in tier.policy.ranking()] == [(0.25, 0), (0.3333, 0), (0.6667, 2), (0.75, 3)]


def test_ghosts_learn_whether_an_evicted_block_was_wanted_within_the_horizon() -> None:
    tier = Tier()
    for block_id in ("x", "y", "z"):
        tier.insert(block_id, **PROMPT)
    # The tier evicts x, then y (1 and 2 bytes evicted): both ghosts of new prompt blocks.
    assert tier.evict() == ["x"]
    assert tier.evict() == ["y"]
    # x is read again (the core brings it back): its horizon (opened at 0, 4 bytes) has
    # not run out, so new prompt blocks are reused: a success, Beta(2, 1).
    tier.back("x")
    assert tier.beta(Transition.ALLOCATED, **PROMPT) == (2, 1)
    assert tier.policy.transition(tier.blocks["x"]) == Transition.PROMOTED_IN
    # Now x (prior 1/2, promoted) goes before z (2/3). Evicting x and z: 4 bytes evicted,
    # and nothing is past its horizon yet.
    assert tier.evict(2) == ["x", "z"]
    assert tier.beta(Transition.ALLOCATED, **PROMPT) == (2, 1)
    # One more byte: y and z, opened at 0, were not read within 4 evicted bytes: two
    # failures for new prompt blocks. x's promoted trial (opened at 2) is still open.
    tier.insert("f", **DRAFT)
    assert tier.evict() == ["f"]
    assert tier.beta(Transition.ALLOCATED, **PROMPT) == (2, 3)
    assert tier.beta(Transition.PROMOTED_IN, **PROMPT) == (1, 1)
    # Two more bytes: x's ghost runs out too. Its read after that is no outcome: the ghost
    # is gone, and so is the failure it already was.
    for block_id in ("g", "h"):
        tier.insert(block_id, **DRAFT)
        tier.evict()
    assert tier.beta(Transition.PROMOTED_IN, **PROMPT) == (1, 2)
    tier.back("x")
    assert tier.beta(Transition.PROMOTED_IN, **PROMPT) == (1, 2)


def shared_block(block_id: str, accesses: int) -> Block:
    """A released prompt block that two later prompts already brought back."""
    block = Block(block_id, 1)
    block.phase, block.priority, block.accesses, block.reuses, block.released = Phase.PREFILL, Priority.WARM, accesses, 2, True
    return block


def test_a_block_idle_for_a_horizon_fails_and_sinks_to_its_idle_cell() -> None:
    tier = Tier()
    # Learning: drafts are freed unread (1/3); released shared-prefix blocks (brought back
    # by two prompts already) are brought back again by a prompt, four times (5/6).
    tier.insert("d", **DRAFT)
    tier.free("d")
    for i in range(4):
        tier.put(shared_block(f"k{i}", accesses=2))
        tier.read(f"k{i}", prompt=True)
        tier.free(f"k{i}")
    shared = {**PROMPT, "reuses": 2}
    assert tier.beta(Transition.RELEASED, **shared) == (5, 1)
    # hot, such a block, released at 0 bytes evicted; w, a decode block, read after its
    # allocation (the (decode, READ) cell is still at the prior).
    hot = tier.put(shared_block("hot", accesses=3))
    tier.insert("w", **DECODE)
    tier.read("w")
    # Five rounds: a draft arrives and is evicted (the lowest cell); w is read in rounds
    # 0, 2 and 4: its READ cell reaches Beta(4, 1) = 4/5, still below hot's 5/6.
    for r in range(5):
        tier.insert(f"d{r}", **DRAFT)
        if r % 2 == 0:
            tier.read("w")
        if r == 4:
            assert tier.order() == ["d4", "w", "hot"]
        assert tier.evict() == [f"d{r}"]
    # The fifth byte evicted ran out hot's horizon (opened at 0) without a read: a failure
    # for released shared blocks, Beta(5, 2), and hot reopened as IDLE (at 5), a cell with
    # no history: 1/2. It now leaves before w, though neither had an event of its own.
    assert tier.beta(Transition.RELEASED, **shared) == (5, 2)
    assert tier.policy.transition(hot) == Transition.IDLE
    assert tier.order() == ["hot", "w"]
    # Five more bytes evicted, no read: hot's IDLE trial fails too (at 10).
    for r in range(5, 10):
        tier.insert(f"d{r}", **DRAFT)
        tier.evict()
    assert tier.beta(Transition.IDLE, **shared) == (1, 2)
    assert tier.policy.transition(hot) == Transition.IDLE


def test_prefix_chain_types_tail_children_and_reuse_level() -> None:
    tier = Tier()
    # A prompt's chain: s -> t. When t is allocated the core counts s's first child.
    s = tier.insert("s", **PROMPT)
    tier.insert("t", **PROMPT, parent_id="s")
    assert tier.policy.cell_of(s, Transition.ALLOCATED)[3] is False
    tier.change("s", children=1)
    assert tier.policy.cell_of(s, Transition.ALLOCATED)[3] is True
    assert [n for _, _, n in tier.policy.ranking()] == [1, 1]  # t (tail), s (has a child)
    # The prompt ends: both released, each a RELEASED trial of its own type.
    tier.release("s")
    tier.release("t")
    assert {tier.policy.transition(tier.blocks[b]) for b in ("s", "t")} == {Transition.RELEASED}
    # A later prompt brings s back: a success for released first-time blocks with a child,
    # and s is now at reuse level 1, in a PREFIX_REUSE trial.
    tier.read("s", prompt=True)
    assert tier.beta(Transition.RELEASED, **PROMPT, children=1) == (2, 1)
    assert tier.policy.cell_of(s, Transition.PREFIX_REUSE)[4] == 1
    assert tier.policy.transition(s) == Transition.PREFIX_REUSE
    # Reuse levels stop at 2: a block brought back five times is in the "2+" cells.
    s.reuses = 5
    assert tier.policy.cell_of(s, Transition.READ)[4] == 2


def test_removal_outcomes_pinned_read_and_freed() -> None:
    tier = Tier()
    tier.insert("pinned", **PROMPT)
    tier.insert("moved", **PROMPT)
    tier.insert("freed", **PROMPT)
    # Pinned (the core marks it pinned, then removes it from the policy): in use, no outcome.
    tier.blocks["pinned"].pin_requested = tier.blocks["pinned"].pinned = True
    tier.free("pinned")
    assert tier.beta(Transition.ALLOCATED, **PROMPT) == (1, 1)
    # Read, then removed (the core moving it up a tier): a reuse.
    tier.blocks["moved"].accesses += 1
    tier.free("moved")
    assert tier.beta(Transition.ALLOCATED, **PROMPT) == (2, 1)
    # Freed unread: a failure.
    tier.free("freed")
    assert tier.beta(Transition.ALLOCATED, **PROMPT) == (2, 2)
    with pytest.raises(PolicyError):
        tier.policy.remove(Block("freed", 1))
    assert len(tier.policy) == 0


def test_transitions_on_insert_and_ties_by_cell_then_recency() -> None:
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
    # All at 1/2: cells in tuple order (ALLOCATED 0 < PROMOTED_IN 1 < RELEASED 5), and
    # inside a cell the least recently placed first.
    top.insert("new2")
    assert top.order() == ["new", "new2", "up", "rel"]


def test_params_are_validated_and_named() -> None:
    with pytest.raises(ValueError, match="prior_alpha"):
        BayesianReuseParams(prior_alpha=0)
    with pytest.raises(ValueError, match="prior_beta"):
        BayesianReuseParams(prior_beta=-1.0)
    with pytest.raises(ValueError, match="horizon_turnovers"):
        BayesianReuseParams(horizon_turnovers=0)
    cls = policy_class("bayesian_reuse")
    assert cls is BayesianReusePolicy
    assert make_params(cls, {"prior_alpha": 2, "horizon_turnovers": 0.5}) == BayesianReuseParams(prior_alpha=2.0, horizon_turnovers=0.5)
    tier = Tier(prior_alpha=3.0, prior_beta=1.0)
    tier.insert("x")
    assert tier.p("x") == 0.75
    # Half a turnover of a 4-byte tier: a trial fails once 3 bytes were evicted after it.
    half = Tier(horizon_turnovers=0.5)
    for block_id in ("a", "b", "c"):
        half.insert(block_id, **PROMPT)
    half.evict(2)
    assert half.beta(Transition.ALLOCATED, **PROMPT) == (1, 1)
    half.evict()
    assert half.beta(Transition.ALLOCATED, **PROMPT) == (1, 4)


def prompt(core: Core, seq: int, *chain: str) -> list[str]:
    """One request of the prompt-only replay: its chain of blocks, then their release.
    Returns the blocks evicted to make room for it."""
    events = [alloc(b, 100, ts=seq, parent_block_id=p, phase=pb.PHASE_PREFILL) for p, b in zip(("", *chain), chain, strict=False)]
    outcome = apply_batch(core, pb.IntentBatch(client_id="c", batch_seq=seq, events=[*events, release(*chain, ts=seq)]))
    assert not outcome.rejections
    return [d.block_id for d in outcome.directives]


@pytest.mark.parametrize(
    ("policy", "hits", "last_victims"), [("lru", 0, ["u3b", "u3c", "s0"]), ("bayesian_reuse", 8, ["q4", "u4a", "u4b"])]
)
def test_core_keeps_the_shared_prefix_over_one_time_blocks(policy: str, hits: int, last_victims: list[str]) -> None:
    # One tier of 5 blocks of 100 B that evicts exactly when full (the prefix-cache setup):
    # the horizon is 500 evicted bytes. Requests alternate: the shared prefix s0 -> s1 with
    # its own last block q, and a one-time chain a -> b -> c.
    core = Core(dataclasses.replace(single_tier(500), policy=PolicyConfig(policy)))
    for r in range(5):
        prompt(core, 2 * r + 1, "s0", "s1", f"q{r}")
        victims = prompt(core, 2 * r + 2, f"u{r}a", f"u{r}b", f"u{r}c")
    # LRU: the four one-time blocks in between push s0 and s1 out every time: no hit.
    # bayesian_reuse: released chain tails are rarely brought back, the shared prefix is;
    # from the second request on, every shared request hits s0 and s1.
    assert core.stats.prefix_hits_top == hits
    assert victims == last_victims
    if policy == "bayesian_reuse":
        policy_ = core.tiers[0].policy
        assert isinstance(policy_, BayesianReusePolicy)
        held = [(round(p, 4), cell[3:], n) for p, cell, n in policy_.ranking() if n]
        # (has children, reuse level, transition): released tails, 1/9 (u4c); first-time
        # blocks with a child, idle for a horizon, 1/3 (u0a and u2a, never brought back);
        # the released shared prefix, reused 2+ times, 5/6 (s0, s1).
        assert held == [(0.1111, (False, 0, 5), 1), (0.3333, (True, 0, 6), 2), (0.8333, (True, 2, 5), 2)]
