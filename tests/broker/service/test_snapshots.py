"""``serve``'s snapshots (issue 41, item 14): a restart starts from the last one and applies
only the journal's tail, into the state a restart from the first record reaches; ``replay
--verify`` checks them; the interval is a bounded config key."""

from __future__ import annotations

import asyncio
import pickle
import random
import subprocess
import sys
import zlib
from collections.abc import Iterable
from pathlib import Path

import pytest

from broker.config import ConfigError, parse_config
from broker.journal import JournalRecord, JournalSource, RecordKind
from broker.journal.base import NullJournal
from broker.journal.file import FileJournal, read_file_journal
from broker.journal.records import MAGIC, JournalError, encode
from broker.journal.snapshots import HEAD, STATE, fingerprint, load_state, parse
from broker.journal.snapshots import MAGIC as SNAP_MAGIC
from broker.journal.stream import last_snapshot
from broker.model.wire import read_batch
from broker.service.broker_service import BrokerService, UnreadableSnapshot
from kvbroker.v1 import intent_pb2 as pb
from tests.builders import access, alloc, free

KVBROKER = Path(sys.executable).parent / "kvbroker"


def config_text(path: Path, every: int = 1000) -> str:
    return f"""
[policy]
name = "arc"
[journal]
url = "file://{path}"
snapshot_batches = {every}
[[tiers]]
name = "hbm"
capacity = 300000
[[tiers]]
name = "dram"
capacity = 100000000
"""


class Feed:
    def __init__(self) -> None:
        self.rng = random.Random(7)
        self.seq = 0
        self.live: list[str] = []
        self.n = 0

    def next(self) -> bytes:
        self.seq += 1
        ts = self.seq * 10
        events = []
        for _ in range(3):
            events.append(alloc(f"b{self.n}", 1000, ts=ts))
            self.live.append(f"b{self.n}")
            self.n += 1
        events.append(access(*self.rng.sample(self.live, min(4, len(self.live))), ts=ts + 1))
        if len(self.live) > 2000:
            gone = [self.live.pop(self.rng.randrange(len(self.live))) for _ in range(3)]
            events.append(free(*gone, ts=ts + 2))
        return pb.IntentBatch(client_id="engine", batch_seq=self.seq, events=events).SerializeToString()


def submit(service: BrokerService, raw: bytes) -> bytes:
    answer, _ = service.submit(read_batch(raw), raw)
    return answer.data


async def serve_batches(path: Path, batches: int, feed: Feed) -> str:
    """A broker service on a file journal with snapshots every 1,000 batches; each snapshot's
    copy is let arrive before 200 more batches. Returns the live state's fingerprint."""
    config = parse_config(config_text(path))
    journal = FileJournal(str(path))
    await journal.start()
    service = BrokerService(config, journal)
    for i in range(batches):
        submit(service, feed.next())
        if service.snapshots.copy is not None and i % 1000 == 100:
            assert service.snapshots.copy.wait(60)
        if i % 100 == 0:
            await asyncio.sleep(0)
    live = fingerprint(service.driving)
    await journal.close()
    return live


def restart(path: Path, records: Iterable[JournalRecord]) -> BrokerService:
    config = parse_config(config_text(path).replace(f'url = "file://{path}"', 'url = "none"'))
    return BrokerService(config, NullJournal(512), records)


def test_a_restart_starts_from_the_last_snapshot_and_applies_only_the_tail(tmp_path: Path) -> None:
    path = tmp_path / "j.journal"
    feed = Feed()
    live = asyncio.run(serve_batches(path, 2600, feed))
    kinds = [r.kind for r in read_file_journal(str(path))]
    assert kinds.count(RecordKind.SNAPSHOT) == 4  # two marks, two states
    source = JournalSource(str(path))
    tail = restart(path, source.recovery())
    assert tail.recovered_snapshot == 2 and tail.recovered_batches == 600  # batches 2,001..2,600
    whole = restart(path, source.ordered())
    assert whole.recovered_snapshot is None and whole.recovered_batches == 2600
    assert fingerprint(tail.driving) == fingerprint(whole.driving) == live
    # The policies' own state came back too: both decide the next batches alike.
    for _ in range(300):
        raw = feed.next()
        assert submit(tail, raw) == submit(whole, raw)
    assert whole.core.stats.evictions + whole.core.stats.demotions > 0
    # And replay --verify checks both snapshots against its own replay.
    out = subprocess.run([str(KVBROKER), "replay", "--journal", str(path), "--verify", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert '"snapshots_checked": 2' in out.stdout and '"snapshots_wrong": 0' in out.stdout


def test_a_wrong_or_forged_snapshot_is_named_by_verify_and_not_started_from(tmp_path: Path) -> None:
    path = tmp_path / "j.journal"
    asyncio.run(serve_batches(path, 1300, Feed()))
    records = list(read_file_journal(str(path)))
    [state_at] = [i for i, r in enumerate(records) if r.kind == RecordKind.SNAPSHOT and parse(r.payload)[1] == STATE]
    state = load_state(records[state_at].payload)
    # A state that is not the one at its mark: one block moved to another tier.
    core = state.core
    block = next(b for b in core.blocks.values() if b.tier == 0)
    block.tier = 1
    forged = JournalRecord(RecordKind.SNAPSHOT, 1, records[state_at].generation, records[state_at].payload[: HEAD.size])
    wrong = JournalRecord(forged.kind, 1, forged.generation, forged.payload + zlib.compress(pickle.dumps(state)))
    rewrite(path, records, state_at, wrong)
    out = subprocess.run([str(KVBROKER), "replay", "--journal", str(path), "--verify"], capture_output=True, text=True)
    assert out.returncode == 1 and "1 of 1 snapshots wrong" in out.stderr and "differs from the replay's at its mark" in out.stderr
    # A state that would run code when read: refused in one line, and a restart reads the
    # journal from its first record instead.
    evil = zlib.compress(pickle.dumps(subprocess.Popen))
    rewrite(path, records, state_at, JournalRecord(forged.kind, 1, forged.generation, forged.payload + evil))
    with pytest.raises(JournalError, match=r"cannot be read back .*may not build subprocess\.Popen"):
        load_state(forged.payload + evil)
    with pytest.raises(UnreadableSnapshot):
        restart(path, JournalSource(str(path)).recovery())
    assert last_snapshot(str(path)) is not None


def rewrite(path: Path, records: list[JournalRecord], index: int, record: JournalRecord) -> None:
    with open(path, "wb") as f:
        f.write(MAGIC)
        for i, r in enumerate(records):
            f.write(encode(record if i == index else r))


def test_a_restart_by_serve_falls_back_to_the_first_record_when_the_snapshot_cannot_be_read(tmp_path: Path) -> None:
    from broker.service.server import start_broker

    path = tmp_path / "j.journal"
    live = asyncio.run(serve_batches(path, 1300, Feed()))
    records = list(read_file_journal(str(path)))
    [state_at] = [i for i, r in enumerate(records) if r.kind == RecordKind.SNAPSHOT and parse(r.payload)[1] == STATE]
    head = HEAD.pack(SNAP_MAGIC, 1, STATE)
    rewrite(path, records, state_at, JournalRecord(RecordKind.SNAPSHOT, 1, 1, head + b"not zlib"))

    async def start() -> tuple[str, int]:
        config = parse_config(config_text(path) + '\n[broker]\nlisten = "127.0.0.1:0"\n')
        broker = await start_broker(config)
        try:
            return fingerprint(broker.service.driving), broker.service.recovered_batches
        finally:
            await broker.stop(0)

    state, batches = asyncio.run(start())
    assert batches == 1300 and state == live


@pytest.mark.parametrize("value", ["5", "-1", "999", "2000000000", "1.5", '"1000"', "true"])
def test_snapshot_batches_is_bounded_and_refused_in_one_line(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match=r"^journal\.snapshot_batches: ") as exc:
        parse_config(config_text(tmp_path / "j", 1000).replace("snapshot_batches = 1000", f"snapshot_batches = {value}"))
    assert "\n" not in str(exc.value)
    assert parse_config(config_text(tmp_path / "j", 0)).journal.snapshot_batches == 0
    assert parse_config(config_text(tmp_path / "j", 1000)).journal.snapshot_batches == 1000


def test_a_bad_record_after_the_snapshot_is_named_by_its_place_in_the_file(tmp_path: Path) -> None:
    from broker.journal.file import file_records
    from broker.service.server import start_broker

    path = tmp_path / "j.journal"
    asyncio.run(serve_batches(path, 1300, Feed()))
    records = list(read_file_journal(str(path)))
    batch_at = [i for i, r in enumerate(records) if r.kind == RecordKind.BATCH][1200]
    rewrite(path, records, batch_at, JournalRecord(RecordKind.BATCH, 1, 1, b"\xff\xff\xff not a batch"))
    offset = [o for o, _ in file_records(str(path))][batch_at]

    async def start() -> None:
        config = parse_config(config_text(path) + '\n[broker]\nlisten = "127.0.0.1:0"\n')
        await start_broker(config)

    with pytest.raises(JournalError) as exc:
        asyncio.run(start())
    assert f"record {batch_at + 1} (a BATCH record at byte offset {offset})" in str(exc.value)
    assert "not a valid IntentBatch" in str(exc.value) and "kvbroker repair" in str(exc.value)


def test_repair_keeps_snapshots_and_cuts_a_forged_one(tmp_path: Path) -> None:
    path = tmp_path / "j.journal"
    asyncio.run(serve_batches(path, 1300, Feed()))
    check = subprocess.run([str(KVBROKER), "repair", "--check", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    records = list(read_file_journal(str(path)))
    mark_at = next(i for i, r in enumerate(records) if r.kind == RecordKind.SNAPSHOT)
    rewrite(path, records, mark_at, JournalRecord(RecordKind.SNAPSHOT, 1, 1, b"no snapshot header here, but long enough"))
    check = subprocess.run([str(KVBROKER), "repair", "--check", str(path)], capture_output=True, text=True)
    assert check.returncode == 1 and "not a snapshot mark or state" in check.stdout + check.stderr
