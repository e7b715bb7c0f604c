"""TRAILER records (a writer's closing count) are records like the others: `repair` keeps
them and `repair --check` calls a journal holding them sound (issue 41 item 10, issue 40
item 6); a forged one is named in one line, never a traceback (issue 41 item 15)."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.cli.main import main
from broker.journal import JournalError, JournalSource
from broker.journal.file import read_file_journal
from broker.journal.payloads import payload_problem
from broker.journal.records import JournalRecord, RecordKind, encode
from broker.journal.trailer import Trailer
from broker.replay.tail import check_tail
from tests.broker.replay.test_tail import run_engine


def test_repair_check_calls_a_journal_with_trailers_sound_and_repair_keeps_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "clean.journal"
    run_engine(path, 5)
    run_engine(path, 4)  # two writers, each closing cleanly: two trailers
    before = path.read_bytes()
    assert sum(r.kind == RecordKind.TRAILER for r in read_file_journal(str(path))) == 2
    assert check_tail(JournalSource(str(path))).state == "complete"

    assert main(["repair", "--check", str(path)]) == 0
    assert "sound" in capsys.readouterr().out
    assert main(["repair", str(path)]) == 0
    assert path.read_bytes() == before  # nothing cut: the trailers are still there
    assert check_tail(JournalSource(str(path))).state == "complete"


def test_repair_cuts_a_forged_trailer_and_keeps_the_real_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "forged.journal"
    run_engine(path, 3)
    forged = JournalRecord(RecordKind.TRAILER, 1, 1, b'{"client_id": "engine", "first_seq": 1, "last_seq": 3, "batches": 1e400}')
    with path.open("ab") as f:
        f.write(encode(forged))
    assert main(["repair", "--check", "--json", str(path)]) == 1
    out = capsys.readouterr().out
    assert "its trailer payload is not a trailer (batches: expected an integer" in out
    assert main(["repair", str(path)]) == 0
    kinds = [r.kind for r in read_file_journal(str(path))]
    assert kinds.count(RecordKind.TRAILER) == 1


FORGED = [
    (b'{"client_id": "c", "first_seq": 1, "last_seq": 2, "batches": 1e400}', "batches: expected an integer in 0..2^64-1, got Infinity"),
    (b'{"client_id": "c", "first_seq": 1, "last_seq": 2, "batches": 2.5}', "batches: expected an integer"),
    (b'{"client_id": "c", "first_seq": 1, "last_seq": 18446744073709551616, "batches": 2}', "last_seq: expected an integer"),
    (b'{"client_id": "c", "first_seq": true, "last_seq": 2, "batches": 2}', "first_seq: expected an integer"),
    (b'{"client_id": ' + b"[" * 100_000 + b"]" * 100_000 + b', "first_seq": 1}', "nested too deep"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
    (b'{"client_id": ' + b"[" * 500 + b"]" * 500 + b', "first_seq": 1, "last_seq": 1, "batches": 1}', "client_id: expected a string"),
    (b"[1, 2]", "expected a JSON object"),
    (b"\xff", "malformed trailer record"),
    (b'{"client_id": "c", "first_seq": 1, "last_seq": 2, "batches": ' + b"9" * 5000 + b"}", "malformed trailer record"),
]


@pytest.mark.parametrize("payload,words", FORGED, ids=[w.split(":")[0][:20] + str(i) for i, (_, w) in enumerate(FORGED)])
def test_a_forged_trailer_is_a_journal_error_naming_the_field(payload: bytes, words: str) -> None:
    record = JournalRecord(RecordKind.TRAILER, 1, 1, payload)
    with pytest.raises(JournalError, match="malformed trailer record") as info:
        Trailer.from_record(record)
    assert words in str(info.value)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300
    assert "not a trailer" in (payload_problem(record) or "")


def test_replay_verify_of_a_journal_with_a_forged_trailer_says_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "forged.journal"
    run_engine(path, 3)
    with path.open("ab") as f:
        f.write(encode(JournalRecord(RecordKind.TRAILER, 1, 1, b"[" * 100_000 + b"]" * 100_000)))
    assert main(["replay", "--journal", str(path), "--policy", "lru", "--verify"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]  # after the progress line of the replay itself
    forged_number = len(list(read_file_journal(str(path))))  # the last record
    assert last.startswith("kvbroker replay: --journal: ") and f"record {forged_number} (a TRAILER record at byte offset" in last
    assert last.endswith("malformed trailer record: nested too deep")
