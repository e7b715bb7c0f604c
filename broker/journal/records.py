"""Journal records and the on-disk framing of the embedded file journal.

A record is one accepted IntentBatch exactly as received (kind BATCH), the
DirectiveBatch the broker answered it with (kind DIRECTIVES, optional), the core config
in force (kind CONFIG), or a writer's closing count (kind TRAILER), each tagged with the
schema major version and the config generation it was applied under.

File framing, little-endian: the file starts with MAGIC; then per record
``length u32 | crc32 u32 | body``, where body is ``kind u8 | schema_major u16 |
generation u64 | payload`` and the CRC covers the body. A torn tail (a record cut short by a
crash) is detected and cut on open; damage before the tail is reported, never misread.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from enum import IntEnum

MAGIC = b"KVBJRNL1"
FRAME = struct.Struct("<II")
BODY = struct.Struct("<BHQ")
MAX_RECORD = 256 * 2**20


class RecordKind(IntEnum):
    BATCH = 1
    DIRECTIVES = 2
    # The core config (JSON) the broker runs under, written at start and on each change, so
    # that a journal replays without being told the tiers it was captured with.
    CONFIG = 3
    # What one writer appended since it opened the journal (broker.journal.trailer), written
    # last when it closes, so that ``replay --verify`` can tell a whole journal from one whose
    # tail was lost. Readers before it refuse a journal holding one ("unknown record kind 4").
    TRAILER = 4
    # A compacted state (broker.journal.snapshots): a mark where it was taken, then the state
    # as it was at the mark, written once a forked child has made it. Recovery starts from the
    # last complete one; readers before it refuse a journal holding one.
    SNAPSHOT = 5


@dataclasses.dataclass(frozen=True, slots=True)
class JournalRecord:
    kind: RecordKind
    schema_major: int
    generation: int
    payload: bytes


class JournalError(Exception):
    """The journal cannot be opened or read as it is; the message says where and why."""


def encode(record: JournalRecord) -> bytes:
    body = BODY.pack(record.kind, record.schema_major, record.generation) + record.payload
    return FRAME.pack(len(body), zlib.crc32(body)) + body


def decode_body(body: bytes, where: str) -> JournalRecord:
    if len(body) < BODY.size:
        raise JournalError(f"{where}: record body of {len(body)} bytes is shorter than its header")
    kind, major, generation = BODY.unpack_from(body)
    try:
        rkind = RecordKind(kind)
    except ValueError:
        raise JournalError(f"{where}: unknown record kind {kind}") from None
    return JournalRecord(rkind, major, generation, bytes(body[BODY.size :]))


def scan(data: bytes, path: str) -> tuple[list[JournalRecord], int]:
    """Parse a whole file image; return its records and the length of the good prefix.

    A bad record that reaches the end of the file is a torn tail (the good length stops
    before it). A bad record followed by more bytes is corruption and raises.
    """
    if not data:
        return [], 0
    if not data.startswith(MAGIC):
        if MAGIC.startswith(data):
            return [], 0  # the header itself was torn
        raise JournalError(f"{path}: not a kvbroker journal (bad magic)")
    return scan_frames(data, len(MAGIC), path)


def framed_size(payload_bytes: int) -> int:
    """Bytes a record with a payload of this size takes on disk."""
    return FRAME.size + BODY.size + payload_bytes


def scan_frames(data: bytes, pos: int, path: str, *, limit: int | None = None) -> tuple[list[JournalRecord], int]:
    """The framed records of ``data`` from offset ``pos`` (at most ``limit``), and the offset
    just after the last good one; a torn tail stops the scan, damage before it raises."""
    records: list[JournalRecord] = []
    end = len(data)
    while pos < end and (limit is None or len(records) < limit):
        if end - pos < FRAME.size:
            return records, pos  # torn frame header
        length, crc = FRAME.unpack_from(data, pos)
        body_end = pos + FRAME.size + length
        if length > MAX_RECORD or body_end > end:
            if length <= MAX_RECORD:
                return records, pos  # torn body
            raise JournalError(f"{path}: record at offset {pos} declares {length} bytes, more than the {MAX_RECORD} allowed")
        body = data[pos + FRAME.size : body_end]
        if zlib.crc32(body) != crc:
            if body_end == end:
                return records, pos  # last record half-written
            raise JournalError(
                f"{path}: checksum mismatch in the record at offset {pos}, before the tail; refusing to misread "
                f"(stop the broker and run `kvbroker repair {path}`: it keeps every intact record and reports what it cuts)"
            )
        records.append(decode_body(body, f"{path}@{pos}"))
        pos = body_end
    return records, pos
