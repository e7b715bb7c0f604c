"""MemoryIntent events written straight to protobuf wire bytes (kvbroker.v1.Event).

The adapter sits on vLLM's scheduler path: building a protobuf message per call and
serializing it cost more than applying the event (measured in bench/vllm_offload.py). These
functions write the few events it sends as the bytes protobuf would write, field by field,
with broker.model.pbwire's encoders and keys read from the schema
(tests/vllm_integration/decisions_to_vllm/test_intent_bytes.py parses them back with protobuf); the core reads them
with the native reader, exactly as it reads a batch the broker received or a journal
replays.

Only what the adapter needs: ``allocated`` (block id, request id, a few intent fields, size
1; ``scoped_allocated`` adds token_start and the scope), ``accessed`` (``scoped_accessed``
with a scope, token positions and a scope's end), ``intent_updated`` (the intent fields of a
hint), ``freed``, ``cleared`` and ``eviction_requested``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from broker.model.pbwire import SMALL, key, length_delimited, varint
from broker.model.wire import read_batch
from kvbroker.v1 import intent_pb2 as pb

# Keys, made once from the schema. Event: 1 ts_us, then the oneof kind.
_TS: Final = key(pb.Event, "ts_us")
_ALLOCATED: Final = key(pb.Event, "allocated")
_ACCESSED: Final = key(pb.Event, "accessed")
_UPDATED: Final = key(pb.Event, "intent_updated")
_FREED: Final = key(pb.Event, "freed")
_CLEARED: Final = key(pb.Event, "cleared") + SMALL[0]  # an empty AllBlocksCleared
_EVICTION: Final = key(pb.Event, "eviction_requested")
_BATCH_CLIENT: Final = key(pb.IntentBatch, "client_id")
_BATCH_SEQ: Final = key(pb.IntentBatch, "batch_seq")
_BATCH_EVENT: Final = key(pb.IntentBatch, "events")
_BATCH_TENANT: Final = key(pb.IntentBatch, "tenant")
# Field 1 of MemoryIntent, IntentUpdated, BlocksAccessed and BlocksFreed alike: a block id.
_ID: Final = key(pb.MemoryIntent, "block_id")
_INTENT: Final = key(pb.BlockAllocated, "intent")
_ALLOCATION_SCOPE: Final = key(pb.BlockAllocated, "scope")
_I_REQUEST: Final = key(pb.MemoryIntent, "request_id")
_I_PRIORITY: Final = key(pb.MemoryIntent, "priority")
_I_DEADLINE: Final = key(pb.MemoryIntent, "deadline_us")
_I_ONE_BYTE: Final = key(pb.MemoryIntent, "size_bytes") + SMALL[1]  # size 1: one chunk
_I_DRAFT: Final = key(pb.MemoryIntent, "is_draft") + SMALL[1]
_I_TENANT: Final = key(pb.MemoryIntent, "tenant")
_I_TOKEN_START: Final = key(pb.MemoryIntent, "token_start")
_I_REQUEST_PRIORITY: Final = key(pb.MemoryIntent, "request_priority")
_I_REUSE: Final = key(pb.MemoryIntent, "expected_reuse_window_tokens")
_U_PRIORITY: Final = key(pb.IntentUpdated, "priority")
_U_DEADLINE: Final = key(pb.IntentUpdated, "deadline_us")
_U_DRAFT: Final = key(pb.IntentUpdated, "is_draft")
_U_REUSE: Final = key(pb.IntentUpdated, "expected_reuse_window_tokens")
_U_REQUEST_PRIORITY: Final = key(pb.IntentUpdated, "request_priority")
_X_SCOPE: Final = key(pb.BlocksAccessed, "scope")
_X_POSITIONS: Final = key(pb.BlocksAccessed, "token_positions")
_X_ENDS_SCOPE: Final = key(pb.BlocksAccessed, "ends_scope")
_X_REFRESH_ONLY: Final = key(pb.BlocksAccessed, "refresh_only") + SMALL[1]
_E_TIER: Final = key(pb.EvictionRequested, "tier")
_E_COUNT: Final = key(pb.EvictionRequested, "count")
_E_PROTECTED: Final = key(pb.EvictionRequested, "protected_block_ids")
# The per-block functions (``id_field``, ``allocated``, ``scoped_allocated``) write their
# keys as literals: a constant costs less than a global (measured: 5% of ``allocated``).
# ``ending_accessed`` and ``eviction_requested`` re-key a written field by replacing its
# first byte, so those keys must be one byte long.
if (_ID, _INTENT, _I_TOKEN_START) != (b"\x0a", b"\x0a", b"\x80\x01"):
    raise AssertionError("events: a literal key is no longer the schema's")
if not len(_ID) == len(_X_SCOPE) == len(_X_ENDS_SCOPE) == len(_E_PROTECTED) == 1:
    raise AssertionError("events: a re-keyed field's key is no longer one byte")


def id_field(block_id: str) -> bytes:
    """A block id as field 1 of a message (MemoryIntent.block_id, IntentUpdated.block_id,
    and one entry of the repeated block_ids of BlocksAccessed / BlocksFreed)."""
    # pbwire.length_delimited inlined: the call cost a third of this function.
    data = block_id.encode()
    n = len(data)
    return b"\x0a" + (SMALL[n] if n < 128 else varint(n)) + data


def intent_fields(
    request_id: str,
    *,
    priority: int | None = None,
    deadline_us: int | None = None,
    request_priority: int | None = None,
    reuse_tokens: int | None = None,
    tenant: str = "",
    is_draft: bool = False,
) -> bytes:
    """The MemoryIntent fields after block_id that a request's chunks share (size_bytes 1:
    one chunk). Written once per request and appended to each chunk's id field."""
    out = bytearray()
    if request_id:
        out += length_delimited(_I_REQUEST, request_id.encode())
    if priority:
        out += _I_PRIORITY + varint(priority)
    if deadline_us is not None:
        out += _I_DEADLINE + varint(deadline_us)
    out += _I_ONE_BYTE
    if is_draft:
        out += _I_DRAFT
    if tenant:
        out += length_delimited(_I_TENANT, tenant.encode())
    if request_priority is not None:
        out += _I_REQUEST_PRIORITY + varint(request_priority)
    if reuse_tokens is not None:
        out += _I_REUSE + varint(reuse_tokens)
    return bytes(out)


def update_fields(
    *,
    priority: int | None = None,
    deadline_us: int | None = None,
    request_priority: int | None = None,
    reuse_tokens: int | None = None,
    is_draft: bool | None = None,
) -> bytes:
    """The IntentUpdated fields after block_id for a request's intent ("" when none)."""
    out = bytearray()
    if priority is not None:
        out += _U_PRIORITY + varint(priority)
    if deadline_us is not None:
        out += _U_DEADLINE + varint(deadline_us)
    if is_draft is not None:
        out += _U_DRAFT + SMALL[1 if is_draft else 0]
    if reuse_tokens is not None:
        out += _U_REUSE + varint(reuse_tokens)
    if request_priority is not None:
        out += _U_REQUEST_PRIORITY + varint(request_priority)
    return bytes(out)


def event(ts: bytes, kind: bytes, body: bytes) -> bytes:
    """One Event: ``ts`` is ``_TS + varint(ts_us)`` (shared by a batch's events)."""
    n = len(body)
    return ts + kind + (SMALL[n] if n < 128 else varint(n)) + body


def timestamp(ts_us: int) -> bytes:
    return _TS + varint(ts_us)


def allocated(ts: bytes, id_bytes: bytes, intent_rest: bytes) -> bytes:
    intent = id_bytes + intent_rest
    n = len(intent)
    inner = b"\x0a" + (SMALL[n] if n < 128 else varint(n)) + intent  # BlockAllocated.intent
    n = len(inner)
    return ts + _ALLOCATED + (SMALL[n] if n < 128 else varint(n)) + inner


# Token positions repeat (multiples of a block's tokens), and a varint written in Python
# costs more than the rest of an event: their encodings are kept, bounded.
_POSITIONS: dict[int, bytes] = {}


def position_varint(value: int) -> bytes:
    """A token position (0..2^64-1; ValueError otherwise: the translator sends a key with a
    position outside its bound as a plain use, and never gets here with it)."""
    out = _POSITIONS.get(value)
    if out is None:
        out = varint(value)
        if len(_POSITIONS) < 65_536:
            _POSITIONS[value] = out
    return out


def scoped_allocated(ts: bytes, id_bytes: bytes, intent_rest: bytes, scope_tail: bytes, token_start: int) -> bytes:
    """``allocated`` with MemoryIntent.token_start and BlockAllocated.scope (``scope_tail``:
    ``allocation_scope(name)``)."""
    start = b"\x80\x01" + position_varint(token_start) if token_start else b""  # MemoryIntent.token_start
    intent = id_bytes + intent_rest + start
    n = len(intent)
    inner = b"\x0a" + (SMALL[n] if n < 128 else varint(n)) + intent + scope_tail  # BlockAllocated.intent
    n = len(inner)
    return ts + _ALLOCATED + (SMALL[n] if n < 128 else varint(n)) + inner


def allocation_scope(name: str) -> bytes:
    """A request scope's name as BlockAllocated.scope."""
    return length_delimited(_ALLOCATION_SCOPE, name.encode())


def scope(name: str) -> bytes:
    """A request scope's name as BlocksAccessed.scope; ``ending_accessed`` re-keys it as
    ends_scope."""
    return length_delimited(_X_SCOPE, name.encode())


def accessed(ts: bytes, id_fields: Iterable[bytes]) -> bytes:
    return event(ts, _ACCESSED, b"".join(id_fields))


def scoped_accessed(ts: bytes, id_fields: Iterable[bytes], scope_field: bytes, positions: Iterable[int]) -> bytes:
    """A request-scoped ``accessed``: the blocks at their token ``positions`` (one each)."""
    packed = b"".join([position_varint(p) for p in positions])
    n = len(packed)
    body = b"".join(id_fields) + scope_field
    if n:
        body += _X_POSITIONS + (SMALL[n] if n < 128 else varint(n)) + packed
    return event(ts, _ACCESSED, body)


def ending_accessed(ts: bytes, id_fields: Iterable[bytes], scope_field: bytes, *, refresh_only: bool = False) -> bytes:
    """A plain ``accessed`` after which the scope ends (``ends_scope``; none when
    ``scope_field`` is empty); ``refresh_only``: the blocks were used, not read."""
    body = b"".join(id_fields)
    if refresh_only:
        body += _X_REFRESH_ONLY
    if scope_field:
        body += _X_ENDS_SCOPE + scope_field[1:]
    return event(ts, _ACCESSED, body)


def updated(ts: bytes, id_bytes: bytes, changes: bytes) -> bytes:
    return event(ts, _UPDATED, id_bytes + changes)


def freed(ts: bytes, id_fields: Iterable[bytes]) -> bytes:
    return event(ts, _FREED, b"".join(id_fields))


def cleared(ts: bytes) -> bytes:
    return ts + _CLEARED


def eviction_requested(ts: bytes, count: int, protected_ids: Iterable[bytes], tier: str = "") -> bytes:
    """EvictionRequested; ``protected_ids`` are id fields (field 1), re-keyed as
    protected_block_ids."""
    body = bytearray()
    if tier:
        body += length_delimited(_E_TIER, tier.encode())
    if count:
        body += _E_COUNT + varint(count)
    for field in protected_ids:
        body += _E_PROTECTED + field[1:]
    return event(ts, _EVICTION, bytes(body))


def readable(raw: bytes) -> bool:
    """Whether the core can read a serialized batch (``apply_batch`` reads the whole batch
    before it applies anything: unreadable bytes change nothing)."""
    try:
        read_batch(raw)
    except Exception:
        return False
    return True


def batch_head(client_id: str, tenant: str = "") -> tuple[bytes, bytes]:
    """(what precedes batch_seq, what follows the events) of a client's batches."""
    tail = length_delimited(_BATCH_TENANT, tenant.encode()) if tenant else b""
    return length_delimited(_BATCH_CLIENT, client_id.encode()) + _BATCH_SEQ, tail


def batch(head: tuple[bytes, bytes], seq: int, events: Iterable[bytes]) -> bytes:
    """A serialized IntentBatch of ``events`` (each an encoded Event)."""
    parts = [head[0], varint(seq)]
    append = parts.append
    small = SMALL
    for ev in events:
        n = len(ev)
        append(_BATCH_EVENT)
        append(small[n] if n < 128 else varint(n))
        append(ev)
    parts.append(head[1])
    return b"".join(parts)
