"""The bounded local spool of the Redis journal (issue 7): Redis goes away mid-stream, the
broker keeps answering, the spool drains in order when Redis is back, and a full spool
refuses or drops as configured, never silently.

Unit tests drive ``Spool`` and ``SpooledJournal`` against an in-memory backend that can
fail (even after applying a write, as a lost reply does); the rest run a real broker and a
``redis-server`` owned by the test on a free loopback port, stopped by pid and restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import cast

import pytest

from broker.config import BrokerConfig, ConfigError, config_to_toml, parse_config
from broker.journal import JournalError, JournalRecord, RecordKind
from broker.journal.spool import HEADER, Spool, SpooledJournal
from broker.service.health import JournalWatch
from broker.service.server import RunningBroker, start_broker
from clients.broker_client import BrokerClient
from kvbroker.v1 import intent_pb2 as pb
from tests.conftest import small_config
from tests.redis_server import RedisServer, free_port


def rec(i: int, kind: RecordKind = RecordKind.BATCH, size: int = 20) -> JournalRecord:
    return JournalRecord(kind, 1, 1, i.to_bytes(4, "big") + b"x" * (size - 4))


def number(record: JournalRecord) -> int:
    return int.from_bytes(record.payload[:4], "big")


async def wait_for(predicate: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


# ---- the spool file ---------------------------------------------------------------------------


def test_spool_reads_back_every_record_in_order_in_chunks(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path / "d"), "s.spool", 1 << 20)
    spool.create(b"e" * 16, 41)
    spool.append([rec(i) for i in range(5)])
    spool.append([rec(i) for i in range(5, 12)])
    assert spool.active and spool.records == 12 and spool.undrained == 12
    seen: list[int] = []
    for _ in range(20):
        got, pos = spool.read(5)
        if not got:
            break
        spool.advance(len(got), pos)
        seen += [number(r) for r in got]
    assert seen == list(range(12)) and spool.undrained == 0
    assert spool.size == os.path.getsize(spool.path)
    spool.remove()
    assert not os.path.exists(spool.path) and not spool.active and spool.size == 0


def test_spool_never_grows_past_max_bytes(tmp_path: Path) -> None:
    one = 8 + 11 + 20  # frame (length, CRC), body header, payload
    spool = Spool(str(tmp_path), "s.spool", HEADER.size + 3 * one)
    spool.create(os.urandom(16), 0)
    assert spool.fits(3 * one) and not spool.fits(3 * one + 1)
    spool.append([rec(0), rec(1)])
    with pytest.raises(JournalError, match="exceed max_bytes"):
        spool.append([rec(2), rec(3)])
    assert spool.records == 2 and os.path.getsize(spool.path) == spool.size <= spool.max_bytes


@pytest.mark.parametrize("cut", [1, 5, 9, 30])
def test_a_torn_spool_tail_is_cut_and_the_rest_drains(tmp_path: Path, cut: int) -> None:
    spool = Spool(str(tmp_path), "s.spool", 1 << 20, fsync=True)
    spool.create(b"a" * 16, 7)
    spool.append([rec(i) for i in range(4)])
    spool.close()
    size = os.path.getsize(spool.path)
    os.truncate(spool.path, size - cut)  # a crash in the middle of the last append
    again = Spool(str(tmp_path), "s.spool", 1 << 20)
    assert again.open_existing() == 3
    assert again.epoch == b"a" * 16 and again.base_seq == 7
    assert os.path.getsize(again.path) == again.size < size - cut + 1
    again.append([rec(9)])  # appends go after the cut, never after garbage
    got, _ = again.read(10)
    assert [number(r) for r in got] == [0, 1, 2, 9]


def test_damage_before_the_spool_tail_is_refused(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path), "s.spool", 1 << 20)
    spool.create(b"a" * 16, 0)
    spool.append([rec(i) for i in range(3)])
    spool.close()
    with open(spool.path, "r+b") as f:
        f.seek(HEADER.size + 12)
        f.write(b"\xff")
    with pytest.raises(JournalError, match="checksum mismatch"):
        Spool(str(tmp_path), "s.spool", 1 << 20).open_existing()


def test_a_spool_torn_in_its_header_holds_nothing(tmp_path: Path) -> None:
    (tmp_path / "s.spool").write_bytes(b"KVBSP")
    spool = Spool(str(tmp_path), "s.spool", 1 << 20)
    assert spool.open_existing() == 0 and not spool.active and not (tmp_path / "s.spool").exists()


def test_a_spool_in_use_is_not_opened_twice(tmp_path: Path) -> None:
    first = Spool(str(tmp_path), "s.spool", 1 << 20)
    first.create(b"a" * 16, 0)
    first.append([rec(0)])
    with pytest.raises(JournalError, match="in use by another process"):
        Spool(str(tmp_path), "s.spool", 1 << 20).open_existing()
    first.close()


# ---- the spooling journal against a backend that fails -------------------------------------------


class Backend:
    """What Redis holds: entries in order, and the newest tag (epoch, seq) as XREVRANGE sees it."""

    def __init__(self) -> None:
        self.entries: list[JournalRecord] = []
        self.newest: tuple[bytes, int] | None = None
        self.down = False
        self.lose_next_reply = False  # apply the next write, then fail as a lost reply does


class FakeJournal(SpooledJournal):
    def __init__(self, backend: Backend, **kwargs: object) -> None:
        super().__init__(8, **kwargs)  # type: ignore[arg-type]
        self.backend = backend

    @property
    def description(self) -> str:
        return "fake"

    async def _write_tagged(self, group: list[JournalRecord], epoch: bytes, last_seq: int) -> None:
        await asyncio.sleep(0)
        if self.backend.down:
            raise ConnectionError("connection refused")
        self.backend.entries.extend(group)
        self.backend.newest = (epoch, last_seq)
        if self.backend.lose_next_reply:
            self.backend.lose_next_reply = False
            raise TimeoutError("reply lost")

    async def _applied(self, epoch: bytes) -> int | None:
        if self.backend.down:
            raise ConnectionError("connection refused")
        newest = self.backend.newest
        return newest[1] if newest is not None and newest[0] == epoch else None


@contextlib.asynccontextmanager
async def fake_journal(backend: Backend, tmp_path: Path, **kwargs: object) -> AsyncIterator[FakeJournal]:
    kwargs.setdefault("spool_dir", str(tmp_path / "spool"))
    journal = FakeJournal(backend, **kwargs)
    await journal.start()
    try:
        yield journal
    finally:
        backend.down = False
        await asyncio.wait_for(journal.close(), 20)


async def test_an_outage_spools_and_drains_in_order_before_newer_records(tmp_path: Path) -> None:
    backend = Backend()
    async with fake_journal(backend, tmp_path) as journal:
        for i in range(20):
            journal.append(rec(i))
        await journal.flush()
        backend.down = True
        ordinals = [journal.append(rec(i)) for i in range(20, 60)]
        # Spooled records count as written: their waiters are released during the outage.
        await asyncio.wait_for(journal.durable(ordinals[-1]), 5)
        assert journal.spool_records == 40 and journal.spool_bytes > 0 and journal.unreachable
        assert [number(r) for r in backend.entries] == list(range(20))
        backend.down = False
        for i in range(60, 80):
            journal.append(rec(i))
        await wait_for(lambda: journal.spool is not None and not journal.spool.active and journal.pending == 0, "drained")
        await journal.flush()
    assert [number(r) for r in backend.entries] == list(range(80))
    assert journal.spooled >= 40 and journal.drained == journal.spooled and journal.dropped == 0
    assert not (tmp_path / "spool" / "journal.spool").exists()


@pytest.mark.parametrize("when", ["direct", "draining"])
async def test_a_lost_reply_never_writes_a_record_twice(tmp_path: Path, when: str) -> None:
    backend = Backend()
    async with fake_journal(backend, tmp_path) as journal:
        for i in range(10):
            journal.append(rec(i))
        await journal.flush()
        if when == "draining":
            backend.down = True
            for i in range(10, 30):
                journal.append(rec(i))
            await journal.flush()
            backend.down = False
        backend.lose_next_reply = True  # the next write is applied, then reported failed
        for i in range(30, 45):
            journal.append(rec(i))
        await wait_for(lambda: journal.spool_records == 0 and journal.pending == 0 and not backend.lose_next_reply, "settled")
        await journal.flush()
    numbers = [number(r) for r in backend.entries]
    expected = list(range(10)) + (list(range(10, 30)) if when == "draining" else []) + list(range(30, 45))
    assert numbers == expected, "written twice or skipped"
    assert journal.errors >= 1


async def test_a_lost_reply_whose_records_the_spool_could_not_take_is_not_written_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write applied but reported failed (a frozen Redis), and the spool's disk refusing
    the records (RLIMIT_FSIZE): they stay queued, and once the backend answers they must be
    skipped, not written again. The emptied spool used to set the writer's position to
    what the spool held, below what the backend held, and the next direct write repeated
    the group (found by tests/e2e/test_chaos.py, seed 11). Failed before the fix."""
    backend = Backend()
    real_append = Spool.append
    refusing = {"on": False}

    def append(self: Spool, records: list[JournalRecord]) -> None:
        if refusing["on"]:
            raise OSError(27, "File too large")
        real_append(self, records)

    monkeypatch.setattr(Spool, "append", append)
    async with fake_journal(backend, tmp_path) as journal:
        for i in range(5):
            journal.append(rec(i))
        await journal.flush()
        refusing["on"] = True
        backend.lose_next_reply = True  # applied, then reported failed
        for i in range(5, 9):
            journal.append(rec(i))
        await wait_for(lambda: journal.errors >= 2, "the spool refused the records")
        # The backend answers again; the empty spool is removed with the records still queued.
        await wait_for(lambda: journal.spool is not None and not journal.spool.active, "the empty spool removed")
        refusing["on"] = False
        await asyncio.wait_for(journal.flush(), 20)
    assert [number(r) for r in backend.entries] == list(range(9)), "written twice or skipped"


async def test_a_leftover_spool_drains_first_on_restart(tmp_path: Path) -> None:
    backend = Backend()
    journal = FakeJournal(backend, spool_dir=str(tmp_path / "spool"))
    await journal.start()
    journal.append(rec(0))
    await journal.flush()
    backend.down = True
    for i in range(1, 30):
        journal.append(rec(i))
    await journal.flush()
    assert journal.spool_records == 29
    await asyncio.wait_for(journal.close(), 10)  # stopped while Redis is away: the spool stays
    assert (tmp_path / "spool" / "journal.spool").exists()
    assert [number(r) for r in backend.entries] == [0]
    backend.down = False
    again = FakeJournal(backend, spool_dir=str(tmp_path / "spool"))
    await again.start()  # drains the leftover before anything else
    try:
        assert again.spool_records == 0 and [number(r) for r in backend.entries] == list(range(30))
        again.append(rec(30))
        await again.flush()
    finally:
        await again.close()
    assert [number(r) for r in backend.entries] == list(range(31))
    assert not (tmp_path / "spool" / "journal.spool").exists()


async def test_a_leftover_spool_partly_in_the_backend_is_not_written_twice(tmp_path: Path) -> None:
    backend = Backend()
    spool = Spool(str(tmp_path / "spool"), "journal.spool", 1 << 20)
    epoch = os.urandom(16)
    spool.create(epoch, 100)
    spool.append([rec(i) for i in range(10)])
    spool.close()
    # A crash after the first 4 were drained, before the file was removed.
    backend.entries = [rec(i) for i in range(4)]
    backend.newest = (epoch, 104)
    journal = FakeJournal(backend, spool_dir=str(tmp_path / "spool"))
    await journal.start()
    await journal.close()
    assert [number(r) for r in backend.entries] == list(range(10))


async def test_a_full_spool_drops_with_a_counter_and_releases_the_waiters(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    backend = Backend()
    async with fake_journal(backend, tmp_path, spool_max_bytes=HEADER.size + 5 * 39, spool_full="drop") as journal:
        journal.append(rec(0))
        await journal.flush()
        backend.down = True
        last = 0
        for i in range(1, 21):
            last = journal.append(rec(i))
        await asyncio.wait_for(journal.durable(last), 5)  # answered: spooled or dropped
        assert journal.spool_records == 5 and journal.dropped == 15
        assert journal.saturated is True
        assert JournalWatch().update(journal) is False
        assert journal.refusal(20) is None  # drop never refuses
        backend.down = False
        await wait_for(lambda: journal.spool_records == 0 and not journal.saturated, "drained")
    assert [number(r) for r in backend.entries] == list(range(6))
    messages = [r.getMessage() for r in caplog.records if "journal_dropped" in r.getMessage()]
    assert messages and "(15 in all" in messages[-1]
    counts = [re.search(r"dropped (\d+) journal records", m) for m in messages]
    assert sum(int(c.group(1)) for c in counts if c is not None) == 15


async def test_a_full_spool_refuses_new_batches_with_a_clear_message(tmp_path: Path) -> None:
    backend = Backend()
    async with fake_journal(backend, tmp_path, spool_max_bytes=HEADER.size + 5 * 39) as journal:
        assert journal.refusal(20) is None
        journal.append(rec(0))
        await journal.flush()
        backend.down = True
        accepted = 0
        for i in range(1, 50):
            if journal.refusal(20) is not None:
                break
            journal.append(rec(i))
            accepted += 1
            await journal.flush()
        message = journal.refusal(20)
        assert message is not None and accepted == 5
        assert "fake is unreachable" in message and "journal.spool_max_bytes" in message and str(journal.spool.path) in message  # type: ignore[union-attr]
        assert journal.saturated is True and journal.pending == 0 and journal.dropped == 0
        backend.down = False
        await wait_for(lambda: journal.refusal(20) is None and journal.spool_records == 0, "accepting again")
    assert [number(r) for r in backend.entries] == list(range(6))


@pytest.mark.parametrize("policy", ["refuse", "drop"])
async def test_a_spool_that_cannot_be_created_counts_as_full(tmp_path: Path, policy: str) -> None:
    backend = Backend()
    async with fake_journal(backend, tmp_path, spool_dir=str(tmp_path / "file" / "spool"), spool_full=policy) as journal:
        journal.append(rec(0))
        await journal.flush()
        (tmp_path / "file").write_bytes(b"")  # the spool directory would now be under a regular file
        backend.down = True
        journal.append(rec(1))
        await wait_for(lambda: journal.saturated, "saturated")
        if policy == "refuse":
            message = journal.refusal(20)
            assert message is not None and "cannot be written" in message and "Error" in message
            assert journal.pending == 1  # accepted before: waits in memory for Redis
        else:
            await wait_for(lambda: journal.dropped == 1 and journal.pending == 0, "dropped")
            assert journal.refusal(20) is None
        backend.down = False
        await wait_for(lambda: not journal.saturated and journal.pending == 0, "writing again")
        assert journal.refusal(20) is None
    assert [number(r) for r in backend.entries] == ([0, 1] if policy == "refuse" else [0])


# ---- config ---------------------------------------------------------------------------------------


def test_spool_config_keys_round_trip_and_are_validated() -> None:
    config = parse_config('[journal]\nspool_dir = "/var/spool/kvb"\nspool_max_bytes = 4096\nspool_full = "drop"\n')
    assert (config.journal.spool_dir, config.journal.spool_max_bytes, config.journal.spool_full) == ("/var/spool/kvb", 4096, "drop")
    assert parse_config(config_to_toml(config)) == config
    default = parse_config("")
    assert (default.journal.spool_dir, default.journal.spool_max_bytes, default.journal.spool_full) == ("kvbroker.spool", 1 << 30, "refuse")
    for text, key in [
        ('spool_full = "block"', "journal.spool_full"),
        ("spool_max_bytes = 10", "journal.spool_max_bytes"),
        ('spool_max_bytes = "1G"', "journal.spool_max_bytes"),
        ("spool_dir = 3", "journal.spool_dir"),
    ]:
        with pytest.raises(ConfigError, match=key):
            parse_config(f"[journal]\n{text}\n")


# ---- a real broker and a Redis server that goes away ------------------------------------------------


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    directory = tmp_path / "redis"
    directory.mkdir()
    server = RedisServer(free_port(), directory)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def spool_config(redis_server: RedisServer, tmp_path: Path, **journal: object) -> BrokerConfig:
    config = small_config(journal_url=redis_server.url)
    fields = {"spool_dir": str(tmp_path / "spool"), "stream": "kvb-test:{id}:journal", **journal}
    return dataclasses.replace(config, journal=dataclasses.replace(config.journal, **fields))  # type: ignore[arg-type]


def stream_batches(redis_server: RedisServer, config: BrokerConfig) -> list[pb.IntentBatch]:
    """The BATCH records of the broker's Redis stream, in stream order."""
    client = redis_server.client()
    try:
        rows = client.xrange(config.stream_key(), "-", "+")
    finally:
        client.close()
    out = []
    for _, fields in cast(list[tuple[bytes, dict[bytes, bytes]]], rows):
        if int(fields[b"k"]) == RecordKind.BATCH:
            out.append(pb.IntentBatch.FromString(fields[b"d"]))
    return out


@contextlib.asynccontextmanager
async def running(config: BrokerConfig, redis_server: RedisServer) -> AsyncIterator[RunningBroker]:
    broker = await start_broker(config)
    try:
        yield broker
    finally:
        if redis_server.proc is None:  # a failed step left Redis down: let the journal flush
            redis_server.start()
        await asyncio.wait_for(broker.stop(grace=1), 30)


async def test_redis_stopped_mid_stream_spools_then_drains_every_batch_in_order(redis_server: RedisServer, tmp_path: Path) -> None:
    """Issue 7 acceptance: the stream never errors, the spool drains, the stream holds every
    batch exactly once in apply order."""
    config = spool_config(redis_server, tmp_path, fsync=True)
    async with running(config, redis_server) as broker:
        journal = broker.service.journal
        assert isinstance(journal, SpooledJournal)
        async with BrokerClient(f"127.0.0.1:{broker.port}", "engine", max_batch_events=4, max_delay_s=0.001) as client:
            stop = asyncio.Event()

            async def load() -> int:
                i = 0
                deadline = time.monotonic() + 60
                while not stop.is_set() and i < 200_000 and time.monotonic() < deadline:
                    await client.allocate(f"b{i}", 10, ts_us=2 * i + 1)
                    await client.free([f"b{i}"], ts_us=2 * i + 2)
                    i += 1
                    if i % 4 == 0:
                        await asyncio.sleep(0.002)  # a steady stream, not a flood
                return i

            producer = asyncio.create_task(load())
            await wait_for(lambda: client.counters.batches_answered >= 50, "batches journaled to Redis")
            redis_server.stop()  # by pid, mid-stream
            outage_start = client.counters.batches_answered
            t0 = time.monotonic()
            await wait_for(lambda: journal.spool_records > 0, "records spooled")
            await asyncio.sleep(max(0.0, 4.0 - (time.monotonic() - t0)))  # Redis away for several seconds
            answered_in_outage = client.counters.batches_answered - outage_start
            assert answered_in_outage >= 50, f"answers stalled during the outage ({answered_in_outage})"
            assert journal.spool_records > 0 and journal.spool_bytes > 0 and journal.unreachable
            assert broker.health is not None and broker.health.serving  # room in the spool: still ready
            redis_server.start()  # same port, its data back
            await wait_for(lambda: journal.spool_records == 0 and not journal.unreachable, "the spool drained", timeout=30)
            await asyncio.sleep(0.5)  # more batches, straight to Redis again
            stop.set()
            await asyncio.wait_for(producer, 30)
            await asyncio.wait_for(client.flush(), 30)
            await journal.flush()
            counters = client.counters
            assert client.failed is None and counters.disconnects == 0 and counters.rejected_events == 0
            assert counters.batches_answered == counters.batches_sent == client.batch_seq
            last_seq = client.batch_seq
        assert not os.listdir(tmp_path / "spool")
        assert journal.dropped == 0 and journal.spooled > 0 and journal.drained == journal.spooled
    seqs = [b.batch_seq for b in stream_batches(redis_server, config)]
    assert seqs == list(range(1, last_seq + 1)), "every batch exactly once, in order"


async def test_a_leftover_spool_is_drained_before_recovery_on_restart(redis_server: RedisServer, tmp_path: Path) -> None:
    config = spool_config(redis_server, tmp_path)
    broker = await start_broker(config)
    try:
        async with BrokerClient(f"127.0.0.1:{broker.port}", "engine", max_batch_events=2) as client:
            for i in range(10):
                await client.allocate(f"a{i}", 10, ts_us=i + 1)
            await client.flush()
            redis_server.stop()
            for i in range(10, 40):
                await client.allocate(f"a{i}", 10, ts_us=i + 1)
            await asyncio.wait_for(client.flush(), 10)  # answered from the spool
            assert broker.service.journal.spool_records > 0
            last_seq = client.batch_seq
    finally:
        # Stopped with Redis down: the spool stays on disk for the next start.
        await asyncio.wait_for(broker.stop(grace=1), 30)
    assert os.listdir(tmp_path / "spool")
    # Redis down at start too: recovery would miss the spooled batches, so it refuses.
    with pytest.raises(JournalError, match="spooled records are not yet in"):
        await start_broker(config)
    redis_server.start()
    async with running(config, redis_server) as again:
        assert again.service.journal.spool_records == 0 and not os.listdir(tmp_path / "spool")
        assert again.service.recovered_batches == last_seq
        assert sorted(b.block_id for b in again.service.core.blocks.values()) == sorted(f"a{i}" for i in range(40))
    assert [b.batch_seq for b in stream_batches(redis_server, config)] == list(range(1, last_seq + 1))


async def test_a_full_spool_refuses_batches_unavailable_and_health_follows(redis_server: RedisServer, tmp_path: Path) -> None:
    config = spool_config(redis_server, tmp_path, spool_max_bytes=2048, directives=False)
    config = dataclasses.replace(config, health=dataclasses.replace(config.health, poll_ms=20))
    async with running(config, redis_server) as broker:
        journal, health = broker.service.journal, broker.health
        assert health is not None
        async with BrokerClient(f"127.0.0.1:{broker.port}", "engine", max_batch_events=1) as client:
            await client.allocate("a", 10, ts_us=1)
            await client.flush()
            redis_server.stop()
            # The spool fills; the broker then refuses batches whole (UNAVAILABLE, field journal)
            # and BrokerClient holds them and resends them with the same batch_seq (it used to
            # count the refusal and drop the batch).
            flushing: asyncio.Task[object] | None = None
            for i in range(2, 500):
                await client.allocate(f"b{i}", 10, ts_us=i)
                flushing = asyncio.create_task(client.flush())
                done, _ = await asyncio.wait({flushing}, timeout=3)
                if not done:
                    break
            assert flushing is not None and not flushing.done() and journal.spool_bytes <= 2048
            reason = journal.refusal(10)
            assert reason is not None and "spool" in reason and str(tmp_path / "spool") in reason
            assert "journal.spool_max_bytes" in reason and "2048" in reason
            await wait_for(lambda: client.counters.retried_batches >= 3, "the refused batch resent")
            assert broker.service.stats().refused_batches["journal"] >= 3
            await wait_for(lambda: not health.serving, "NOT_SERVING with Redis down and the spool full")
            assert client.failed is None  # the stream stays open
            redis_server.start()
            await wait_for(lambda: health.serving and journal.spool_records == 0, "SERVING and drained")
            await asyncio.wait_for(flushing, 30)
            await client.allocate("after", 10, ts_us=10_000)
            result = await asyncio.wait_for(client.flush(), 10)
            assert result is not None and not result.rejections and result.accepted_events == 1
            assert client.counters.failed_batches == 0
            last_seq = client.batch_seq
    seqs = [b.batch_seq for b in stream_batches(redis_server, config)]
    assert seqs == list(range(1, last_seq + 1))  # nothing refused is missing


async def test_a_full_spool_with_drop_answers_every_batch_and_counts_the_dropped(redis_server: RedisServer, tmp_path: Path) -> None:
    config = spool_config(redis_server, tmp_path, spool_max_bytes=2048, directives=False, spool_full="drop")
    async with running(config, redis_server) as broker:
        journal = broker.service.journal
        assert isinstance(journal, SpooledJournal)
        async with BrokerClient(f"127.0.0.1:{broker.port}", "engine", max_batch_events=1) as client:
            await client.allocate("a", 10, ts_us=1)
            await client.flush()
            redis_server.stop()
            for i in range(2, 80):
                await client.allocate(f"b{i}", 10, ts_us=i)
            await asyncio.wait_for(client.flush(), 10)
            assert client.counters.rejected_events == 0 and client.failed is None
            assert journal.dropped > 0 and journal.saturated
            await wait_for(lambda: broker.health is not None and not broker.health.serving, "NOT_SERVING")
            dropped = journal.dropped
            # Operators see it in GetStats (kvbroker status): a full spool and the records dropped.
            stats = broker.service.stats()
            assert stats.journal_dropped == dropped and stats.journal_spool_records > 0
            assert 0 < stats.journal_spool_bytes <= 2048
            redis_server.start()
            await wait_for(lambda: journal.spool_records == 0 and not journal.unreachable, "drained")
            last_seq = client.batch_seq
    seqs = [b.batch_seq for b in stream_batches(redis_server, config)]
    assert len(seqs) == last_seq - dropped and seqs == sorted(seqs) and seqs[0] == 1


@pytest.mark.parametrize("timeout_s", [0.3, 1.5])
async def test_a_hung_redis_stalls_answers_for_journal_redis_timeout_s_then_the_spool_takes_over(
    redis_server: RedisServer, tmp_path: Path, timeout_s: float
) -> None:
    """Redis frozen (SIGSTOP: up, not answering): the next answer waits about
    journal.redis_timeout_s, no longer (it was a fixed 5 s), then batches are spooled and
    answered at once. Failed on main (no such key; 5 s)."""
    config = parse_config(f"[journal]\nredis_timeout_s = {timeout_s}\n")
    assert config.journal.redis_timeout_s == timeout_s
    config = spool_config(redis_server, tmp_path, redis_timeout_s=timeout_s)
    async with running(config, redis_server) as broker, BrokerClient(f"127.0.0.1:{broker.port}", "engine", max_batch_events=1) as client:
        await client.allocate("a", 10, ts_us=1)
        await client.flush()
        assert redis_server.proc is not None
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            stalls = []
            for i in range(3):
                started = time.monotonic()
                await client.allocate(f"b{i}", 10, ts_us=2 + i)
                await asyncio.wait_for(client.flush(), 30)
                stalls.append(time.monotonic() - started)
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        print(f"redis_timeout_s {timeout_s}: answers while Redis hung took {[round(s, 3) for s in stalls]} s")
        assert timeout_s * 0.8 <= stalls[0] < timeout_s + 1.5  # the timeout, not 5 s
        # Spooled after that, but an attempt to drain the spool to the hung Redis holds the
        # writer up to the timeout again (attempts back off to 2 s apart).
        assert max(stalls[1:]) < timeout_s + 1.5
        assert broker.service.journal.spool_records > 0
    assert [b.batch_seq for b in stream_batches(redis_server, config)] == [1, 2, 3, 4]


def test_redis_timeout_s_is_validated_by_name() -> None:
    for bad in ("0", "-1", "601", '"fast"', "nan"):
        with pytest.raises(ConfigError, match=r"journal\.redis_timeout_s"):
            parse_config(f"[journal]\nredis_timeout_s = {bad}\n")
    assert "redis_timeout_s = 0.5" in config_to_toml(parse_config(""))
