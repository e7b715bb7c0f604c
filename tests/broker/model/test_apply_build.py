"""``block_from_event`` builds its Block slot by slot (a hot path); this checks it against
the straightforward build through ``Block``'s own constructor, on random intents, slot for
slot, and that it sets every slot (a slot added to Block and forgotten here fails)."""

from __future__ import annotations

import random
import sys

import pytest

from broker import native
from broker.model.apply import block_from_event
from broker.model.core import Core, EventError
from broker.model.wire import event_tuple
from kvbroker.v1 import intent_pb2 as pb
from policies.base import Block
from tests.conftest import small_config


def block_fields() -> tuple[str, ...]:
    """Block's slots; compiled with mypyc (broker/native.py), the class lists its fields in
    ``__mypyc_attrs__`` instead."""
    fields: tuple[str, ...] = getattr(Block, "__slots__", None) or Block.__mypyc_attrs__  # type: ignore[attr-defined]
    assert "block_id" in fields and "ready_us" in fields
    return fields


def block_from_intent(core: Core, intent: pb.MemoryIntent, owner: str) -> Block:
    """The block an ``allocated`` event with this intent builds (as apply reads it)."""
    return block_from_event(core, event_tuple(pb.Event(allocated=pb.BlockAllocated(intent=intent)), None), owner)


def reference(core: Core, intent: pb.MemoryIntent, owner: str) -> Block:
    """The build as it was written first: the constructor, then the intent's fields."""
    block = Block(intent.block_id, intent.size_bytes, request_id=intent.request_id, tenant=intent.tenant)
    block.owner = owner
    deadline = intent.deadline_us if intent.HasField("deadline_us") else None
    block.critical = intent.priority == pb.PRIORITY_DECODE_CRITICAL
    block.due_us = deadline
    if not core.ablate_intent:  # an ablation strips every field about the future
        block.slack_us = intent.slack_us if intent.HasField("slack_us") else None
        block.phase = intent.phase
        block.priority = intent.priority
        block.deadline_us = deadline
        block.recompute_cost_us = intent.recompute_cost_us if intent.HasField("recompute_cost_us") else None
        block.spill_cost_us = intent.spill_cost_us if intent.HasField("spill_cost_us") else None
        if intent.HasField("request_priority"):
            block.request_priority = intent.request_priority
        block.pin_requested = intent.pin_requested
        block.is_draft = intent.is_draft
        block.is_committed = intent.is_committed
        if intent.HasField("expected_reuse_window_tokens"):
            block.reuse_window = intent.expected_reuse_window_tokens
        block.recompute_ok = intent.recompute_ok
        block.compression_ok = intent.compression_ok
        block.prefetch_ok = intent.prefetch_ok
    block.parent_id = intent.parent_block_id
    block.layer = intent.layer
    block.head_group = intent.head_group
    block.token_start = intent.token_start
    block.token_count = intent.token_count
    mask = 0
    for name in intent.allowed_tiers:
        mask |= 1 << core.tier_index[name]
    block.allowed_mask = mask
    return block


def random_intent(rng: random.Random) -> pb.MemoryIntent:
    intent = pb.MemoryIntent(
        block_id=f"b{rng.randint(0, 99)}",
        request_id=rng.choice(("", "r1", "r2")),
        phase=rng.randint(0, 6),  # type: ignore[arg-type]
        priority=rng.randint(0, 4),  # type: ignore[arg-type]
        size_bytes=rng.randint(1, 500),
        pin_requested=rng.random() < 0.3,
        is_draft=rng.random() < 0.3,
        is_committed=rng.random() < 0.3,
        tenant=rng.choice(("", "t")),
        layer=rng.randint(0, 3),
        head_group=rng.randint(0, 3),
        token_start=rng.randint(0, 99),
        token_count=rng.randint(0, 99),
        parent_block_id=rng.choice(("", "p")),
        recompute_ok=rng.random() < 0.5,
        compression_ok=rng.random() < 0.5,
        prefetch_ok=rng.random() < 0.5,
        allowed_tiers=rng.sample(["hbm", "dram", "nvme"], rng.randint(0, 2)),
    )
    for name in ("deadline_us", "slack_us", "recompute_cost_us", "spill_cost_us", "request_priority", "expected_reuse_window_tokens"):
        if rng.random() < 0.5:
            setattr(intent, name, rng.randint(0, 100))
    return intent


@pytest.mark.parametrize("ablate", [False, True])
def test_block_from_intent_builds_what_the_constructor_builds(ablate: bool) -> None:
    core = Core(small_config().core, ablate_intent=ablate)
    rng = random.Random(5)
    for _ in range(2000):
        intent = random_intent(rng)
        got, want = block_from_intent(core, intent, "owner"), reference(core, intent, "owner")
        for slot in block_fields():
            assert hasattr(got, slot), slot
            value, expected = getattr(got, slot), getattr(want, slot)
            assert value == expected and type(value) is type(expected), (slot, value, expected)


def test_block_from_intent_names_the_first_bad_field() -> None:
    core = Core(small_config().core)
    bad = pb.MemoryIntent(block_id="b", size_bytes=1, slack_us=-1, recompute_cost_us=-2, request_priority=101)
    with pytest.raises(EventError) as info:
        block_from_intent(core, bad, "o")
    assert info.value.field == "allocated.intent.slack_us"
    bad.slack_us = 0
    with pytest.raises(EventError) as info:
        block_from_intent(core, bad, "o")
    assert info.value.field == "allocated.intent.recompute_cost_us"
    bad.recompute_cost_us = 0
    with pytest.raises(EventError) as info:
        block_from_intent(core, bad, "o")
    assert info.value.field == "allocated.intent.request_priority"


def test_blocks_share_their_request_id_and_parent_id_strings() -> None:
    """A million blocks must not carry a million copies of the same names: every block of a
    request holds one request_id string, and a chained block holds its parent's own id."""
    core = Core(small_config().core)
    # Built at run time, so each intent's fields are separate string objects to begin with.
    rid = "".join(["request-", "42"])
    first = block_from_intent(core, pb.MemoryIntent(block_id="p" * 40, size_bytes=10, request_id=rid), "e")
    core.blocks[first.block_id] = first
    parent_copy = "".join(["p" * 20, "p" * 20])
    second = block_from_intent(
        core, pb.MemoryIntent(block_id="c1", size_bytes=10, request_id="".join(["request-", "42"]), parent_block_id=parent_copy), "e"
    )
    assert second.request_id == first.request_id == rid
    assert second.request_id is first.request_id
    assert second.parent_id == first.block_id and second.parent_id is first.block_id
    # A parent the broker does not hold keeps the name as given.
    orphan = block_from_intent(core, pb.MemoryIntent(block_id="c2", size_bytes=10, parent_block_id="gone"), "e")
    assert orphan.parent_id == "gone" and orphan.request_id == ""


# Compiled, a Block is a C struct that pymalloc rounds up to a multiple of 16 bytes: each 16
# more is 16 MB at a million blocks. A slot added, or a narrow one (bool, u8, i32) put after
# the 8-byte ones, shows here (policies.base.Block.__init__ orders them).
BLOCK_BYTES = 256


@pytest.mark.skipif("policies.base" not in native.compiled(), reason="the size is the compiled struct's")
def test_a_compiled_block_stays_in_its_allocation_size() -> None:
    assert sys.getsizeof(Block("b", 1)) <= BLOCK_BYTES
