"""Journals: the file journal's framing and torn-tail handling, and the Redis stream."""

from __future__ import annotations

import os

import pytest
import redis

from broker.journal import JournalSource, open_journal
from broker.journal.file import FileJournal, open_for_append, read_file_journal
from broker.journal.records import MAGIC, JournalError, JournalRecord, RecordKind, encode
from tests.conftest import REDIS_URL


def rec(i: int, kind: RecordKind = RecordKind.BATCH) -> JournalRecord:
    return JournalRecord(kind, 1, 1, f"payload-{i}".encode() * (i + 1))


async def write_file(path: str, records: list[JournalRecord]) -> None:
    journal = FileJournal(path)
    await journal.start()
    for r in records:
        journal.append(r)
    await journal.close()


async def test_file_journal_reads_back_every_record_in_order(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "j")
    records = [rec(i, RecordKind.DIRECTIVES if i % 3 == 0 else RecordKind.BATCH) for i in range(200)]
    await write_file(path, records)
    assert list(read_file_journal(path)) == records
    # Reopening appends after what is there.
    await write_file(path, [rec(500)])
    assert list(read_file_journal(path)) == [*records, rec(500)]
    source = JournalSource(f"file://{path}")
    assert [r.payload for r in source.batches()] == [r.payload for r in [*records, rec(500)] if r.kind == RecordKind.BATCH]


@pytest.mark.parametrize("cut", [1, 5, 9, 12])
async def test_a_torn_last_record_is_detected_and_cut_on_open(tmp_path, cut: int) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "j")
    await write_file(path, [rec(0), rec(1), rec(2)])
    size = os.path.getsize(path)
    # A crash mid-write: the last record is cut short by `cut` bytes.
    os.truncate(path, size - cut)
    fd, found, _ = open_for_append(path)
    os.close(fd)
    assert found == 2
    assert list(read_file_journal(path)) == [rec(0), rec(1)]
    assert os.path.getsize(path) == size - len(encode(rec(2)))
    # Appending after the cut gives a clean journal.
    await write_file(path, [rec(3)])
    assert list(read_file_journal(path)) == [rec(0), rec(1), rec(3)]


async def test_a_last_record_with_a_bad_checksum_is_cut(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "j")
    await write_file(path, [rec(0), rec(1)])
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    fd, found, _ = open_for_append(path)
    os.close(fd)
    assert found == 1


async def test_damage_before_the_tail_is_refused_not_misread(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "j")
    await write_file(path, [rec(0), rec(1), rec(2)])
    with open(path, "r+b") as f:
        f.seek(len(MAGIC) + 8 + 12)  # inside the first record's payload
        f.write(b"\xff\xff")
    with pytest.raises(JournalError, match=r"checksum mismatch.*offset 8"):
        open_for_append(path)


def test_a_file_that_is_not_a_journal_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "j"
    path.write_bytes(b"hello world, not a journal")
    with pytest.raises(JournalError, match="not a kvbroker journal"):
        open_for_append(str(path))


def test_an_unknown_journal_url_is_refused() -> None:
    with pytest.raises(JournalError, match="expected file://PATH"):
        open_journal("ftp://x", stream="s", maxlen=10, fsync=False, max_group=10)


async def test_redis_journal_holds_every_record_in_order_exactly_once(redis_stream_key: str) -> None:
    journal = open_journal(REDIS_URL, stream=redis_stream_key, maxlen=100_000, fsync=False, max_group=64)
    await journal.start()
    records = [rec(i, RecordKind.DIRECTIVES if i % 4 == 0 else RecordKind.BATCH) for i in range(1000)]
    for r in records:
        journal.append(r)
    await journal.close()
    assert journal.written == 1000 and journal.errors == 0
    source = JournalSource(f"{REDIS_URL}?stream={redis_stream_key}")
    assert list(source.batches()) == [r for r in records if r.kind == RecordKind.BATCH]
    assert list(source.directives()) == [r for r in records if r.kind == RecordKind.DIRECTIVES]
    client = redis.Redis.from_url(REDIS_URL)
    assert client.xlen(redis_stream_key) == 750
    client.close()


def test_reading_a_missing_redis_stream_is_a_clear_error() -> None:
    with pytest.raises(JournalError, match="does not exist"):
        JournalSource(f"{REDIS_URL}?stream=kvbroker-test:absent-stream").check()


async def test_durable_waits_until_the_record_is_written(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    journal = FileJournal(str(tmp_path / "j"))
    await journal.start()
    first = journal.append(rec(1))
    second = journal.append(rec(2))
    assert (first, second) == (1, 2)
    await asyncio.wait_for(journal.durable(second), 5)
    assert journal.written >= 2
    assert list(read_file_journal(str(tmp_path / "j")))[-2:] == [rec(1), rec(2)]
    await journal.close()


async def test_a_write_that_fails_half_way_is_cut_back_before_the_retry(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A short write (disk full, RLIMIT_FSIZE) then an error: the retry must not land after
    the torn bytes (it did: the journal then refused to open, "checksum mismatch ... before
    the tail"). Failed on main."""
    path = str(tmp_path / "j")
    journal = FileJournal(path)
    await journal.start()
    journal.append(rec(0))
    await journal.flush()
    real_pwrite = os.pwrite
    calls = {"n": 0}

    def short_then_fail(fd: int, data, offset: int) -> int:  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            return real_pwrite(fd, bytes(data[:7]), offset)  # 7 bytes land, then the disk is full
        if calls["n"] == 2:
            raise OSError(27, "File too large")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", short_then_fail)
    journal.append(rec(1))
    journal.append(rec(2))
    await journal.flush()
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    await journal.close()
    assert journal.errors == 1 and journal.torn_bytes_cut == 7
    assert list(read_file_journal(path)) == [rec(0), rec(1), rec(2)]
    fd, found, _ = open_for_append(path)
    os.close(fd)
    assert found == 3


async def test_a_second_writer_on_one_journal_file_is_refused_with_the_holders_pid(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "j")
    first = FileJournal(path)
    await first.start()
    try:
        with pytest.raises(JournalError, match=rf"in use by another broker \(pid {os.getpid()}"):
            await FileJournal(path).start()
    finally:
        await first.close()
    again = FileJournal(path)  # released on close
    await again.start()
    await again.close()
