"""Apply an IntentBatch to the core: validate each event, translate it to core calls.

This is the one path from protobuf to state, shared by the live broker and replay, so the
two decide identically. An invalid event is rejected with its index, field and reason; the
rest of the batch still applies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from broker.core import Core, Directive, EventError
from kvbroker.v1 import intent_pb2 as pb
from policies.base import DROPPED, Block

_PHASES = frozenset(pb.Phase.values())
_PRIORITIES = frozenset(pb.Priority.values())
_ACK_DONE = pb.ACK_STATUS_DONE
_ACK_FAILED = pb.ACK_STATUS_FAILED
_DC = pb.PRIORITY_DECODE_CRITICAL


@dataclasses.dataclass(slots=True)
class Rejection:
    index: int
    field: str
    reason: str
    code: str = "INVALID_ARGUMENT"


@dataclasses.dataclass(slots=True)
class BatchOutcome:
    directives: list[Directive]
    rejections: list[Rejection]
    accepted: int
    duplicate: bool = False
    # False when the batch as a whole was refused (nothing applied, nothing to journal).
    applied: bool = True


def check_batch(core: Core, batch: pb.IntentBatch) -> BatchOutcome | None:
    """Batch-level checks; returns the outcome when the batch must not be applied."""
    if not batch.client_id:
        return BatchOutcome([], [Rejection(-1, "client_id", "required, a non-empty string")], 0, applied=False)
    if batch.batch_seq == 0:
        return BatchOutcome([], [Rejection(-1, "batch_seq", "must be >= 1")], 0, applied=False)
    if batch.batch_seq <= core.client_seq.get(batch.client_id, 0):
        core.stats.duplicate_batches += 1
        return BatchOutcome([], [], 0, duplicate=True, applied=False)
    return None


def apply_batch(core: Core, batch: pb.IntentBatch) -> BatchOutcome:
    """Apply one batch; the caller journals it when ``outcome.applied``."""
    refused = check_batch(core, batch)
    if refused is not None:
        return refused
    client = batch.client_id
    core.client_seq[client] = batch.batch_seq
    core.stats.batches += 1
    rejections: list[Rejection] = []
    events_seen = core.stats.events
    clock = core.clock
    for index, event in enumerate(batch.events):
        clock.event_index += 1
        kind = event.WhichOneof("kind")
        try:
            if kind is None:
                raise EventError("kind", "event has no kind set")
            if event.ts_us < 0:
                raise EventError("ts_us", f"must be >= 0, got {event.ts_us}")
            if event.ts_us > core.clock.now_us:
                # Time moved: blocks whose prefetch start time has come are promoted first.
                core.advance(event.ts_us)
                core.run_prefetch()
            _HANDLERS[kind](core, event, client)
            events_seen[kind] += 1
        except EventError as exc:
            field = exc.field if kind is None or exc.field.startswith(kind) or exc.field == "ts_us" else f"{kind}.{exc.field}"
            rejections.append(Rejection(index, field, exc.reason, exc.code))
    core.stats.rejected_events += len(rejections)
    core.run_prefetch()
    return BatchOutcome(core.take_directives(), rejections, len(batch.events) - len(rejections))


def _non_negative(intent: pb.MemoryIntent, name: str) -> int | None:
    if not intent.HasField(name):
        return None
    value: int = getattr(intent, name)
    if value < 0:
        raise EventError(f"allocated.intent.{name}", f"must be >= 0, got {value}")
    return value


def block_from_intent(core: Core, intent: pb.MemoryIntent, owner: str) -> Block:
    """Validate a MemoryIntent and build the block it describes (not yet placed)."""
    if not intent.block_id:
        raise EventError("allocated.intent.block_id", "required, a non-empty string")
    if intent.size_bytes <= 0:
        raise EventError("allocated.intent.size_bytes", "must be > 0")
    if intent.phase not in _PHASES:
        raise EventError("allocated.intent.phase", f"unknown enum value {intent.phase}")
    if intent.priority not in _PRIORITIES:
        raise EventError("allocated.intent.priority", f"unknown enum value {intent.priority}")
    block = Block(intent.block_id, intent.size_bytes, request_id=intent.request_id, tenant=intent.tenant)
    block.owner = owner
    deadline = _non_negative(intent, "deadline_us")
    slack = _non_negative(intent, "slack_us")
    block.critical = intent.priority == _DC
    block.due_us = deadline
    # Slack stays visible in an ablation: what is stripped is phase, priority and deadline.
    block.slack_us = slack
    if not core.ablate_intent:
        block.phase = intent.phase
        block.priority = intent.priority
        block.deadline_us = deadline
    block.recompute_cost_us = _non_negative(intent, "recompute_cost_us")
    block.spill_cost_us = _non_negative(intent, "spill_cost_us")
    if intent.HasField("request_priority"):
        if intent.request_priority > 100:
            raise EventError("allocated.intent.request_priority", f"must be in 0..100, got {intent.request_priority}")
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
    for i, name in enumerate(intent.allowed_tiers):
        mask |= 1 << core.resolve_tier(name, f"allocated.intent.allowed_tiers[{i}]")
    block.allowed_mask = mask
    return block


def _allocated(core: Core, event: pb.Event, client: str) -> None:
    alloc = event.allocated
    block = block_from_intent(core, alloc.intent, client)
    t = core.resolve_tier(alloc.tier, "allocated.tier", empty=0)
    core.allocate(block, t, reuse=alloc.reuse)


def _blocks(core: Core, ids: Iterable[str], field: str) -> list[Block]:
    blocks = core.blocks
    found = [blocks.get(block_id) for block_id in ids]
    if found and None not in found:
        return found  # type: ignore[return-value]
    # Slow path, to name the first bad id.
    out: list[Block] = []
    for i, block_id in enumerate(ids):
        block = blocks.get(block_id)
        if block is None:
            if not block_id:
                raise EventError(f"{field}[{i}]", "required, a non-empty string")
            raise EventError(f"{field}[{i}]", f"unknown block {block_id!r}", "FAILED_PRECONDITION")
        out.append(block)
    if not out:
        raise EventError(field, "empty: name at least one block")
    return out


def _accessed(core: Core, event: pb.Event, client: str) -> None:
    accessed = event.accessed
    next_use: int | None = None
    if accessed.HasField("next_use_us"):
        next_use = accessed.next_use_us
        if next_use < 0:
            raise EventError("accessed.next_use_us", f"must be >= 0, got {next_use}")
    core.access(_blocks(core, accessed.block_ids, "accessed.block_ids"), next_use)


def _intent_updated(core: Core, event: pb.Event, client: str) -> None:
    upd = event.intent_updated
    if not upd.block_id:
        raise EventError("intent_updated.block_id", "required, a non-empty string")
    block = core.known(upd.block_id, "intent_updated.block_id")
    phase = upd.phase if upd.HasField("phase") else None
    if phase is not None and phase not in _PHASES:
        raise EventError("intent_updated.phase", f"unknown enum value {phase}")
    priority = upd.priority if upd.HasField("priority") else None
    if priority is not None and priority not in _PRIORITIES:
        raise EventError("intent_updated.priority", f"unknown enum value {priority}")
    for name in ("deadline_us", "slack_us", "recompute_cost_us"):
        if upd.HasField(name) and getattr(upd, name) < 0:
            raise EventError(f"intent_updated.{name}", f"must be >= 0, got {getattr(upd, name)}")
    if upd.HasField("request_priority") and upd.request_priority > 100:
        raise EventError("intent_updated.request_priority", f"must be in 0..100, got {upd.request_priority}")
    core.update(block, _updater(upd, phase, priority, core.ablate_intent))


def _updater(upd: pb.IntentUpdated, phase: int | None, priority: int | None, ablate: bool) -> Callable[[Block], None]:
    def apply(block: Block) -> None:
        if priority is not None:
            block.critical = priority == _DC
        if upd.clear_deadline:
            block.due_us = None
        elif upd.HasField("deadline_us"):
            block.due_us = upd.deadline_us
        if upd.HasField("slack_us"):
            block.slack_us = upd.slack_us
        if not ablate:
            if phase is not None:
                block.phase = phase
            if priority is not None:
                block.priority = priority
            block.deadline_us = block.due_us
        if upd.HasField("recompute_cost_us"):
            block.recompute_cost_us = upd.recompute_cost_us
        if upd.HasField("pin_requested"):
            # A released block stays unpinned: only a referenced block can be pinned.
            block.pin_requested = upd.pin_requested
        if upd.HasField("is_committed"):
            block.is_committed = upd.is_committed
        if upd.HasField("is_draft"):
            block.is_draft = upd.is_draft
        if upd.HasField("expected_reuse_window_tokens"):
            block.reuse_window = upd.expected_reuse_window_tokens
        if upd.HasField("request_priority"):
            block.request_priority = upd.request_priority

    return apply


def _released(core: Core, event: pb.Event, client: str) -> None:
    core.release(_blocks(core, event.released.block_ids, "released.block_ids"))


def _freed(core: Core, event: pb.Event, client: str) -> None:
    core.free(_blocks(core, event.freed.block_ids, "freed.block_ids"))


def _cleared(core: Core, event: pb.Event, client: str) -> None:
    core.clear(client)


def _acked(core: Core, event: pb.Event, client: str) -> None:
    ack = event.acked
    if ack.status == _ACK_DONE:
        core.ack(ack.directive_id, True, DROPPED)
    elif ack.status == _ACK_FAILED:
        actual = core.resolve_tier(ack.actual_tier, "acked.actual_tier", empty=DROPPED)
        core.ack(ack.directive_id, False, actual)
    else:
        raise EventError("acked.status", f"must be ACK_STATUS_DONE or ACK_STATUS_FAILED, got {ack.status}")


_HANDLERS: dict[str, Callable[[Core, pb.Event, str], None]] = {
    "allocated": _allocated,
    "accessed": _accessed,
    "intent_updated": _intent_updated,
    "released": _released,
    "freed": _freed,
    "cleared": _cleared,
    "acked": _acked,
}
