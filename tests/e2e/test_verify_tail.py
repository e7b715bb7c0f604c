"""`kvbroker replay --verify` checks a journal's batches against its writer's trailer: it
says yes only on a journal that holds every batch counted, fails (exit 1) on one that lacks
some, and says when it cannot tell (no trailer). A torn tail is named on any replay."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from broker.journal.file import read_file_journal
from broker.journal.records import MAGIC, RecordKind, encode
from vllm_integration.decisions_to_vllm import intent_bytes
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.settings import OffloadSettings

pytestmark = pytest.mark.e2e

KVBROKER = Path(sys.executable).parent / "kvbroker"
BATCHES = 300


def write_journal(path: Path) -> None:
    """A closed embedded journal: the start, 300 batches of one allocation each (room for
    all: no directive, so a lost batch changes no decision the directives could show), the
    trailer."""
    core = EmbeddedCore(OffloadSettings(policy="lru", journal=f"file://{path}", client_id="tail-test"), 10_000)
    intent = intent_bytes.intent_fields("r")
    for n in range(BATCHES):
        core.apply([intent_bytes.allocated(intent_bytes.timestamp(n + 1), intent_bytes.id_field(f"c{n}"), intent)])
    core.close()


def verify(path: Path) -> tuple[int, dict[str, object], str]:
    done = subprocess.run(
        [str(KVBROKER), "replay", "--journal", str(path), "--verify", "--policy", "lru", "--json", "--jobs", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, json.loads(done.stdout)[0] if done.stdout.strip() else {}, done.stderr


def test_verify_says_yes_on_a_whole_journal(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    write_journal(path)
    assert [r.kind for r in read_file_journal(str(path))][-1] == RecordKind.TRAILER
    code, record, err = verify(path)
    assert code == 0, err
    assert record["verified"] is True and record["tail"] == "complete" and record["missing_batches"] == 0
    assert "--verify" not in err


def test_verify_fails_on_a_journal_that_lacks_batches_its_writer_counted(tmp_path: Path) -> None:
    # A batch lost in the middle (a record cut out, the records around it and the writer's
    # trailer kept): the trailer says how many batches there were.
    path = tmp_path / "journal"
    write_journal(path)
    records = list(read_file_journal(str(path)))
    lost = next(i for i, r in enumerate(records) if r.kind == RecordKind.BATCH and i >= 150)
    path.write_bytes(MAGIC + b"".join(encode(r) for i, r in enumerate(records) if i != lost))
    code, record, err = verify(path)
    # Before: exit 0, "verified: yes" (the replay's directives, none, matched the journal's).
    assert code == 1, err
    assert record["verified"] is True and record["tail"] == "cut" and record["missing_batches"] == 1
    assert "lacks 1 batches its writer counted (client tail-test: 300 of 301, first missing batch seq" in err, err


def test_verify_says_it_cannot_tell_on_a_journal_without_a_trailer(tmp_path: Path) -> None:
    # A writer killed before it closed leaves no trailer.
    path = tmp_path / "journal"
    write_journal(path)
    kept = [r for r in read_file_journal(str(path)) if r.kind != RecordKind.TRAILER]
    path.write_bytes(MAGIC + b"".join(encode(r) for r in kept))
    code, record, err = verify(path)
    assert code == 0, err
    assert record["tail"] == "unknown"
    assert "cannot tell whether the journal's tail is whole: 301 batches of client tail-test have no writer's trailer" in err, err


def test_replay_of_a_torn_journal_says_what_was_cut(tmp_path: Path) -> None:
    # Issue 32: a torn journal replayed with no warning.
    path = tmp_path / "journal"
    write_journal(path)
    whole = path.stat().st_size
    records = len(list(read_file_journal(str(path))))
    with path.open("ab") as f:
        f.write(encode(next(iter(read_file_journal(str(path)))))[:10])  # a record cut short
    done = subprocess.run([str(KVBROKER), "replay", "--journal", str(path), "--policy", "lru"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("kvbroker replay: warning")]
    assert warnings == [
        f"kvbroker replay: warning: journal {path}: torn tail cut: 10 bytes at offset {whole} (1 record cut short) are not replayed; "
        f"replaying the {records} intact records (`kvbroker repair {path}` cuts it from the file)"
    ], done.stderr
