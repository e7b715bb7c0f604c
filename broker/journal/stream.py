"""A file journal read as a stream: one record in memory at a time, whatever the file's size.

``records.scan`` parses a whole file image: reading a 2 GiB journal that way held the file,
then every record parsed from it (replay peaked at 4.05 GiB RSS; issue 41, item 14). This
reader goes frame by frame through a buffered file and keeps only the record it yields, with
the same rules: a bad record that reaches the end of the file (as it was when opened) is a
torn tail and ends the stream; a bad record with bytes after it is damage, and raises.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from typing import BinaryIO

from broker.journal.records import BODY, FRAME, MAGIC, MAX_RECORD, JournalError, JournalRecord, decode_body
from clients.regular_file import open_regular


def frames(f: BinaryIO, pos: int, end: int, path: str) -> Iterator[tuple[int, JournalRecord]]:
    """(offset, record) of the framed records of ``f`` from ``pos`` up to ``end`` (the file's
    size), ``f`` positioned at ``pos``. Stops before a torn tail; raises on damage before it."""
    while pos < end:
        if end - pos < FRAME.size:
            return  # torn frame header
        head = f.read(FRAME.size)
        if len(head) < FRAME.size:
            return  # the file shrank under us: as torn
        length, crc = FRAME.unpack(head)
        body_end = pos + FRAME.size + length
        if length > MAX_RECORD or body_end > end:
            if length <= MAX_RECORD:
                return  # torn body
            raise JournalError(f"{path}: record at offset {pos} declares {length} bytes, more than the {MAX_RECORD} allowed")
        body = f.read(length)
        if len(body) < length:
            return
        if zlib.crc32(body) != crc:
            if body_end == end:
                return  # last record half-written
            raise JournalError(
                f"{path}: checksum mismatch in the record at offset {pos}, before the tail; refusing to misread "
                f"(stop the broker and run `kvbroker repair {path}`: it keeps every intact record and reports what it cuts)"
            )
        yield pos, decode_body(body, f"{path}@{pos}")
        pos = body_end


def good_length(f: BinaryIO, path: str) -> tuple[int, int, int]:
    """(records, offset just after the last good one, file size) of an open journal file,
    read as a stream from its start: what a writer keeps before it appends."""
    end = os.fstat(f.fileno()).st_size
    head = f.read(len(MAGIC))
    if not head:
        return 0, 0, end
    if head != MAGIC[: len(head)] or (len(head) < len(MAGIC) and end > len(head)):
        raise JournalError(f"{path}: not a kvbroker journal (bad magic)")
    if len(head) < len(MAGIC):
        return 0, 0, end  # the header itself was torn
    count, good = 0, len(MAGIC)
    for offset, record in frames(f, len(MAGIC), end, path):
        count += 1
        good = offset + FRAME.size + BODY.size + len(record.payload)
    return count, good, end


def stream_records(path: str, start: int | None = None) -> Iterator[tuple[int, JournalRecord]]:
    """(byte offset, record) of every complete record of a file journal, in order, read as
    a stream (a torn tail is left out); from the record at offset ``start`` if given."""
    with open_regular(path) as f:
        end = os.fstat(f.fileno()).st_size
        head = f.read(len(MAGIC))
        if head != MAGIC:
            if MAGIC.startswith(head):
                return  # empty, or the header itself was torn
            raise JournalError(f"{path}: not a kvbroker journal (bad magic)")
        if start is not None:
            f.seek(start)
        yield from frames(f, start if start is not None else len(MAGIC), end, path)


def last_snapshot(path: str) -> tuple[int, int] | None:
    """(offset of the mark, offset of the state) of the last complete snapshot of a file
    journal (broker.journal.snapshots), or None. Reads each record's header only and skips
    its payload: the journal's batches before the snapshot are never read."""
    from broker.journal.records import RecordKind
    from broker.journal.snapshots import HEAD, MARK, STATE, parse

    marks: dict[int, int] = {}
    found = None
    with open_regular(path) as f:
        end = os.fstat(f.fileno()).st_size
        if f.read(len(MAGIC)) != MAGIC:
            return None
        pos = len(MAGIC)
        while end - pos >= FRAME.size + BODY.size:
            length, _ = FRAME.unpack(f.read(FRAME.size))
            body_end = pos + FRAME.size + length
            if length < BODY.size or body_end > end:
                break  # a torn tail (damage is for the full read to name)
            kind = f.read(1)[0]
            if kind == RecordKind.SNAPSHOT and length >= BODY.size + HEAD.size:
                f.seek(BODY.size - 1, os.SEEK_CUR)
                try:
                    number, part = parse(f.read(HEAD.size))
                except JournalError:
                    number, part = -1, -1
                if part == MARK:
                    marks[number] = pos
                elif part == STATE and number in marks:
                    found = (marks[number], pos)
            f.seek(body_end)
            pos = body_end
    return found
