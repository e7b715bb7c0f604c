"""Reading an IntentBatch into the plain tuples ``broker.model.apply`` applies.

Two readers yield the same tuples:

- the native reader (``broker.model._wire``, C), which walks the serialized batch. It is what
  runs: the broker holds every batch as bytes (it journals them as received), and reading
  fields through the protobuf runtime cost more than applying them (about 180 ns per block
  id an access names, a third of a decode-mode replay);
- the reference reader below, over the protobuf runtime. It defines the meaning. It runs
  when the native reader is not built (``KVBROKER_PURE_PYTHON=1``), and for the encodings
  the native reader refuses (a message field given twice, which protobuf merges; a scalar
  given twice; a field with an unexpected wire type; invalid UTF-8, which protobuf rejects).
  No protobuf library writes those, so in practice the native reader reads every batch.

tests/broker/model/test_wire.py holds the two equal, on random and on malformed batches.

A batch is scanned once (``read_batch``); its events come out of ``events(blocks)`` one at
a time, lazily: the block ids of an event are looked up in the core's ``blocks`` when the
event is read, after the batch's earlier events were applied (a batch may allocate a block
and then access it).

Tuple layouts (index: field), by kind (the number of the ``Event.kind`` field):

- no kind set: ``(0, ts_us)``; ``cleared``: ``(CLEARED, ts_us)``
- ``allocated``: ``(ALLOCATED, ts_us, tier, reuse, *intent)``, the MemoryIntent's fields
  from index ``A_BLOCK_ID`` on, in the ``A_*`` order below; an unset ``optional`` is None,
  ``allowed_tiers`` a tuple of names; then ``scope`` (index ``A_SCOPE``)
- ``accessed``: ``(ACCESSED, ts_us, next_use_us or None, blocks, ids, scope, token_positions,
  ends_scope, refresh_only)``: ``scope`` and ``ends_scope`` strings ("" unset),
  ``token_positions`` a list of ints, ``refresh_only`` a bool
- ``released``, ``freed``: ``(kind, ts_us, blocks, ids)``. ``blocks`` is the list of the
  named blocks when every id is known and there is at least one, and ``ids`` is None;
  otherwise ``blocks`` is None and ``ids`` the list of ids, so that the caller can name
  the first bad one (without a ``blocks`` dict, always the ids)
- ``intent_updated``: ``(UPDATED, ts_us, block_id, *changes)``: ``U_*`` below; every
  ``optional`` field None when unset, ``clear_deadline`` a bool
- ``acked``: ``(ACKED, ts_us, directive_id, status, actual_tier)``
- ``eviction_requested``: ``(EVICTION, ts_us, tier, count, protected_ids)``, the protected
  ids a list of strings (in the order sent, repeats kept)

Integers are what protobuf reads: int64 fields signed, uint32 fields their low 32 bits,
enums int32 and kept when unknown.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final, Protocol

from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb

if TYPE_CHECKING:
    from broker.model.core import Directive

native: ModuleType | None
try:
    from broker.model import _wire as native
except ImportError:  # not built (KVBROKER_PURE_PYTHON=1): the reference reader reads all
    native = None

# Set (to anything but 0) to read every batch with the reference reader (tests, debugging).
REFERENCE_ENV = "KVBROKER_WIRE_REFERENCE"
use_reference = os.environ.get(REFERENCE_ENV, "") not in ("", "0")

# The constants are Final literals: compiled code (broker.model.apply) reads them as constants,
# not as a lookup in this module's globals per use (measured: 30 lookups per allocation).
NONE: Final = 0
ALLOCATED: Final = 2
ACCESSED: Final = 3
UPDATED: Final = 4
RELEASED: Final = 5
FREED: Final = 6
CLEARED: Final = 7
ACKED: Final = 8
EVICTION: Final = 9
KIND_NAMES: Final = ("", "", "allocated", "accessed", "intent_updated", "released", "freed", "cleared", "acked", "eviction_requested")

# allocated: (ALLOCATED, ts_us, tier, reuse, then the MemoryIntent)
A_TIER: Final = 2
A_REUSE: Final = 3
A_BLOCK_ID: Final = 4
A_REQUEST_ID: Final = 5
A_PHASE: Final = 6
A_PRIORITY: Final = 7
A_DEADLINE: Final = 8
A_SLACK: Final = 9
A_RECOMPUTE_COST: Final = 10
A_SPILL_COST: Final = 11
A_SIZE: Final = 12
A_PIN_REQUESTED: Final = 13
A_IS_DRAFT: Final = 14
A_IS_COMMITTED: Final = 15
A_TENANT: Final = 16
A_LAYER: Final = 17
A_HEAD_GROUP: Final = 18
A_TOKEN_START: Final = 19
A_TOKEN_COUNT: Final = 20
A_ALLOWED_TIERS: Final = 21
A_PARENT_ID: Final = 22
A_REQUEST_PRIORITY: Final = 23
A_REUSE_WINDOW: Final = 24
A_RECOMPUTE_OK: Final = 25
A_COMPRESSION_OK: Final = 26
A_PREFETCH_OK: Final = 27
A_SCOPE: Final = 28

# accessed: (ACCESSED, ts_us, next_use_us, blocks, ids, scope, token_positions, ends_scope,
# refresh_only)
X_SCOPE: Final = 5
X_POSITIONS: Final = 6
X_ENDS_SCOPE: Final = 7
X_REFRESH_ONLY: Final = 8

# intent_updated: (UPDATED, ts_us, block_id, then the optional changes)
U_BLOCK_ID: Final = 2
U_PHASE: Final = 3
U_PRIORITY: Final = 4
U_DEADLINE: Final = 5
U_SLACK: Final = 6
U_PIN_REQUESTED: Final = 7
U_IS_COMMITTED: Final = 8
U_IS_DRAFT: Final = 9
U_RECOMPUTE_COST: Final = 10
U_CLEAR_DEADLINE: Final = 11
U_REUSE_WINDOW: Final = 12
U_REQUEST_PRIORITY: Final = 13


class BatchReader(Protocol):
    """What both readers offer: the batch's header, and its events as tuples.

    ``events(blocks)`` may be called once per core the batch is applied to (shadow
    policies, a replay of several policies): the batch is scanned once."""

    client_id: str
    batch_seq: int
    tenant: str
    # IntentBatch.broker_received_us: when the broker received the batch (0: not stamped).
    received_us: int
    count: int

    def events(self, blocks: dict[str, Any] | None = None) -> Iterator[tuple[Any, ...]]: ...


def _opt(message: Any, name: str) -> Any:
    return getattr(message, name) if message.HasField(name) else None


def _named(blocks: dict[str, Any] | None, ids: list[str]) -> tuple[list[Any] | None, list[str] | None]:
    if blocks is not None and ids:
        found = [blocks.get(block_id) for block_id in ids]
        if None not in found:
            return found, None
    return None, ids


def event_tuple(event: pb.Event, blocks: dict[str, Any] | None) -> tuple[Any, ...]:
    """The reference reading of one event (layouts above)."""
    kind = event.WhichOneof("kind")
    ts = event.ts_us
    if kind == "allocated":
        alloc = event.allocated
        i = alloc.intent
        return (
            ALLOCATED,
            ts,
            alloc.tier,
            alloc.reuse,
            i.block_id,
            i.request_id,
            i.phase,
            i.priority,
            _opt(i, "deadline_us"),
            _opt(i, "slack_us"),
            _opt(i, "recompute_cost_us"),
            _opt(i, "spill_cost_us"),
            i.size_bytes,
            i.pin_requested,
            i.is_draft,
            i.is_committed,
            i.tenant,
            i.layer,
            i.head_group,
            i.token_start,
            i.token_count,
            tuple(i.allowed_tiers),
            i.parent_block_id,
            _opt(i, "request_priority"),
            _opt(i, "expected_reuse_window_tokens"),
            i.recompute_ok,
            i.compression_ok,
            i.prefetch_ok,
            alloc.scope,
        )
    if kind == "accessed":
        accessed = event.accessed
        return (
            ACCESSED,
            ts,
            _opt(accessed, "next_use_us"),
            *_named(blocks, list(accessed.block_ids)),
            accessed.scope,
            list(accessed.token_positions),
            accessed.ends_scope,
            accessed.refresh_only,
        )
    if kind == "intent_updated":
        u = event.intent_updated
        return (
            UPDATED,
            ts,
            u.block_id,
            _opt(u, "phase"),
            _opt(u, "priority"),
            _opt(u, "deadline_us"),
            _opt(u, "slack_us"),
            _opt(u, "pin_requested"),
            _opt(u, "is_committed"),
            _opt(u, "is_draft"),
            _opt(u, "recompute_cost_us"),
            u.clear_deadline,
            _opt(u, "expected_reuse_window_tokens"),
            _opt(u, "request_priority"),
        )
    if kind == "released":
        return (RELEASED, ts, *_named(blocks, list(event.released.block_ids)))
    if kind == "freed":
        return (FREED, ts, *_named(blocks, list(event.freed.block_ids)))
    if kind == "cleared":
        return (CLEARED, ts)
    if kind == "acked":
        ack = event.acked
        return (ACKED, ts, ack.directive_id, ack.status, ack.actual_tier)
    if kind == "eviction_requested":
        ask = event.eviction_requested
        return (EVICTION, ts, ask.tier, ask.count, list(ask.protected_block_ids))
    return (NONE, ts)


class ReferenceReader:
    """The events of a parsed IntentBatch, read through the protobuf runtime."""

    def __init__(self, batch: pb.IntentBatch) -> None:
        self.batch = batch
        self.client_id = batch.client_id
        self.batch_seq = batch.batch_seq
        self.tenant = batch.tenant
        self.received_us = batch.broker_received_us
        self.count = len(batch.events)

    def events(self, blocks: dict[str, Any] | None = None) -> Iterator[tuple[Any, ...]]:
        for event in self.batch.events:
            yield event_tuple(event, blocks)


def read_batch(batch: bytes | pb.IntentBatch) -> BatchReader:
    """A reader of ``batch``, serialized (as the broker receives and journals it) or a message.

    Bytes the protobuf runtime cannot parse raise its DecodeError, as parsing them would.
    """
    if native is not None and not use_reference:
        raw = batch if isinstance(batch, bytes) else batch.SerializeToString()
        try:
            reader: BatchReader = native.BatchReader(raw)
            return reader
        except native.Unsupported:
            pass
    message = pb.IntentBatch.FromString(batch) if isinstance(batch, bytes) else batch
    return ReferenceReader(message)


def directive_to_pb(d: Directive) -> dpb.Directive:
    """A core Directive as the schema's message (the answer's and the journal's form)."""
    return dpb.Directive(
        directive_id=d.directive_id,
        kind=int(d.kind),  # type: ignore[arg-type]
        block_id=d.block_id,
        from_tier=d.from_tier,
        to_tier=d.to_tier,
        policy=d.policy,
        score=d.score,
        reason=d.reason,
        arrive_by_us=d.arrive_by_us,
        size_bytes=d.size,
        config_generation=d.generation,
    )
