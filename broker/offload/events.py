"""MemoryIntent events written straight to protobuf wire bytes (kvbroker.v1.Event).

The adapter sits on vLLM's scheduler path: building a protobuf message per call and
serializing it cost more than applying the event (measured in bench/vllm_offload.py). These
functions write the few events it sends as the bytes protobuf would write, field by field
(tests/broker/offload/test_events.py parses them back with protobuf); the core reads them
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

from broker.model.wire import read_batch
from broker.model.wire import varint as _varint

# One-byte varints, made once: lengths and small numbers are most of what is written.
_SMALL: Final = tuple(bytes((i,)) for i in range(128))


# The largest value a varint field holds (uint64; int64 fields read it as negative past 2^63).
MAX_VARINT: Final = 2**64 - 1


def varint(value: int) -> bytes:
    """``value`` (0..2^64-1) as a protobuf varint; ValueError otherwise (a negative value once
    came out as a wrong byte: -1 as 127)."""
    if 0 <= value < 128:
        return _SMALL[value]
    if not 0 <= value <= MAX_VARINT:
        raise ValueError(f"a varint holds 0..2^64-1, got {value}")
    return _varint(value)


# Event fields: 1 ts_us (varint), then the oneof kind (length-delimited).
_TS: Final = b"\x08"
_ALLOCATED: Final = b"\x12"
_ACCESSED: Final = b"\x1a"
_UPDATED: Final = b"\x22"
_FREED: Final = b"\x32"
_CLEARED: Final = b"\x3a\x00"
_EVICTION: Final = b"\x4a"
# IntentBatch fields: 1 client_id, 2 batch_seq, 3 events (repeated), 4 tenant.
_BATCH_EVENT: Final = b"\x1a"


def string_field(tag: bytes, text: str) -> bytes:
    data = text.encode()
    n = len(data)
    return tag + (_SMALL[n] if n < 128 else _varint(n)) + data


def id_field(block_id: str) -> bytes:
    """A block id as field 1 of a message (MemoryIntent.block_id, IntentUpdated.block_id,
    and one entry of the repeated block_ids of BlocksAccessed / BlocksFreed)."""
    data = block_id.encode()
    n = len(data)
    return b"\x0a" + (_SMALL[n] if n < 128 else _varint(n)) + data


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
        out += string_field(b"\x12", request_id)  # 2 request_id
    if priority:
        out += b"\x20" + varint(priority)  # 4 priority
    if deadline_us is not None:
        out += b"\x28" + varint(deadline_us)  # 5 deadline_us
    out += b"\x48\x01"  # 9 size_bytes = 1
    if is_draft:
        out += b"\x58\x01"  # 11 is_draft
    if tenant:
        out += string_field(b"\x6a", tenant)  # 13 tenant
    if request_priority is not None:
        out += b"\xa0\x01" + varint(request_priority)  # 20 request_priority
    if reuse_tokens is not None:
        out += b"\xa8\x01" + varint(reuse_tokens)  # 21 expected_reuse_window_tokens
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
        out += b"\x18" + varint(priority)  # 3 priority
    if deadline_us is not None:
        out += b"\x20" + varint(deadline_us)  # 4 deadline_us
    if is_draft is not None:
        out += b"\x40" + (b"\x01" if is_draft else b"\x00")  # 8 is_draft
    if reuse_tokens is not None:
        out += b"\x58" + varint(reuse_tokens)  # 11 expected_reuse_window_tokens
    if request_priority is not None:
        out += b"\x60" + varint(request_priority)  # 12 request_priority
    return bytes(out)


def event(ts: bytes, kind: bytes, body: bytes) -> bytes:
    """One Event: ``ts`` is ``_TS + varint(ts_us)`` (shared by a batch's events)."""
    n = len(body)
    return ts + kind + (_SMALL[n] if n < 128 else _varint(n)) + body


def timestamp(ts_us: int) -> bytes:
    return _TS + varint(ts_us)


def allocated(ts: bytes, id_bytes: bytes, intent_rest: bytes) -> bytes:
    intent = id_bytes + intent_rest
    n = len(intent)
    inner = b"\x0a" + (_SMALL[n] if n < 128 else _varint(n)) + intent  # BlockAllocated.intent
    n = len(inner)
    return ts + _ALLOCATED + (_SMALL[n] if n < 128 else _varint(n)) + inner


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
    start = b"\x80\x01" + position_varint(token_start) if token_start else b""  # 16 token_start
    intent = id_bytes + intent_rest + start
    n = len(intent)
    inner = b"\x0a" + (_SMALL[n] if n < 128 else _varint(n)) + intent + scope_tail
    n = len(inner)
    return ts + _ALLOCATED + (_SMALL[n] if n < 128 else _varint(n)) + inner


def allocation_scope(name: str) -> bytes:
    """A request scope's name as field 4 of BlockAllocated (its scope)."""
    return string_field(b"\x22", name)


def scope(name: str) -> bytes:
    """A request scope's name as field 3 (BlocksAccessed.scope); ``ending_accessed`` re-tags
    it as field 5 (ends_scope)."""
    return string_field(b"\x1a", name)


def accessed(ts: bytes, id_fields: Iterable[bytes]) -> bytes:
    return event(ts, _ACCESSED, b"".join(id_fields))


def scoped_accessed(ts: bytes, id_fields: Iterable[bytes], scope_field: bytes, positions: Iterable[int]) -> bytes:
    """A request-scoped ``accessed``: the blocks at their token ``positions`` (one each)."""
    packed = b"".join([position_varint(p) for p in positions])
    n = len(packed)
    body = b"".join(id_fields) + scope_field
    if n:
        body += b"\x22" + (_SMALL[n] if n < 128 else _varint(n)) + packed  # 4 token_positions
    return event(ts, _ACCESSED, body)


def ending_accessed(ts: bytes, id_fields: Iterable[bytes], scope_field: bytes, *, refresh_only: bool = False) -> bytes:
    """A plain ``accessed`` after which the scope ends (``ends_scope``; none when
    ``scope_field`` is empty); ``refresh_only``: the blocks were used, not read."""
    body = b"".join(id_fields)
    if refresh_only:
        body += b"\x30\x01"  # 6 refresh_only
    if scope_field:
        body += b"\x2a" + scope_field[1:]  # 5 ends_scope
    return event(ts, _ACCESSED, body)


def updated(ts: bytes, id_bytes: bytes, changes: bytes) -> bytes:
    return event(ts, _UPDATED, id_bytes + changes)


def freed(ts: bytes, id_fields: Iterable[bytes]) -> bytes:
    return event(ts, _FREED, b"".join(id_fields))


def cleared(ts: bytes) -> bytes:
    return ts + _CLEARED


def eviction_requested(ts: bytes, count: int, protected_ids: Iterable[bytes], tier: str = "") -> bytes:
    """EvictionRequested; ``protected_ids`` are id fields (field 1), re-tagged as field 3."""
    body = bytearray()
    if tier:
        body += string_field(b"\x0a", tier)
    if count:
        body += b"\x10" + varint(count)
    for field in protected_ids:
        body += b"\x1a" + field[1:]
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
    return string_field(b"\x0a", client_id) + b"\x10", (string_field(b"\x22", tenant) if tenant else b"")


def batch(head: tuple[bytes, bytes], seq: int, events: Iterable[bytes]) -> bytes:
    """A serialized IntentBatch of ``events`` (each an encoded Event)."""
    parts = [head[0], varint(seq)]
    append = parts.append
    small = _SMALL
    for ev in events:
        n = len(ev)
        append(_BATCH_EVENT)
        append(small[n] if n < 128 else _varint(n))
        append(ev)
    parts.append(head[1])
    return b"".join(parts)
