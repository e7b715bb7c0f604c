"""Objects the broker holds per block stay out of the cyclic collector (policies/_gc.c).

A full collection walks every tracked object; at a million blocks that was 250-360 ms per
collection before blocks and deadline_edf's records were untracked. These tests pin down
which objects are untracked, and that untracking loses nothing: the objects are still
freed by reference counting when the broker lets go of them.
"""

from __future__ import annotations

import gc
import sys

import pytest

from broker.model.core import Core
from policies import base
from policies.deadline_edf import DeadlineEDFPolicy
from tests.builders import Driver, alloc, free
from tests.conftest import small_config

try:
    from policies import _gc
except ImportError:  # the pure Python build: untrack is the identity there
    _gc = None  # type: ignore[assignment]

compiled_only = pytest.mark.skipif(_gc is None, reason="policies._gc is not built (KVBROKER_PURE_PYTHON=1)")


def blocks_and_records(policy: str, count: int) -> Driver:
    driver = Driver(small_config(policy))
    driver.send(*(alloc(f"b{i}", size=1, ts=i, request_id=f"r{i % 3}") for i in range(count)))
    return driver


@compiled_only
@pytest.mark.parametrize("policy", ["lru", "deadline_edf"])
def test_blocks_and_their_request_lists_are_not_tracked(policy: str) -> None:
    core = blocks_and_records(policy, 30).core
    assert len(core.blocks) == 30
    assert not any(gc.is_tracked(block) for block in core.blocks.values())
    assert core.by_request and not any(gc.is_tracked(e) or gc.is_tracked(e.ids) for e in core.by_request.values())
    # The dicts that hold them are tracked as before: they are what the broker mutates.
    assert gc.is_tracked(core.blocks)


@compiled_only
def test_deadline_edf_records_are_not_tracked() -> None:
    core = blocks_and_records("deadline_edf", 20).core
    policy = core.tiers[0].policy
    assert isinstance(policy, DeadlineEDFPolicy)
    records = list(policy._held.values())
    assert len(records) == sum(1 for b in core.blocks.values() if b.tier == 0) > 0
    assert not any(gc.is_tracked(record) for record in records)


@compiled_only
def test_untrack_returns_its_argument_and_leaves_atoms_alone() -> None:
    items: list[int] = [1, 2]
    assert gc.is_tracked(items)
    assert base.untrack(items) is items and not gc.is_tracked(items)
    # Objects the collector never tracks pass through unchanged.
    for atom in (1, "s", None):
        assert base.untrack(atom) is atom


def test_freed_blocks_are_released_by_reference_counting() -> None:
    """Untracked blocks are freed when the broker drops them, with no collection at all."""
    driver = blocks_and_records("deadline_edf", 40)
    core: Core = driver.core
    block = core.blocks["b7"]
    # The core's dict and this local hold it (getrefcount counts its own argument too);
    # deadline_edf's record holds it while the block is in HBM.
    held = sys.getrefcount(block)
    assert held >= 3
    gc.disable()
    try:
        driver.send(*(free(f"b{i}") for i in range(40)))
        assert not core.blocks and not core.by_request
        assert sys.getrefcount(block) == 2  # this local and the argument: nothing leaked
    finally:
        gc.enable()
