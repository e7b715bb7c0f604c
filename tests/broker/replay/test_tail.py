"""broker.replay.tail: each writer's trailer counts its own batches, so a journal two engine
runs wrote (a restart on the same journal) is checked run by run."""

from __future__ import annotations

from pathlib import Path

from broker.journal import JournalSource
from broker.journal.file import read_file_journal
from broker.journal.records import MAGIC, RecordKind, encode
from broker.offload import events
from broker.offload.embedded import EmbeddedCore
from broker.offload.settings import OffloadSettings
from broker.replay.tail import check_tail


def run_engine(path: Path, batches: int) -> None:
    core = EmbeddedCore(OffloadSettings(journal=f"file://{path}", client_id="engine"), 1000)
    for n in range(batches):
        core.apply([events.cleared(events.timestamp(n + 1))])
    core.close()


def test_two_runs_on_one_journal_are_each_counted_by_their_own_trailer(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    run_engine(path, 20)
    run_engine(path, 30)
    records = list(read_file_journal(str(path)))
    assert [r.kind for r in records].count(RecordKind.TRAILER) == 2
    assert check_tail(JournalSource(str(path))).state == "complete"

    # The second run killed before it closed: its 31 batches (the start's included) have
    # no trailer; the first run's 21 are still counted whole.
    kept = records[: len(records) - 1]
    path.write_bytes(MAGIC + b"".join(encode(r) for r in kept))
    tail = check_tail(JournalSource(str(path)))
    assert (tail.state, tail.missing) == ("unknown", 0)
    assert "31 batches of client engine have no writer's trailer" in tail.message

    # The first run's last batch gone as well (before its trailer): that run is cut.
    first_trailer = next(i for i, r in enumerate(kept) if r.kind == RecordKind.TRAILER)
    cut = kept[: first_trailer - 1] + kept[first_trailer:]
    path.write_bytes(MAGIC + b"".join(encode(r) for r in cut))
    tail = check_tail(JournalSource(str(path)))
    assert (tail.state, tail.missing) == ("cut", 1)
    assert "client engine: 20 of 21, first missing batch seq" in tail.message
