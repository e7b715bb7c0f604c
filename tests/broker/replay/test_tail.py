"""broker.replay.tail: each writer's trailer counts its own batches, so a journal two engine
runs wrote (a restart on the same journal) is checked run by run."""

from __future__ import annotations

from pathlib import Path

from broker.journal import JournalSource
from broker.journal.file import read_file_journal
from broker.journal.records import MAGIC, JournalRecord, RecordKind, encode
from broker.journal.trailer import Trailer, TrailerTally
from broker.model.apply import client_key
from broker.replay.tail import check_tail
from kvbroker.v1 import intent_pb2 as pb
from vllm_integration.decisions_to_vllm import intent_bytes
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.settings import OffloadSettings


def run_engine(path: Path, batches: int) -> None:
    core = EmbeddedCore(OffloadSettings(journal=f"file://{path}", client_id="engine"), 1000)
    for n in range(batches):
        core.apply([intent_bytes.cleared(intent_bytes.timestamp(n + 1))])
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


def test_a_serve_journal_is_counted_client_by_client_and_tenant_by_tenant(tmp_path: Path) -> None:
    # kvbroker serve's trailers (broker.service): one per client, keyed as the cores key
    # clients (client_key), so one client id under two tenants, each numbering its batches
    # from 1, is counted apart. Keyed by client id alone, the second tenant's lost batch
    # was hidden by the first tenant's batches at the same seqs.
    def batch(tenant: str, seq: int) -> JournalRecord:
        raw = pb.IntentBatch(client_id="engine", batch_seq=seq, tenant=tenant).SerializeToString()
        return JournalRecord(RecordKind.BATCH, 1, 1, raw)

    first, second = TrailerTally(), TrailerTally()
    records = []
    for seq in (1, 2, 3):
        records.append(batch("acme", seq))
        first.add(client_key("acme", "engine"), seq)
    records += [t.record(1, 1) for t in first.trailers()]  # the first process stopped cleanly
    for seq in (1, 2, 3):
        if seq != 2:  # lost
            records.append(batch("globex", seq))
        second.add(client_key("globex", "engine"), seq)
    records += [t.record(1, 1) for t in second.trailers()]
    path = tmp_path / "journal"
    path.write_bytes(MAGIC + b"".join(encode(r) for r in records))
    tail = check_tail(JournalSource(str(path)))
    assert (tail.state, tail.missing) == ("cut", 1)
    assert "client engine (tenant globex): 2 of 3, first missing batch seq 2" in tail.message


def test_a_tally_counts_lowest_highest_and_how_many() -> None:
    tally = TrailerTally()
    for client, seq in [("a", 5), ("b", 1), ("a", 6), ("a", 7), ("b", 2)]:
        tally.add(client, seq)
    assert tally.trailers() == [Trailer("a", 5, 7, 3), Trailer("b", 1, 2, 2)]
    one = TrailerTally()
    for seq in (3, 1, 2):  # out of order (two tenants' numbering under one key): lowest and highest
        one.add("c", seq)
    assert one.trailers() == [Trailer("c", 1, 3, 3)]
