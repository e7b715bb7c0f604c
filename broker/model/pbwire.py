"""Protobuf wire bytes written by hand: the one place in Python that writes them.

Why by hand at all: on the hot paths a protobuf message object costs more than the work it
carries. The vLLM adapter sends an event per scheduler call (building and serializing an
Event message cost more than applying it: bench/vllm_offload.py); the broker stamps and
wraps every batch it receives and answers (a StreamResponse built around an answer would
copy every directive once more); `kvbroker bench` puts a header in front of pre-encoded
events. Those places write the bytes protobuf would write, with the functions below.

What is here: ``varint`` (uint64), ``int64`` (two's complement, ten bytes when negative),
``tag`` (a field's key) and ``key`` (the same, read from a generated message's schema), and
one ``field_*`` function per kind of field: varint, int64, bool, bytes, str, double,
fixed64, packed varints. A ``field_*`` function always writes its field; proto3 leaves a
default value (0, "", false) out, and that choice stays with the caller, who knows whether
the field has presence.

Hot paths do not call ``field_*``: they make their keys once (``key(...)`` at import, a
module constant; per block, a literal checked against ``key`` at import) and inline
``SMALL[n] if n < 128 else varint(n)`` for a length, since a Python call costs about as much
as the rest of a short field (vllm_integration/decisions_to_vllm/intent_bytes.py).

The native answer writer (broker/model/_answer.c: DirectiveBatch bytes; C cannot import
this) mirrors these functions in its "wire helpers" section (``put_varint``, ``put_u64``,
``put_str``, ``put_double``, ``put_bool``, each with its size). tests/broker/model/test_pbwire.py
holds this module equal to protobuf's SerializeToString; tests/broker/model/test_answer.py
holds the C writer's bytes equal to both protobuf's and a DirectiveBatch written with this
module (``pbwire_answer``), in the compiled build (the pure-Python build has no C writer).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any, Final

# Wire types (the low three bits of a key).
VARINT: Final = 0
I64: Final = 1
LEN: Final = 2
I32: Final = 5

MAX_UINT64: Final = 2**64 - 1
MIN_INT64: Final = -(2**63)
MAX_INT64: Final = 2**63 - 1
# Field numbers protobuf allows (19000..19999 are reserved for it, not refused on the wire).
MAX_FIELD: Final = 2**29 - 1

# One-byte varints, made once: lengths and small numbers are most of what is written.
SMALL: Final = tuple(bytes((i,)) for i in range(128))
_BYTE: Final = tuple(bytes((i,)) for i in range(256))
_DOUBLE: Final = struct.Struct("<d")
_FIXED64: Final = struct.Struct("<Q")


def varint(value: int) -> bytes:
    """``value`` (a uint64, 0..2^64-1) as a varint; ValueError otherwise (a negative value
    once came out as a wrong byte: -1 as 127)."""
    if 0 <= value < 128:
        return SMALL[value]
    if not 0 <= value <= MAX_UINT64:
        raise ValueError(f"a varint holds 0..2^64-1, got {value}")
    # Joining cached one-byte objects: measured faster than a bytearray or a list of ints.
    parts = []
    while value > 0x7F:
        parts.append(_BYTE[(value & 0x7F) | 0x80])
        value >>= 7
    parts.append(_BYTE[value])
    return b"".join(parts)


def int64(value: int) -> bytes:
    """An int64 (or int32, or enum) value as protobuf writes it: a negative one is
    sign-extended to 64 bits, so it takes ten bytes."""
    if not MIN_INT64 <= value <= MAX_INT64:
        raise ValueError(f"an int64 holds -2^63..2^63-1, got {value}")
    return varint(value & MAX_UINT64)


def tag(field: int, wire_type: int) -> bytes:
    """The key of field number ``field`` with ``wire_type`` (VARINT, I64, LEN or I32)."""
    if not 1 <= field <= MAX_FIELD:
        raise ValueError(f"a field number is 1..2^29-1, got {field}")
    if wire_type not in (VARINT, I64, LEN, I32):
        raise ValueError(f"a wire type is one of 0, 1, 2, 5 (groups are not written), got {wire_type}")
    return varint(field << 3 | wire_type)


_FIXED64_TYPES: Final = frozenset((1, 6, 16))  # TYPE_DOUBLE, TYPE_FIXED64, TYPE_SFIXED64
_FIXED32_TYPES: Final = frozenset((2, 7, 15))  # TYPE_FLOAT, TYPE_FIXED32, TYPE_SFIXED32
_LEN_TYPES: Final = frozenset((9, 11, 12))  # TYPE_STRING, TYPE_MESSAGE, TYPE_BYTES


def key(message: Any, name: str) -> bytes:
    """The key of field ``name`` of a generated message class (``intent_pb2.IntentBatch``),
    its number and wire type read from the schema: a constant made this way cannot drift
    from the .proto. A packed repeated field's key is LEN (one run of values)."""
    descriptor = message.DESCRIPTOR
    field = descriptor.fields_by_name.get(name)
    if field is None:
        raise ValueError(f"{descriptor.full_name} has no field {name!r}")
    if field.type in _LEN_TYPES or field.is_packed:
        return tag(field.number, LEN)
    if field.type in _FIXED64_TYPES:
        return tag(field.number, I64)
    if field.type in _FIXED32_TYPES:
        return tag(field.number, I32)
    if field.type == 10:  # TYPE_GROUP: never in this schema (proto3 has none)
        raise ValueError(f"{field.full_name}: groups are not written")
    return tag(field.number, VARINT)


def length_delimited(key: bytes, body: bytes) -> bytes:
    """One length-delimited field: ``key`` (from ``tag`` or ``key``), the length, ``body``."""
    n = len(body)
    return key + (SMALL[n] if n < 128 else varint(n)) + body


def field_varint(field: int, value: int) -> bytes:
    """A uint64, uint32 or non-negative int field (uint32: the caller keeps it in range)."""
    return tag(field, VARINT) + varint(value)


def field_int64(field: int, value: int) -> bytes:
    """An int64, int32 or enum field; negative values take ten bytes."""
    return tag(field, VARINT) + int64(value)


def field_bool(field: int, value: bool) -> bytes:
    return tag(field, VARINT) + (b"\x01" if value else b"\x00")


def field_bytes(field: int, data: bytes) -> bytes:
    """A bytes field, or an embedded message (``data`` its serialized form)."""
    return length_delimited(tag(field, LEN), data)


def field_str(field: int, text: str) -> bytes:
    """A string field, UTF-8 (a lone surrogate raises UnicodeEncodeError, as protobuf refuses it)."""
    return length_delimited(tag(field, LEN), text.encode())


def field_double(field: int, value: float) -> bytes:
    """A double field: its IEEE 754 bits, little-endian (NaN payloads kept)."""
    return tag(field, I64) + _DOUBLE.pack(value)


def field_fixed64(field: int, value: int) -> bytes:
    if not 0 <= value <= MAX_UINT64:
        raise ValueError(f"a fixed64 holds 0..2^64-1, got {value}")
    return tag(field, I64) + _FIXED64.pack(value)


def field_packed(field: int, values: Iterable[int]) -> bytes:
    """A repeated uint64 field in packed form (proto3's default for repeated scalars), or
    nothing when ``values`` is empty (as protobuf writes it)."""
    run = b"".join([varint(v) for v in values])
    return length_delimited(tag(field, LEN), run) if run else b""
