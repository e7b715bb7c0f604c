"""A record whose frame and checksum are sound but whose payload is not what its kind says:
repair cuts it (and only it), replay and recovery name it instead of a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.config import CoreConfig, core_to_json, parse_config
from broker.journal import JournalError, JournalSource
from broker.journal.base import NullJournal
from broker.journal.file import repair_file_journal
from broker.journal.payloads import BadRecord, payload_problem
from broker.journal.records import MAGIC, JournalRecord, RecordKind, encode
from broker.replay.replay import journal_batches, replay
from broker.service.broker_service import BrokerService
from kvbroker.v1 import intent_pb2 as pb

CONFIG = JournalRecord(RecordKind.CONFIG, 1, 1, core_to_json(CoreConfig()).encode())
GARBAGE = b"\xff\xff\xff\xff not a batch"


def batch(seq: int) -> JournalRecord:
    event = pb.Event(ts_us=seq, freed=pb.BlocksFreed(block_ids=[f"b{seq}"]))
    return JournalRecord(RecordKind.BATCH, 1, 1, pb.IntentBatch(client_id="c", batch_seq=seq, events=[event]).SerializeToString())


def write(path: Path, *records: JournalRecord | bytes) -> list[int]:
    """Write the records (bytes: written as they are, a tear); the offset of each."""
    offsets, data = [], MAGIC
    for r in records:
        offsets.append(len(data))
        data += r if isinstance(r, bytes) else encode(r)
    path.write_bytes(data)
    return offsets


@pytest.mark.parametrize(
    "record,words",
    [
        (JournalRecord(RecordKind.BATCH, 1, 1, GARBAGE), "not a valid IntentBatch"),
        (JournalRecord(RecordKind.DIRECTIVES, 1, 1, GARBAGE), "not a valid DirectiveBatch"),
        (JournalRecord(RecordKind.CONFIG, 1, 1, b"{not json"), "not a config"),
        (JournalRecord(RecordKind.CONFIG, 1, 1, b'{"tiers": 3}'), "not a config"),
        (JournalRecord(RecordKind.CONFIG, 1, 1, b"\xff"), "not UTF-8"),
    ],
)
def test_payload_problem_says_why(record: JournalRecord, words: str) -> None:
    assert words in (payload_problem(record) or "")


def test_sound_payloads_have_no_problem() -> None:
    assert payload_problem(CONFIG) is None and payload_problem(batch(1)) is None


def test_repair_cuts_only_the_bad_record(tmp_path: Path) -> None:
    path = tmp_path / "j.journal"
    bad = JournalRecord(RecordKind.BATCH, 1, 1, GARBAGE)
    offsets = write(path, CONFIG, batch(1), bad, batch(1), batch(2))
    report = repair_file_journal(str(path), write=True)
    # The batch after the bad record repeats the one before it: kept, a tear's retried
    # group is not what a bad record is.
    assert report.records_kept == 4 and report.records_repeated == 0
    assert report.cuts == ((offsets[2], len(encode(bad))),)
    assert [o for o, _ in report.bad_records] == [offsets[2]]
    assert path.read_bytes() == MAGIC + b"".join(encode(r) for r in (CONFIG, batch(1), batch(1), batch(2)))


def test_repair_of_a_bad_record_and_a_tear(tmp_path: Path) -> None:
    path = tmp_path / "j.journal"
    offsets = write(path, CONFIG, batch(1), b"\x05\x00\x00\x00torn", JournalRecord(RecordKind.CONFIG, 1, 2, b"{"), batch(2))
    report = repair_file_journal(str(path), write=False)
    assert report.records_kept == 3
    assert [o for o, _ in report.cuts] == [offsets[2], offsets[3]]
    assert [o for o, _ in report.bad_records] == [offsets[3]]


def test_replay_names_the_record_and_its_offset(tmp_path: Path) -> None:
    path = tmp_path / "j.journal"
    offsets = write(path, CONFIG, batch(1), JournalRecord(RecordKind.DIRECTIVES, 1, 1, b""), JournalRecord(RecordKind.BATCH, 1, 1, GARBAGE))
    where = f"record 4 \\(a BATCH record at byte offset {offsets[3]}\\)"
    with pytest.raises(JournalError, match=f"{where}: its payload is not a valid IntentBatch"):
        replay(journal_batches(JournalSource(f"file://{path}")), CoreConfig(), "lru")


def test_recovery_raises_bad_record_with_its_index() -> None:
    config = parse_config("")
    with pytest.raises(BadRecord) as caught:
        BrokerService(config, NullJournal(1), [CONFIG, batch(1), JournalRecord(RecordKind.BATCH, 1, 1, GARBAGE)])
    assert caught.value.index == 2 and "not a valid IntentBatch" in caught.value.reason
    with pytest.raises(BadRecord) as caught:
        BrokerService(config, NullJournal(1), [JournalRecord(RecordKind.CONFIG, 1, 1, b"{")])
    assert caught.value.index == 0 and "not a config" in caught.value.reason
