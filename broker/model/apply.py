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
from typing import Any, Final

from broker.model.core import Core, Directive, EventError
from broker.model.tenants import count_block, tenant_counts, tenant_full
from broker.model.wire import (
    A_ALLOWED_TIERS,
    A_BLOCK_ID,
    A_COMPRESSION_OK,
    A_DEADLINE,
    A_HEAD_GROUP,
    A_IS_COMMITTED,
    A_IS_DRAFT,
    A_LAYER,
    A_PARENT_ID,
    A_PHASE,
    A_PIN_REQUESTED,
    A_PREFETCH_OK,
    A_PRIORITY,
    A_RECOMPUTE_COST,
    A_RECOMPUTE_OK,
    A_REQUEST_ID,
    A_REQUEST_PRIORITY,
    A_REUSE,
    A_REUSE_WINDOW,
    A_SCOPE,
    A_SIZE,
    A_SLACK,
    A_SPILL_COST,
    A_TENANT,
    A_TIER,
    A_TOKEN_COUNT,
    A_TOKEN_START,
    ACCESSED,
    ALLOCATED,
    CLEARED,
    EVICTION,
    FREED,
    KIND_NAMES,
    NONE,
    RELEASED,
    U_BLOCK_ID,
    U_CLEAR_DEADLINE,
    U_DEADLINE,
    U_IS_COMMITTED,
    U_IS_DRAFT,
    U_PHASE,
    U_PIN_REQUESTED,
    U_PRIORITY,
    U_RECOMPUTE_COST,
    U_REQUEST_PRIORITY,
    U_REUSE_WINDOW,
    U_SLACK,
    UPDATED,
    X_ENDS_SCOPE,
    X_POSITIONS,
    X_REFRESH_ONLY,
    X_SCOPE,
    BatchReader,
    read_batch,
)
from kvbroker.v1 import intent_pb2 as pb
from policies.base import DEFAULT_REQUEST_PRIORITY, DROPPED, Block, Phase, Priority, extra_fields, untrack

# An empty Block, every slot set below (Block.__new__ is object.__new__ when interpreted).
# Final: compiled, a module constant is a C static, not a lookup in the module's globals.
_new_block: Final = Block.__new__
_PHASES: Final = frozenset(pb.Phase.values())
_PRIORITIES: Final = frozenset(pb.Priority.values())
_ACK_DONE: Final = int(pb.ACK_STATUS_DONE)
_ACK_FAILED: Final = int(pb.ACK_STATUS_FAILED)
_DC: Final = int(pb.PRIORITY_DECODE_CRITICAL)


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


OTHER_TENANT: Final = "the block belongs to another tenant"
_intern: Final = sys.intern


def client_key(tenant: str, client_id: str) -> str:
    """The core's name for a client (its batch_seq, the owner of its blocks): tenants have
    separate client id spaces, so one tenant's "engine-0" is not another's."""
    return f"{tenant}\x00{client_id}" if tenant else client_id


def count_tenant(core: Core, tenant: str, client_id: str) -> None:
    """A client id acts for ``tenant`` for the first time (Core.client_tenants)."""
    core.client_tenants[client_id] = core.client_tenants.get(client_id, 0) + 1
    core.tenant_clients[tenant] = core.tenant_clients.get(tenant, 0) + 1


def check_batch(core: Core, client_id: str, batch_seq: int, tenant: str) -> BatchOutcome | None:
    """Batch-level checks; returns the outcome when the batch must not be applied."""
    if not client_id:
        return BatchOutcome([], [Rejection(-1, "client_id", "required, a non-empty string")], 0, applied=False)
    if batch_seq == 0:
        return BatchOutcome([], [Rejection(-1, "batch_seq", "must be >= 1")], 0, applied=False)
    if batch_seq <= core.client_seq.get(client_key(tenant, client_id), 0):
        core.stats.duplicate_batches += 1
        return BatchOutcome([], [], 0, duplicate=True, applied=False)
    return None


def apply_batch(core: Core, batch: BatchReader | pb.IntentBatch | bytes) -> BatchOutcome:
    """Apply one batch (read by ``broker.model.wire.read_batch``, or serialized as the broker
    receives and journals it, or a message); the caller journals it when
    ``outcome.applied``. Bytes that do not parse raise protobuf's DecodeError, before
    anything is applied."""
    reader = read_batch(batch) if isinstance(batch, (bytes, pb.IntentBatch)) else batch
    tenant: str = reader.tenant
    refused = check_batch(core, reader.client_id, reader.batch_seq, tenant)
    if refused is not None:
        return refused
    client = client_key(tenant, reader.client_id)
    if tenant and client not in core.client_seq:
        count_tenant(core, tenant, reader.client_id)
    core.client_seq[client] = reader.batch_seq
    core.stats.batches += 1
    rejections: list[Rejection] = []
    clock = core.clock
    index = 0
    # Applied events by kind, counted in native ints and added to stats.events once per
    # batch: a dict item bumped per event (its name looked up, a boxed add, the item set)
    # was 6% of apply_batch's instructions on the bench workload.
    accessed = updated = allocated = released = freed = cleared = acked = evictions = 0
    # Declared: the reader is a protocol, and compiled, an event of unknown type was indexed
    # by a generic getitem (ev[0], ev[1]), a tuple is indexed directly.
    ev: tuple[Any, ...]
    # limits.max_clock_skew_us, against the time the broker received the batch (0: a batch
    # the broker did not stamp, such as an imported trace: no bound).
    received: int = reader.received_us
    skew: int = core.config.max_clock_skew_us if received else 0
    try:
        for ev in reader.events(core.blocks):
            clock.event_index += 1
            kind: int = ev[0]
            try:
                if kind == NONE:
                    raise EventError("kind", "event has no kind set")
                ts_us: int = ev[1]
                if ts_us < 0:
                    raise EventError("ts_us", f"must be >= 0, got {ts_us}")
                # Each event is validated before it moves the clock (``_at``): a rejected
                # event leaves time where it was.
                if ts_us > clock.now_us and skew:
                    _check_skew(core, ts_us, received, skew, tenant)
                if kind == ACCESSED:
                    _accessed(core, ev, client, tenant, ts_us, received)
                    accessed += 1
                elif kind == UPDATED:
                    _intent_updated(core, ev, tenant, ts_us, received)
                    updated += 1
                elif kind == ALLOCATED:
                    _allocated(core, ev, client, tenant, ts_us, received)
                    allocated += 1
                elif kind == RELEASED:
                    blocks = _own(_blocks(core, ev[2], ev[3], "released.block_ids"), tenant, "released.block_ids")
                    _at(core, ts_us, received, tenant)
                    core.release(blocks)
                    released += 1
                elif kind == FREED:
                    _freed(core, ev, tenant, ts_us, received)
                    freed += 1
                elif kind == CLEARED:
                    _at(core, ts_us, received, tenant)
                    _cleared(core, client)
                    cleared += 1
                elif kind == EVICTION:
                    _eviction_requested(core, ev, tenant, ts_us, received)
                    evictions += 1
                else:
                    _acked(core, ev, tenant, ts_us, received)
                    acked += 1
            except EventError as exc:
                name = KIND_NAMES[kind]
                field = exc.field if kind == NONE or exc.field.startswith(name) or exc.field == "ts_us" else f"{name}.{exc.field}"
                rejections.append(Rejection(index, field, exc.reason, exc.code))
            index += 1
    finally:  # also when a batch stops on an error that is not the event's: what was applied counts
        seen = core.stats.events
        counts = (allocated, accessed, updated, released, freed, cleared, acked, evictions)  # kinds ALLOCATED .. EVICTION
        for name, count in zip(KIND_NAMES[ALLOCATED:], counts, strict=True):
            if count:
                seen[name] += count
    core.stats.rejected_events += len(rejections)
    core.run_prefetch()
    return BatchOutcome(core.take_directives(), rejections, index - len(rejections))


def _check_skew(core: Core, ts_us: int, received: int, skew: int, tenant: str) -> None:
    """Refuse an event whose time runs more than ``skew`` ahead of its tenant's pace.

    Time is one clock per broker (every policy orders every tenant's blocks against it),
    and only events move it. What bounds a jump is the broker's receive time, stamped in
    each batch it journals: a tenant's events keep the least lead over it they have shown
    (``Core.time_anchor``), and may run at most ``skew`` beyond that. A tenant's first
    event is held to the least anchor of any tenant (the first event of all sets it).
    Deterministic: replay reads the same stamps."""
    anchors = core.time_anchor
    anchor = anchors.get(tenant)
    if anchor is None:
        if not anchors:
            return
        anchor = core.least_anchor
    ahead = ts_us - received - anchor
    if ahead > skew:
        raise EventError(
            "ts_us",
            f"{ts_us} runs {ahead} us ahead of the broker's clock, over limits.max_clock_skew_us = {skew}; "
            "event time must follow the time the events happen (one clock per broker)",
        )


def _at(core: Core, ts_us: int, received: int, tenant: str) -> None:
    """An event that passed its checks happens at ``ts_us``: move the clock there (never
    back), and learn its tenant's lead over the broker's receive time."""
    if ts_us > core.clock.now_us:
        if received:
            lead = ts_us - received
            anchors = core.time_anchor
            anchor = anchors.get(tenant)
            if anchor is None or lead < anchor:
                if not anchors or lead < core.least_anchor:
                    core.least_anchor = lead
                anchors[tenant] = lead
        core.advance(ts_us)


def _non_negative(value: int | None, field: str) -> int | None:
    if value is not None and value < 0:
        raise EventError(field, f"must be >= 0, got {value}")
    return value


def block_from_event(core: Core, ev: tuple[Any, ...], owner: str) -> Block:
    """Validate an ``allocated`` event's MemoryIntent (broker.model.wire's tuple) and build the
    block it describes (not yet placed). The checks run in a fixed order, so the first bad
    field is named."""
    block_id: str = ev[A_BLOCK_ID]
    if not block_id:
        raise EventError("allocated.intent.block_id", "required, a non-empty string")
    size: int = ev[A_SIZE]
    if size <= 0:
        raise EventError("allocated.intent.size_bytes", "must be > 0")
    phase: int = ev[A_PHASE]
    if phase not in _PHASES:
        raise EventError("allocated.intent.phase", f"unknown enum value {phase}")
    priority: int = ev[A_PRIORITY]
    if priority not in _PRIORITIES:
        raise EventError("allocated.intent.priority", f"unknown enum value {priority}")
    deadline = _non_negative(ev[A_DEADLINE], "allocated.intent.deadline_us")
    slack = _non_negative(ev[A_SLACK], "allocated.intent.slack_us")
    recompute_cost = _non_negative(ev[A_RECOMPUTE_COST], "allocated.intent.recompute_cost_us")
    spill_cost = _non_negative(ev[A_SPILL_COST], "allocated.intent.spill_cost_us")
    request_priority: int | None = ev[A_REQUEST_PRIORITY]
    if request_priority is None:
        request_priority = DEFAULT_REQUEST_PRIORITY
    elif request_priority > 100:
        raise EventError("allocated.intent.request_priority", f"must be in 0..100, got {request_priority}")
    # Block(block_id, size, ...) and then its fields, as one pass over its slots (every slot
    # is set here, once: test_apply_build checks it against Block's own constructor).
    block = _new_block(Block)
    block.block_id = block_id
    block.owner = owner
    # Interned: every block of a request (and core.by_request's key) shares one string, not
    # a copy each (the memory benchmark counts ~60 bytes a block for the copies).
    request_id: str = ev[A_REQUEST_ID]
    block.request_id = _intern(request_id) if request_id else ""
    tenant: str = ev[A_TENANT]
    block.tenant = _intern(tenant) if tenant else ""
    block.size = size
    block.tier = DROPPED
    block.released = False
    block.refs = 1
    block.pinned = False
    if core.ablate_intent:
        # Everything the engine asserts about the block's future (docs/deadlines.md lists
        # it): the policies see identity, size, chain, tiers and the events themselves.
        block.pin_requested = False
        block.priority = Priority.UNSPECIFIED
        block.phase = Phase.UNSPECIFIED
        block.deadline_us = None
        block.slack_us = None
        block.recompute_cost_us = None
        block.request_priority = DEFAULT_REQUEST_PRIORITY
        block.is_draft = False
        block.is_committed = False
        block.reuse_window = None
        block.recompute_ok = False
        block.compression_ok = False
        block.prefetch_ok = False
        spill_cost = None
        core.hidden[block_id] = (slack, recompute_cost)
    else:
        block.pin_requested = ev[A_PIN_REQUESTED]
        block.priority = priority
        block.phase = phase
        block.deadline_us = deadline
        block.slack_us = slack
        block.recompute_cost_us = recompute_cost
        block.request_priority = request_priority
        block.is_draft = ev[A_IS_DRAFT]
        block.is_committed = ev[A_IS_COMMITTED]
        block.reuse_window = ev[A_REUSE_WINDOW]
        block.recompute_ok = ev[A_RECOMPUTE_OK]
        block.compression_ok = ev[A_COMPRESSION_OK]
        block.prefetch_ok = ev[A_PREFETCH_OK]
    parent_id: str = ev[A_PARENT_ID]
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
    block.extra = extra_fields(ev[A_LAYER], ev[A_HEAD_GROUP], spill_cost)
    block.token_start = ev[A_TOKEN_START]
    block.token_count = ev[A_TOKEN_COUNT]
    block.heap_version = 0
    block.ready_us = 0
    allowed: tuple[str, ...] = ev[A_ALLOWED_TIERS]
    if allowed:
        mask = 0
        for i, name in enumerate(allowed):
            mask |= 1 << core.resolve_tier(name, f"allocated.intent.allowed_tiers[{i}]")
        block.allowed_mask = mask
    # A Block holds str, int and a tuple of ints only: never on a cycle (policies/_gc.c).
    return untrack(block)


def _allocated(core: Core, ev: tuple[Any, ...], client: str, tenant: str, ts_us: int, received: int) -> None:
    intent_tenant: str = ev[A_TENANT]
    if tenant and intent_tenant and intent_tenant != tenant:
        raise EventError("allocated.intent.tenant", "must be empty or the stream's tenant", "PERMISSION_DENIED")
    block = block_from_event(core, ev, client)
    if tenant:
        block.tenant = _intern(tenant)
    existing = core.blocks.get(block.block_id)
    if tenant and existing is not None and existing.tenant != tenant:
        raise EventError("allocated.intent.block_id", OTHER_TENANT, "PERMISSION_DENIED")
    tier_name: str = ev[A_TIER]
    t = core.resolve_tier(tier_name, "allocated.tier", empty=0) if tier_name else 0
    reuse: bool = ev[A_REUSE]
    scope: str = ev[A_SCOPE]
    counts = tenant_counts(core)
    if counts is None:
        _at(core, ts_us, received, tenant)
        core.allocate(block, t, reuse=reuse)
        if scope:
            core.open_scope((client, scope), tenant)
            core.place_scoped(block.block_id, (client, scope), block.token_start)
        return
    # A new block, or prefix reuse that moves a cached block to this tenant, adds one.
    before = None if existing is None else existing.tenant
    if block.tenant and before != block.tenant and (existing is None or existing.released):
        refusal = tenant_full(counts, block.tenant, core.config.max_blocks_per_tenant)
        if refusal is not None:
            raise EventError("allocated.intent.tenant", refusal, "RESOURCE_EXHAUSTED")
    _at(core, ts_us, received, tenant)
    core.allocate(block, t, reuse=reuse)
    if scope:
        core.open_scope((client, scope), tenant)
        core.place_scoped(block.block_id, (client, scope), block.token_start)
    after = core.blocks[block.block_id].tenant
    if before != after:
        if before is not None:
            count_block(counts, before, -1)
        count_block(counts, after, 1)


def _blocks(core: Core, found: list[Block] | None, ids: list[str] | None, field: str) -> list[Block]:
    """The blocks an event names: as the reader found them, or, when one is unknown (or
    none is named), the error naming the first bad id."""
    if found is not None:
        return found
    assert ids is not None
    blocks = core.blocks
    for i, block_id in enumerate(ids):
        if block_id not in blocks:
            if not block_id:
                raise EventError(f"{field}[{i}]", "required, a non-empty string")
            raise EventError(f"{field}[{i}]", f"unknown block {block_id!r}", "FAILED_PRECONDITION")
    if not ids:
        raise EventError(field, "empty: name at least one block")
    return [blocks[block_id] for block_id in ids]


def _own(blocks: list[Block], tenant: str, field: str) -> list[Block]:
    """``blocks`` if every one is the tenant's (always, for a batch with no tenant)."""
    if tenant:
        for i, block in enumerate(blocks):
            if block.tenant != tenant:
                raise EventError(f"{field}[{i}]", OTHER_TENANT, "PERMISSION_DENIED")
    return blocks


def _accessed(core: Core, ev: tuple[Any, ...], client: str, tenant: str, ts_us: int, received: int) -> None:
    next_use: int | None = ev[2]
    if next_use is not None and next_use < 0:
        raise EventError("accessed.next_use_us", f"must be >= 0, got {next_use}")
    scope: str = ev[X_SCOPE]
    ends: str = ev[X_ENDS_SCOPE]
    refresh: bool = ev[X_REFRESH_ONLY]
    if not scope and not ends and not refresh:
        blocks = _blocks(core, ev[3], ev[4], "accessed.block_ids")
        if ev[X_POSITIONS]:
            raise EventError("accessed.token_positions", "only with a scope")
        if tenant:
            _own(blocks, tenant, "accessed.block_ids")
        if ts_us > core.clock.now_us:
            _at(core, ts_us, received, tenant)
        core.access(blocks, next_use)
        return
    # A request-scoped use, a refresh, or a scope's end (then block_ids may be empty).
    found: list[Block] | None = ev[3]
    ids: list[str] | None = ev[4]
    blocks = _blocks(core, found, ids, "accessed.block_ids") if found is not None or ids or not (scope or ends) else []
    if refresh and scope:
        raise EventError("accessed.refresh_only", "not with a scope (a scoped use ranks the blocks)")
    if refresh and next_use is not None:
        raise EventError("accessed.refresh_only", "not with next_use_us (a refresh is not a step's read)")
    if tenant:
        _own(blocks, tenant, "accessed.block_ids")
    at: list[int] = ev[X_POSITIONS]
    if scope and len(at) != len(blocks):
        raise EventError("accessed.token_positions", f"one per block id: {len(at)} for {len(blocks)} block ids")
    if not scope and at:
        raise EventError("accessed.token_positions", "only with a scope")
    if ts_us > core.clock.now_us:
        _at(core, ts_us, received, tenant)
    if scope:
        core.open_scope((client, scope), tenant)  # counted against the client's and its tenant's caps
        positions = {block.block_id: position for block, position in zip(blocks, at, strict=True)}
        core.access(blocks, next_use, (client, scope), positions)
    elif refresh:
        core.refresh(blocks)
    elif blocks:
        core.access(blocks, next_use)
    if ends:
        core.end_scope((client, ends))


def _intent_updated(core: Core, ev: tuple[Any, ...], tenant: str, ts_us: int, received: int) -> None:
    block_id: str = ev[U_BLOCK_ID]
    if not block_id:
        raise EventError("intent_updated.block_id", "required, a non-empty string")
    block = core.known(block_id, "intent_updated.block_id")
    if tenant and block.tenant != tenant:
        raise EventError("intent_updated.block_id", OTHER_TENANT, "PERMISSION_DENIED")
    phase: int | None = ev[U_PHASE]
    if phase is not None and phase not in _PHASES:
        raise EventError("intent_updated.phase", f"unknown enum value {phase}")
    priority: int | None = ev[U_PRIORITY]
    if priority is not None and priority not in _PRIORITIES:
        raise EventError("intent_updated.priority", f"unknown enum value {priority}")
    # One call each, not a loop over (name, value) pairs: compiled, the loop built four
    # tuples and an iterator per update (3% of apply_batch on the bench workload).
    deadline = _non_negative(ev[U_DEADLINE], "intent_updated.deadline_us")
    slack = _non_negative(ev[U_SLACK], "intent_updated.slack_us")
    recompute_cost = _non_negative(ev[U_RECOMPUTE_COST], "intent_updated.recompute_cost_us")
    request_priority: int | None = ev[U_REQUEST_PRIORITY]
    if request_priority is not None and request_priority > 100:
        raise EventError("intent_updated.request_priority", f"must be in 0..100, got {request_priority}")
    _at(core, ts_us, received, tenant)
    was_pinned = block.pinned
    old_deadline = block.deadline_us
    if priority is not None:
        block.critical = priority == _DC
    if ev[U_CLEAR_DEADLINE]:
        block.due_us = None
    elif deadline is not None:
        block.due_us = deadline
    if core.ablate_intent:
        # Only what reports measure against (critical, due_us, slack, recompute cost)
        # follows the engine; the policies see none of it (see block_from_event).
        said = core.hidden.get(block.block_id, (None, None))
        core.hidden[block.block_id] = (said[0] if slack is None else slack, said[1] if recompute_cost is None else recompute_cost)
        core.updated(block, was_pinned, old_deadline)
        return
    if slack is not None:
        block.slack_us = slack
    if phase is not None:
        block.phase = phase
    if priority is not None:
        block.priority = priority
    block.deadline_us = block.due_us
    if recompute_cost is not None:
        block.recompute_cost_us = recompute_cost
    pin_requested: bool | None = ev[U_PIN_REQUESTED]
    if pin_requested is not None:
        # A released block stays unpinned: only a referenced block can be pinned.
        block.pin_requested = pin_requested
    is_committed: bool | None = ev[U_IS_COMMITTED]
    if is_committed is not None:
        block.is_committed = is_committed
    is_draft: bool | None = ev[U_IS_DRAFT]
    if is_draft is not None:
        block.is_draft = is_draft
    reuse_window: int | None = ev[U_REUSE_WINDOW]
    if reuse_window is not None:
        block.reuse_window = reuse_window
    if request_priority is not None:
        block.request_priority = request_priority
    core.updated(block, was_pinned, old_deadline)


def _freed(core: Core, ev: tuple[Any, ...], tenant: str, ts_us: int, received: int) -> None:
    blocks = _own(_blocks(core, ev[2], ev[3], "freed.block_ids"), tenant, "freed.block_ids")
    _at(core, ts_us, received, tenant)
    counts = tenant_counts(core)
    core.free(blocks)
    if counts is not None:
        _uncount(counts, blocks)


def _uncount(counts: dict[str, int], blocks: list[Block]) -> None:
    """Blocks that were freed leave their tenant's count (each once)."""
    for block in {id(b): b for b in blocks}.values():
        count_block(counts, block.tenant, -1)


def _cleared(core: Core, client: str) -> None:
    # Only the client's own blocks go, and a tenant's client ids are its own (client_key).
    counts = tenant_counts(core)
    gone = core.clear(client)
    if counts is not None:
        _uncount(counts, gone)


def _acked(core: Core, ev: tuple[Any, ...], tenant: str, ts_us: int, received: int) -> None:
    directive_id: int = ev[2]
    status: int = ev[3]
    if tenant:
        block_id = core.outstanding.get(directive_id)
        block = core.blocks.get(block_id) if block_id is not None else None
        if block is not None and block.tenant != tenant:
            raise EventError("acked.directive_id", "the directive is for a block of another tenant", "PERMISSION_DENIED")
    if status == _ACK_DONE:
        actual = DROPPED
    elif status == _ACK_FAILED:
        actual = core.resolve_tier(ev[4], "acked.actual_tier", empty=DROPPED)
    else:
        raise EventError("acked.status", f"must be ACK_STATUS_DONE or ACK_STATUS_FAILED, got {status}")
    if directive_id not in core.outstanding:  # core.ack's own check, before the clock moves
        raise EventError("acked.directive_id", f"unknown or already acknowledged directive {directive_id}", "FAILED_PRECONDITION")
    _at(core, ts_us, received, tenant)
    core.ack(directive_id, status == _ACK_DONE, actual)


def _eviction_requested(core: Core, ev: tuple[Any, ...], tenant: str, ts_us: int, received: int) -> None:
    """The engine needs room in a tier now (vLLM's CachePolicy.evict): exactly ``count``
    victims, none protected, dropped; or the event is rejected and nothing changes."""
    tier_name: str = ev[2]
    t = core.resolve_tier(tier_name, "eviction_requested.tier", empty=0) if tier_name else 0
    count: int = ev[3]
    protected_ids: list[str] = ev[4]
    protected = set(protected_ids)
    clock = core.clock
    # Chosen at the event's time (policies may score by it), before the clock really moves:
    # a rejected event leaves time where it was.
    saved = clock.now_us
    if ts_us > saved:
        clock.now_us = ts_us
    try:
        victims = core.choose_count(t, count, protected)
        if tenant:
            # The tier's policy chooses among every tenant's blocks: a tenant may only make
            # room with its own.
            for victim in victims:
                if victim.tenant != tenant:
                    raise EventError("eviction_requested.count", "a victim the policy chose belongs to another tenant", "PERMISSION_DENIED")
    finally:
        clock.now_us = saved
    prefetches = core.stats.prefetches
    _at(core, ts_us, received, tenant)
    if core.stats.prefetches != prefetches:
        # Moving the clock promoted blocks (deadline prefetch): choose again in the tier as it is now.
        victims = core.choose_count(t, count, protected)
    core.evict_chosen(t, victims)
