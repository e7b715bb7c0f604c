"""A file journal is read as a stream (issue 41, item 14): reading it back, opening it to
append and recovering a broker from it hold one record at a time, not the file."""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.config import core_to_json, parse_config
from broker.journal import JournalSource
from broker.journal.base import NullJournal
from broker.journal.file import file_records, open_for_append, read_file_journal, torn_tail
from broker.journal.records import MAGIC, JournalError, JournalRecord, RecordKind, encode, scan
from broker.service.broker_service import BrokerService
from kvbroker.v1 import intent_pb2 as pb
from tests.builders import access

RECORDS = 400
PAYLOAD = 50_000  # 20 MB in all
BOUND = 2 * 2**20  # what a stream may hold at once: a few records and a read buffer


def write_journal(path: Path, payloads: Iterator[bytes]) -> None:
    with open(path, "wb") as f:
        f.write(MAGIC)
        for i, payload in enumerate(payloads):
            f.write(encode(JournalRecord(RecordKind.BATCH, 1, 1 + i // 100, payload)))


def peak_bytes(work: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def big_payloads() -> Iterator[bytes]:
    for i in range(RECORDS):
        yield bytes([i % 251]) * PAYLOAD


def test_reading_a_journal_back_holds_one_record_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "j.journal"
    write_journal(path, big_payloads())
    assert os.path.getsize(path) > 8 * BOUND
    seen: list[tuple[int, int]] = []

    def read() -> None:
        for record in read_file_journal(str(path)):
            seen.append((record.payload[0], len(record.payload)))

    assert peak_bytes(read) < BOUND
    assert seen == [(i % 251, PAYLOAD) for i in range(RECORDS)]
    # The same records, the same offsets, as the whole-image reader gives.
    whole, _ = scan(path.read_bytes(), str(path))
    assert [r for _, r in file_records(str(path))] == whole
    offsets = [offset for offset, _ in file_records(str(path))]
    assert offsets[0] == len(MAGIC) and offsets[1] == len(MAGIC) + len(encode(whole[0]))
    assert peak_bytes(lambda: open_for_append(str(path))) < BOUND
    assert peak_bytes(lambda: torn_tail(str(path))) < BOUND


def test_a_torn_tail_ends_the_stream_and_damage_before_it_raises(tmp_path: Path) -> None:
    path = tmp_path / "j.journal"
    write_journal(path, (bytes([i]) * 100 for i in range(5)))
    whole = path.read_bytes()
    path.write_bytes(whole[:-30])  # the last record cut short
    assert [r.payload[0] for r in read_file_journal(str(path))] == [0, 1, 2, 3]
    tail = torn_tail(str(path))
    assert tail is not None and tail.records_kept == 4
    fd, count, good = open_for_append(str(path))
    os.close(fd)
    assert count == 4 and good == os.path.getsize(path)  # the tail was cut
    damaged = bytearray(whole)
    damaged[len(MAGIC) + 20] ^= 0xFF  # inside the first record's payload
    path.write_bytes(bytes(damaged))
    with pytest.raises(JournalError, match="checksum mismatch in the record at offset 8, before the tail"):
        list(read_file_journal(str(path)))
    path.write_bytes(b"NOTAJRNL" + whole[8:])
    with pytest.raises(JournalError, match="bad magic"):
        list(read_file_journal(str(path)))
    path.write_bytes(MAGIC[:5])
    assert list(read_file_journal(str(path))) == [] and torn_tail(str(path)) is None


def test_recovery_applies_the_journal_as_it_is_read(tmp_path: Path) -> None:
    """A broker starting on a journal applies each record as it is read: the records already
    applied are not kept (before, the whole journal was read into a list first)."""
    config = parse_config('[journal]\nurl = "none"\n[[tiers]]\nname = "hbm"\ncapacity = 1000000\n')
    # Batches of 50 KB each (accesses of blocks nobody allocated: refused, no state kept).
    ids = [f"{'x' * 90}{n:05d}" for n in range(500)]

    def journal() -> Iterator[JournalRecord]:
        yield JournalRecord(RecordKind.CONFIG, 1, 1, core_to_json(config.core).encode())
        for seq in range(1, RECORDS + 1):
            batch = pb.IntentBatch(client_id="c", batch_seq=seq, events=[access(*ids)])
            yield JournalRecord(RecordKind.BATCH, 1, 1, batch.SerializeToString())

    total = sum(len(r.payload) for r in journal())
    assert total > 8 * BOUND
    services: list[BrokerService] = []
    assert peak_bytes(lambda: services.append(BrokerService(config, NullJournal(512), journal()))) < BOUND
    assert services[0].recovered_batches == RECORDS
    assert services[0].core.client_seq["c"] == RECORDS


def test_serve_recovery_reads_the_file_journal_as_a_stream(tmp_path: Path) -> None:
    """``JournalSource.ordered()`` of a file, what recovery reads, is a stream too."""
    path = tmp_path / "j.journal"
    write_journal(path, big_payloads())
    count = 0

    def read() -> None:
        nonlocal count
        for _ in JournalSource(str(path)).ordered():
            count += 1

    assert peak_bytes(read) < BOUND and count == RECORDS


def test_repair_holds_no_copy_of_the_journal(tmp_path: Path) -> None:
    """`kvbroker repair` (and --check) of a large journal (issue 41, item 14): the file is
    mapped and scanned, no record's bytes kept (before: the whole image read, then every
    record's bytes kept beside it, 6 GiB RSS for a 2 GiB journal); and a repair that cuts a
    tear writes the same records as before, the retried group once."""
    from broker.journal.file import repair_file_journal

    ids = [f"{'x' * 90}{n:05d}" for n in range(500)]
    records = [
        encode(JournalRecord(RecordKind.BATCH, 1, 1, pb.IntentBatch(client_id="c", batch_seq=s, events=[access(*ids)]).SerializeToString()))
        for s in range(1, RECORDS + 1)
    ]
    path = tmp_path / "j.journal"
    path.write_bytes(MAGIC + b"".join(records))
    assert os.path.getsize(path) > 8 * BOUND
    reports = []
    assert peak_bytes(lambda: reports.append(repair_file_journal(str(path), write=False))) < BOUND
    assert reports[0].records_kept == RECORDS and not reports[0].cuts
    # A tear (a write cut short), then the group retried: records 198-199 again, then the rest.
    torn = MAGIC + b"".join(records[:200]) + records[200][:1000] + b"".join(records[198:])
    path.write_bytes(torn)
    assert peak_bytes(lambda: reports.append(repair_file_journal(str(path), write=True))) < BOUND
    fixed = reports[-1]
    assert (fixed.records_kept, fixed.records_repeated, fixed.cuts) == (RECORDS, 2, ((len(MAGIC) + sum(map(len, records[:200])), 1000),))
    assert path.read_bytes() == MAGIC + b"".join(records)
