"""Apply an IntentBatch to the core: validate each event, translate it to core calls.

This is the one path from protobuf to state, shared by the live broker and replay, so the
two decide identically. An invalid event is rejected with its index, field and reason; the
rest of the batch still applies.

Tenants: a batch with ``IntentBatch.tenant`` set (the broker sets it from the stream's
bearer token before applying and journaling it) acts for that tenant only. Its allocations
belong to the tenant, and any event that touches another tenant's block (access, update,
release, free, ack, prefix or shared reuse) is rejected with PERMISSION_DENIED, naming the
field and no detail of the other block. Tenants have separate client id spaces
(``client_key``). All of it is decided from the journaled batch and the core's state, so
replay and recovery decide the same.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable

from broker.core import Core, Directive, EventError
from broker.limits import count_block, tenant_counts, tenant_full
from kvbroker.v1 import intent_pb2 as pb
from policies.base import DEFAULT_REQUEST_PRIORITY, DROPPED, Block, Phase, Priority

# An empty Block, every slot set below (Block.__new__ is object.__new__ when interpreted).
_new_block = Block.__new__
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


OTHER_TENANT = "the block belongs to another tenant"
_intern = sys.intern


def client_key(tenant: str, client_id: str) -> str:
    """The core's name for a client (its batch_seq, the owner of its blocks): tenants have
    separate client id spaces, so one tenant's "engine-0" is not another's."""
    return f"{tenant}\x00{client_id}" if tenant else client_id


def check_batch(core: Core, batch: pb.IntentBatch) -> BatchOutcome | None:
    """Batch-level checks; returns the outcome when the batch must not be applied."""
    if not batch.client_id:
        return BatchOutcome([], [Rejection(-1, "client_id", "required, a non-empty string")], 0, applied=False)
    if batch.batch_seq == 0:
        return BatchOutcome([], [Rejection(-1, "batch_seq", "must be >= 1")], 0, applied=False)
    if batch.batch_seq <= core.client_seq.get(client_key(batch.tenant, batch.client_id), 0):
        core.stats.duplicate_batches += 1
        return BatchOutcome([], [], 0, duplicate=True, applied=False)
    return None


def apply_batch(core: Core, batch: pb.IntentBatch) -> BatchOutcome:
    """Apply one batch; the caller journals it when ``outcome.applied``."""
    refused = check_batch(core, batch)
    if refused is not None:
        return refused
    tenant = batch.tenant
    client = client_key(tenant, batch.client_id)
    core.client_seq[client] = batch.batch_seq
    core.stats.batches += 1
    rejections: list[Rejection] = []
    events_seen = core.stats.events
    clock = core.clock
    handlers = _HANDLERS
    for index, event in enumerate(batch.events):
        clock.event_index += 1
        kind = event.WhichOneof("kind")
        try:
            if kind is None:
                raise EventError("kind", "event has no kind set")
            ts_us = event.ts_us
            if ts_us < 0:
                raise EventError("ts_us", f"must be >= 0, got {ts_us}")
            if ts_us > clock.now_us:  # (advance checks it too; most events share a time)
                core.advance(ts_us)
            handlers[kind](core, event, client, tenant)
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
    """Validate a MemoryIntent and build the block it describes (not yet placed).

    Every field is read once (a protobuf field read costs as much as several plain
    attribute reads); the checks run in a fixed order, so the first bad field is named."""
    block_id = intent.block_id
    if not block_id:
        raise EventError("allocated.intent.block_id", "required, a non-empty string")
    size = intent.size_bytes
    if size <= 0:
        raise EventError("allocated.intent.size_bytes", "must be > 0")
    phase = intent.phase
    if phase not in _PHASES:
        raise EventError("allocated.intent.phase", f"unknown enum value {phase}")
    priority = intent.priority
    if priority not in _PRIORITIES:
        raise EventError("allocated.intent.priority", f"unknown enum value {priority}")
    has = intent.HasField
    deadline = _non_negative(intent, "deadline_us") if has("deadline_us") else None
    slack = _non_negative(intent, "slack_us") if has("slack_us") else None
    recompute_cost = _non_negative(intent, "recompute_cost_us") if has("recompute_cost_us") else None
    spill_cost = _non_negative(intent, "spill_cost_us") if has("spill_cost_us") else None
    request_priority = DEFAULT_REQUEST_PRIORITY
    if has("request_priority"):
        request_priority = intent.request_priority
        if request_priority > 100:
            raise EventError("allocated.intent.request_priority", f"must be in 0..100, got {request_priority}")
    # Block(block_id, size, ...) and then its fields, as one pass over its slots (every slot
    # is set here, once: test_apply_build checks it against Block's own constructor).
    block = _new_block(Block)
    block.block_id = block_id
    block.owner = owner
    # Interned: every block of a request (and core.by_request's key) shares one string, not
    # a copy each (the memory benchmark counts ~60 bytes a block for the copies).
    request_id = intent.request_id
    block.request_id = _intern(request_id) if request_id else ""
    tenant = intent.tenant
    block.tenant = _intern(tenant) if tenant else ""
    block.size = size
    block.tier = DROPPED
    block.pin_requested = intent.pin_requested
    block.released = False
    block.refs = 1
    block.pinned = False
    if core.ablate_intent:
        block.priority = Priority.UNSPECIFIED
        block.phase = Phase.UNSPECIFIED
        block.deadline_us = None
    else:
        block.priority = priority
        block.phase = phase
        block.deadline_us = deadline
    # Slack stays visible in an ablation: what is stripped is phase, priority and deadline.
    block.slack_us = slack
    block.recompute_cost_us = recompute_cost
    block.spill_cost_us = spill_cost
    block.request_priority = request_priority
    block.is_draft = intent.is_draft
    block.is_committed = intent.is_committed
    block.reuse_window = intent.expected_reuse_window_tokens if has("expected_reuse_window_tokens") else None
    block.recompute_ok = intent.recompute_ok
    block.compression_ok = intent.compression_ok
    block.prefetch_ok = intent.prefetch_ok
    parent_id = intent.parent_block_id
    if parent_id:
        parent = core.blocks.get(parent_id)
        if parent is not None:
            parent_id = parent.block_id  # the parent's own string, not a second copy of it
    block.parent_id = parent_id
    block.children = 0
    block.reuses = 0
    block.critical = priority == _DC
    block.due_us = deadline
    block.allowed_mask = 0
    block.created_us = 0
    block.last_access_us = 0
    block.accesses = 0
    block.layer = intent.layer
    block.head_group = intent.head_group
    block.token_start = intent.token_start
    block.token_count = intent.token_count
    block.heap_version = 0
    block.ready_us = 0
    allowed = intent.allowed_tiers
    if allowed:
        mask = 0
        for i, name in enumerate(allowed):
            mask |= 1 << core.resolve_tier(name, f"allocated.intent.allowed_tiers[{i}]")
        block.allowed_mask = mask
    return block


def _allocated(core: Core, event: pb.Event, client: str, tenant: str) -> None:
    alloc = event.allocated
    intent = alloc.intent
    if tenant and intent.tenant and intent.tenant != tenant:
        raise EventError("allocated.intent.tenant", "must be empty or the stream's tenant", "PERMISSION_DENIED")
    block = block_from_intent(core, intent, client)
    if tenant:
        block.tenant = _intern(tenant)
    existing = core.blocks.get(block.block_id)
    if tenant and existing is not None and existing.tenant != tenant:
        raise EventError("allocated.intent.block_id", OTHER_TENANT, "PERMISSION_DENIED")
    tier_name = alloc.tier
    t = core.resolve_tier(tier_name, "allocated.tier", empty=0) if tier_name else 0
    counts = tenant_counts(core)
    if counts is None:
        core.allocate(block, t, reuse=alloc.reuse)
        return
    # A new block, or prefix reuse that moves a cached block to this tenant, adds one.
    before = None if existing is None else existing.tenant
    if block.tenant and before != block.tenant and (existing is None or existing.released):
        refusal = tenant_full(counts, block.tenant, core.config.max_blocks_per_tenant)
        if refusal is not None:
            raise EventError("allocated.intent.tenant", refusal, "RESOURCE_EXHAUSTED")
    core.allocate(block, t, reuse=alloc.reuse)
    after = core.blocks[block.block_id].tenant
    if before != after:
        if before is not None:
            count_block(counts, before, -1)
        count_block(counts, after, 1)


def _blocks(core: Core, ids: Iterable[str], field: str) -> list[Block]:
    blocks = core.blocks
    found = list(map(blocks.get, ids))
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


def _own(blocks: list[Block], tenant: str, field: str) -> list[Block]:
    """``blocks`` if every one is the tenant's (always, for a batch with no tenant)."""
    if tenant:
        for i, block in enumerate(blocks):
            if block.tenant != tenant:
                raise EventError(f"{field}[{i}]", OTHER_TENANT, "PERMISSION_DENIED")
    return blocks


def _accessed(core: Core, event: pb.Event, client: str, tenant: str) -> None:
    accessed = event.accessed
    next_use: int | None = None
    if accessed.HasField("next_use_us"):
        next_use = accessed.next_use_us
        if next_use < 0:
            raise EventError("accessed.next_use_us", f"must be >= 0, got {next_use}")
    blocks = _blocks(core, accessed.block_ids, "accessed.block_ids")
    core.access(_own(blocks, tenant, "accessed.block_ids") if tenant else blocks, next_use)


def _intent_updated(core: Core, event: pb.Event, client: str, tenant: str) -> None:
    upd = event.intent_updated
    if not upd.block_id:
        raise EventError("intent_updated.block_id", "required, a non-empty string")
    block = core.known(upd.block_id, "intent_updated.block_id")
    if tenant and block.tenant != tenant:
        raise EventError("intent_updated.block_id", OTHER_TENANT, "PERMISSION_DENIED")
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


def _released(core: Core, event: pb.Event, client: str, tenant: str) -> None:
    core.release(_own(_blocks(core, event.released.block_ids, "released.block_ids"), tenant, "released.block_ids"))


def _freed(core: Core, event: pb.Event, client: str, tenant: str) -> None:
    blocks = _own(_blocks(core, event.freed.block_ids, "freed.block_ids"), tenant, "freed.block_ids")
    counts = tenant_counts(core)
    core.free(blocks)
    if counts is not None:
        _uncount(counts, blocks)


def _uncount(counts: dict[str, int], blocks: list[Block]) -> None:
    """Blocks that were freed leave their tenant's count (each once)."""
    for block in {id(b): b for b in blocks}.values():
        count_block(counts, block.tenant, -1)


def _cleared(core: Core, event: pb.Event, client: str, tenant: str) -> None:
    # Only the client's own blocks go, and a tenant's client ids are its own (client_key).
    counts = tenant_counts(core)
    gone = core.clear(client)
    if counts is not None:
        _uncount(counts, gone)


def _acked(core: Core, event: pb.Event, client: str, tenant: str) -> None:
    ack = event.acked
    if tenant:
        block_id = core.outstanding.get(ack.directive_id)
        block = core.blocks.get(block_id) if block_id is not None else None
        if block is not None and block.tenant != tenant:
            raise EventError("acked.directive_id", "the directive is for a block of another tenant", "PERMISSION_DENIED")
    if ack.status == _ACK_DONE:
        core.ack(ack.directive_id, True, DROPPED)
    elif ack.status == _ACK_FAILED:
        actual = core.resolve_tier(ack.actual_tier, "acked.actual_tier", empty=DROPPED)
        core.ack(ack.directive_id, False, actual)
    else:
        raise EventError("acked.status", f"must be ACK_STATUS_DONE or ACK_STATUS_FAILED, got {ack.status}")


_HANDLERS: dict[str, Callable[[Core, pb.Event, str, str], None]] = {
    "allocated": _allocated,
    "accessed": _accessed,
    "intent_updated": _intent_updated,
    "released": _released,
    "freed": _freed,
    "cleared": _cleared,
    "acked": _acked,
}
