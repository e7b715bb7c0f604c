"""The policy contract, for every registered policy, on random operation streams.

Streams mix inserts (ids come back, so history-keeping policies see their ghosts), reads,
intent updates, removals and watermark-style evictions with a protected set, over blocks
of different sizes. After every step: the tier is within capacity, the policy holds
exactly the resident blocks, and every choice of victims obeys the contract.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import Block, PolicyError, Priority
from policies.registry import names
from tests.policies.harness import SimTier

CAPACITY = 24
IDS = 16

# Every registered policy, and the out-of-tree ones named in KVBROKER_CONTRACT_POLICIES
# (module:Class, comma-separated, importable: e.g. PYTHONPATH=docs/examples), so that a
# policy written outside the tree passes the same suite (docs/writing-a-policy.md).
POLICIES = names() + [spec.strip() for spec in os.environ.get("KVBROKER_CONTRACT_POLICIES", "").split(",") if spec.strip()]

Op = tuple[Any, ...]

INSERT = st.tuples(st.just("insert"), st.integers(0, IDS - 1), st.integers(1, 6))
ACCESS = st.tuples(st.just("access"), st.integers(0, IDS - 1))
UPDATE = st.tuples(
    st.just("update"),
    st.integers(0, IDS - 1),
    st.sampled_from([Priority.UNSPECIFIED, Priority.COLD, Priority.WARM, Priority.HOT]),
    st.integers(0, 100),
)
REMOVE = st.tuples(st.just("remove"), st.integers(0, IDS - 1))
# Protected blocks are given by position among the resident blocks, oldest inserted first,
# so that small numbers (where hypothesis shrinks to) protect the blocks most policies
# would evict first: the case that tests stepping over them. Positions past the end
# protect a block that is not resident, which must change nothing.
EVICT = st.tuples(st.just("evict"), st.integers(1, CAPACITY + 4), st.frozensets(st.integers(0, 8), max_size=3))
OPS = st.lists(st.one_of(INSERT, INSERT, INSERT, ACCESS, ACCESS, UPDATE, REMOVE, EVICT, EVICT), min_size=5, max_size=80)


def protected_of(tier: SimTier, positions: frozenset[int]) -> frozenset[str]:
    resident = list(tier.blocks)
    return frozenset(resident[p] if p < len(resident) else "absent" for p in positions)


def check_victims(tier: SimTier, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
    """Ask for victims twice (the same answer: asking changes nothing) and check the answer."""
    first = tier.policy.choose_victims(bytes_needed, protected)
    second = tier.policy.choose_victims(bytes_needed, protected)
    ids = None if first is None else [b.block_id for b in first]
    assert ids == (None if second is None else [b.block_id for b in second]), "choose_victims changed state"
    evictable = sum(b.size for b in tier.blocks.values() if b.block_id not in protected)
    if first is None:
        # None means impossible, never "rather not": the core would fail the request.
        assert evictable < bytes_needed, f"None although {evictable} unprotected bytes >= {bytes_needed}"
        return None
    assert ids is not None
    assert len(set(ids)) == len(ids), f"a victim named twice: {ids}"
    assert not set(ids) & protected, f"protected victim: {set(ids) & protected}"
    for block in first:
        assert tier.blocks.get(block.block_id) is block, f"{block.block_id} is not a block the policy holds"
    assert sum(b.size for b in first) >= bytes_needed
    return first


def check_membership(tier: SimTier) -> None:
    policy = tier.policy
    assert len(policy) == len(tier.blocks)
    for i in range(IDS):
        assert (f"b{i}" in policy) == (f"b{i}" in tier.blocks)
    assert tier.used <= tier.capacity


def future_of(ops: list[Op]) -> dict[str, list[int]]:
    """Where each block is used (inserted or read) in ``ops``: the oracle offline policies get."""
    uses: dict[str, list[int]] = {}
    for i, op in enumerate(ops):
        if op[0] in ("insert", "access"):
            uses.setdefault(f"b{op[1]}", []).append(i)
    return uses


def run(name: str, ops: list[Op]) -> list[Any]:
    """Play ``ops`` on a fresh tier, checking the contract at each step; returns what happened."""
    tier = SimTier(name, CAPACITY, future=future_of(ops))
    log: list[Any] = []
    for i, op in enumerate(ops):
        tier.clock.event_index = i
        kind, block_id = op[0], f"b{op[1]}" if op[0] != "evict" else ""
        if kind == "insert" and block_id not in tier.blocks:
            size = op[2]
            if tier.used + size > CAPACITY:
                check_victims(tier, tier.used + size - CAPACITY, {block_id})
            log.append(("insert", block_id, tier.insert(block_id, size)))
        elif kind == "access" and block_id in tier.blocks:
            tier.access(block_id)
        elif kind == "update" and block_id in tier.blocks:
            tier.update(block_id, priority=op[2], request_priority=op[3])
        elif kind == "remove":
            if block_id in tier.blocks:
                tier.remove(block_id)
            else:
                with pytest.raises(PolicyError):
                    tier.policy.remove(Block(block_id, 1))
        elif kind == "evict":
            protected = protected_of(tier, op[2])
            victims = check_victims(tier, op[1], protected)
            log.append(("evict", None if victims is None else tier.evict(victims)))
        check_membership(tier)
    return log


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=50, deadline=None)
@given(ops=OPS)
def test_contract(name: str, ops: list[Op]) -> None:
    run(name, ops)


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=25, deadline=None)
@given(ops=OPS)
def test_same_stream_same_victims(name: str, ops: list[Op]) -> None:
    assert run(name, ops) == run(name, ops)


@pytest.mark.parametrize("name", POLICIES)
def test_remove_unknown_raises(name: str) -> None:
    tier = SimTier(name, CAPACITY)
    with pytest.raises(PolicyError):
        tier.policy.remove(Block("never", 1))
    tier.insert("a", 2)
    tier.make_room(2)
    # Evicted blocks are gone too.
    with pytest.raises(PolicyError):
        tier.policy.remove(Block("a", 2))


def class_docstring(cls: type) -> str | None:
    """The docstring of ``cls`` in its source file: a class compiled with mypyc
    (broker/native.py) keeps only its signature in ``__doc__``."""
    module_file = Path(sys.modules[cls.__module__].__file__ or "")
    source = module_file.with_name(cls.__module__.rpartition(".")[2] + ".py")
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return ast.get_docstring(node)
    raise AssertionError(f"class {cls.__name__} not found in {source}")


@pytest.mark.parametrize("name", POLICIES)
def test_declares_name_description_and_params(name: str) -> None:
    tier = SimTier(name, CAPACITY)
    cls = type(tier.policy)
    assert cls.name == name if ":" not in name else cls.name and cls.name not in names()  # out of tree: a name of its own
    assert cls.description and "\n" not in cls.description
    assert class_docstring(cls)
    cls.Params()  # defaults are valid


# Policies whose eviction is a walk of one order, one victim after another: for them,
# evicting the first victim of a plan must leave exactly the rest of the plan. This is how
# the ones that reorganise on eviction (S3-FIFO, SIEVE) prove that ``evicted`` commits the
# plan ``choose_victims`` made, protected blocks included.
SEQUENTIAL = ["arc", "fifo", "lfu", "lru", "lru_k", "priority_lru", "s3fifo", "sieve", "two_queue"]


@pytest.mark.parametrize("name", [n for n in SEQUENTIAL if n in names()])
@settings(max_examples=50, deadline=None)
@given(ops=OPS)
def test_eviction_commits_the_plan(name: str, ops: list[Op]) -> None:
    tier = SimTier(name, CAPACITY, future=future_of(ops))
    for i, op in enumerate(ops):
        tier.clock.event_index = i
        if op[0] != "evict":
            run_one(tier, op)
            continue
        bytes_needed, protected = op[1], protected_of(tier, op[2])
        plan = tier.policy.choose_victims(bytes_needed, protected)
        while plan:
            victim, rest = plan[0], plan[1:]
            tier.evict([victim])
            check_membership(tier)
            bytes_needed -= victim.size
            after = tier.policy.choose_victims(bytes_needed, protected) if rest else []
            assert after is not None and [b.block_id for b in after] == [b.block_id for b in rest]
            plan = rest


def run_one(tier: SimTier, op: Op) -> None:
    kind, block_id = op[0], f"b{op[1]}"
    if kind == "insert" and block_id not in tier.blocks:
        tier.insert(block_id, op[2])
    elif kind == "access" and block_id in tier.blocks:
        tier.access(block_id)
    elif kind == "update" and block_id in tier.blocks:
        tier.update(block_id, priority=op[2], request_priority=op[3])
    elif kind == "remove" and block_id in tier.blocks:
        tier.remove(block_id)
