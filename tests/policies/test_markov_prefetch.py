"""markov_prefetch (kv-hierarchy-lab's predictive policy): narrated scenarios, driven directly
and through the real core."""

from __future__ import annotations

from typing import Any

import pytest

from broker.config import parse_config
from broker.model.core import DirectiveKind
from policies.base import Block, Clock, PolicyContext, PolicyError, TierInfo
from policies.markov_prefetch import MarkovPrefetchParams, MarkovPrefetchPolicy
from policies.registry import make_params, policy_class
from tests.builders import Driver, access, alloc

TWO_TIERS = """
[broker]
listen = "127.0.0.1:0"
[policy]
name = "markov_prefetch"
[[tiers]]
name = "hbm"
capacity = 1000
[[tiers]]
name = "dram"
capacity = 2000
"""


class Tier:
    """The top tier's policy driven directly; each call is one event (its own step)."""

    def __init__(self, **params: Any) -> None:
        info = TierInfo(0, "hbm", 10_000, 0.0, 1000.0)
        self.clock = Clock()
        self.policy = MarkovPrefetchPolicy(PolicyContext(info, (info,), self.clock), MarkovPrefetchParams(**params))
        self.blocks: dict[str, Block] = {}

    def block(self, block_id: str) -> Block:
        return self.blocks.setdefault(block_id, Block(block_id, 1))

    def reads(self, *block_ids: str) -> list[list[str]]:
        """Reads of blocks in any tier, as the core reports them to the top tier's policy:
        only ``after_access``. Returns what each proposed."""
        return [list(self.policy.after_access(self.block(b))) for b in block_ids]


def test_after_a_then_b_twice_a_proposes_b() -> None:
    tier = Tier()
    # A, B, C, A: transitions A->B, B->C, C->A, each seen once: nothing proposed yet.
    assert tier.reads("A", "B", "C", "A") == [[], [], [], []]
    # B: A->B seen twice now; B's own successors (C once) are not enough.
    assert tier.reads("B") == [[]]
    assert tier.policy.successors("A") == {"B": 2}
    # A again: its successor B has been seen twice: proposed.
    assert tier.reads("A") == [["B"]]
    # Only what was just proposed is admitted.
    assert tier.policy.admit_prefetch(tier.block("B"), []) is True
    assert tier.policy.admit_prefetch(tier.block("C"), []) is False
    # The next read's proposals replace the last ones: C proposes nothing, so B is no longer admitted.
    assert tier.reads("C") == [[]]
    assert tier.policy.admit_prefetch(tier.block("B"), []) is False


def test_top_two_successors_most_frequent_first_ties_by_id() -> None:
    tier = Tier()
    # From A: Z twice, X twice, Y three times, W once.
    tier.reads("A", "Z", "A", "X", "A", "Y", "A", "Y", "A", "Z", "A", "X", "A", "Y", "A", "W")
    assert tier.policy.successors("A") == {"Z": 2, "X": 2, "Y": 3, "W": 1}
    # Y (3) first, then the tie X / Z (2) goes to X; W (once) is never proposed.
    assert tier.policy.predict("A") == ["Y", "X"]
    assert tier.reads("A") == [["Y", "X"]]


def test_a_repeated_read_is_not_a_transition() -> None:
    tier = Tier()
    tier.reads("A", "A", "A", "B")
    assert tier.policy.successors("A") == {"B": 1}


def test_successor_table_is_bounded_keeping_the_most_frequent() -> None:
    tier = Tier(max_successors=2)
    # A->X twice, A->Y once: the table is full.
    tier.reads("A", "X", "A", "X", "A", "Y")
    # A->Z is new: the least frequent, Y, is forgotten.
    tier.reads("A", "Z")
    assert tier.policy.successors("A") == {"X": 2, "Z": 1}
    # A->Y again: now Z (1) is the least frequent and goes.
    tier.reads("A", "Y")
    assert tier.policy.successors("A") == {"X": 2, "Y": 1}


def test_source_table_is_bounded() -> None:
    tier = Tier(max_sources=2)
    # Sources A, B, C in turn: A, updated longest ago, is forgotten.
    tier.reads("A", "B", "C", "D")
    assert tier.policy.successors("A") == {}
    assert tier.policy.successors("B") == {"C": 1} and tier.policy.successors("C") == {"D": 1}


def test_eviction_is_reads_x_100_plus_last_step() -> None:
    tier = Tier()
    policy, clock = tier.policy, tier.clock
    for step, block_id in enumerate("abc"):
        clock.event_index = step
        policy.insert(tier.block(block_id))
    # Step 3: a read once: 100 + 3. Step 150: d arrives: 150 outranks a's read.
    clock.event_index = 3
    tier.block("a").accesses += 1
    policy.access(tier.block("a"))
    clock.event_index = 150
    policy.insert(tier.block("d"))
    victims = policy.choose_victims(4, frozenset())
    assert victims is not None and [v.block_id for v in victims] == ["b", "c", "a", "d"]
    assert policy.score(tier.block("a")) == 103


def test_core_prefetches_b_when_a_is_read_after_b_was_demoted() -> None:
    d = Driver(parse_config(TWO_TIERS))
    # HBM holds 1000 bytes (high watermark 950, low 900). A and B arrive.
    d.send(alloc("A", 100, ts=1), alloc("B", 100, ts=2))
    # Reads A, B, A, B, A: the top tier's policy learns A->B (twice) and B->A (twice).
    # The last read of A proposes B, but B is already in HBM: nothing to do.
    for i, block_id in enumerate("ABABA"):
        d.send(access(block_id, ts=10 + i))
    assert [x for x in d.directives if x.kind == DirectiveKind.PREFETCH] == []
    # Seven more blocks fill HBM to 900; each is read three times: 3 x 100 + step, above
    # B (2 x 100 + step), the one block now read least.
    fillers = [f"f{i}" for i in range(7)]
    d.send(*(alloc(f, 100, ts=20) for f in fillers))
    for i in range(3):
        d.send(access(*fillers, ts=21 + i))
    # X takes HBM over the high watermark: the lowest score, B, is demoted to DRAM.
    out = d.send(alloc("X", 100, ts=30))
    assert [(x.kind, x.block_id, x.from_tier, x.to_tier) for x in out.directives] == [(DirectiveKind.DEMOTE, "B", "hbm", "dram")]
    # A is read: the policy proposes B; HBM is full again, so room is made by demoting X
    # (never read: the lowest score), and the policy admits B over it.
    out = d.send(access("A", ts=40))
    assert [(x.kind, x.block_id, x.from_tier, x.to_tier, x.reason) for x in out.directives] == [
        (DirectiveKind.DEMOTE, "X", "hbm", "dram", "over high watermark"),
        (DirectiveKind.PREFETCH, "B", "dram", "hbm", "predicted next access"),
    ]
    assert d.where("B") == "hbm"
    # The read of B that follows is a hit in HBM.
    before = d.core.stats.accesses_by_tier[0]
    d.send(access("B", ts=41))
    assert d.core.stats.accesses_by_tier[0] == before + 1


def test_params_are_validated() -> None:
    with pytest.raises(ValueError, match="max_successors"):
        MarkovPrefetchParams(max_successors=0)
    with pytest.raises(ValueError, match="fanout"):
        MarkovPrefetchParams(fanout=0)
    with pytest.raises(ValueError, match="freq_weight"):
        MarkovPrefetchParams(freq_weight=-1)
    with pytest.raises(PolicyError, match="min_count"):
        make_params(policy_class("markov_prefetch"), {"min_count": 0})
