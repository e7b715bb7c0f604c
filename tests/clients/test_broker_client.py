"""BrokerClient: reconnect and resume without loss or duplication, bounded queues, directives.

Brokers are real: in process on a loopback port, or `kvbroker serve` killed with SIGKILL.
``Proxy`` sits between a client and a broker to lose answers on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from broker.config import BrokerConfig, JournalConfig
from broker.journal import JournalSource
from broker.service.server import RunningBroker, start_broker
from clients.broker_client import BrokerClient, BrokerError, BrokerQueueFull, WhenFull
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb
from tests.conftest import small_config

pytestmark = pytest.mark.timeout(60)

KVBROKER = pathlib.Path(sys.executable).parent / "kvbroker"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def config_on(port: int, journal_url: str = "none", **kwargs: str) -> BrokerConfig:
    """Tiers of 100 kB / 200 kB / 400 kB: room for every test's 100-byte blocks."""
    config = small_config(**kwargs)
    tiers = tuple(dataclasses.replace(t, capacity_bytes=t.capacity_bytes * 100) for t in config.core.tiers)
    return dataclasses.replace(
        config, listen=f"127.0.0.1:{port}", journal=JournalConfig(url=journal_url), core=dataclasses.replace(config.core, tiers=tiers)
    )


async def until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def journal_batches(url: str, client_id: str) -> list[pb.IntentBatch]:
    return [b for b in (pb.IntentBatch.FromString(r.payload) for r in JournalSource(url).batches()) if b.client_id == client_id]


def allocated_ids(batches: list[pb.IntentBatch]) -> list[str]:
    return [e.allocated.intent.block_id for b in batches for e in b.events if e.WhichOneof("kind") == "allocated"]


# ---- reconnect and resume --------------------------------------------------------------------


async def test_a_restarted_broker_gets_each_batch_exactly_once(tmp_path: pathlib.Path) -> None:
    url = f"file://{tmp_path}/j.journal"
    port = free_port()
    broker = await start_broker(config_on(port, url))
    client = BrokerClient(f"127.0.0.1:{port}", "engine", max_batch_events=3, backoff_max_s=0.2)
    await client.connect()
    for i in range(9):
        await client.allocate(f"b{i}", 100, ts_us=i)
    await client.flush()
    # The broker stops (gracefully) while the client keeps adding: nothing can be answered.
    await broker.stop(grace=0.5)
    for i in range(9, 20):
        await client.allocate(f"b{i}", 100, ts_us=i)
    await asyncio.sleep(0.3)
    assert client.unanswered >= 3
    # It comes back on the same port, rebuilt from its journal.
    broker = await start_broker(config_on(port, url))
    try:
        result = await asyncio.wait_for(client.flush(), 10)
        assert result is not None and not result.duplicate
        assert client.counters.connects == 2 and client.counters.disconnects == 1
        await client.close()
        assert set(broker.service.core.blocks) == {f"b{i}" for i in range(20)}
    finally:
        await broker.stop(grace=1)
    batches = journal_batches(url, "engine")
    assert [b.batch_seq for b in batches] == list(range(1, 8))
    assert allocated_ids(batches) == [f"b{i}" for i in range(20)]


def serve(tmp_path: pathlib.Path, journal: str, port: int = 0) -> tuple[subprocess.Popen[str], int]:
    config = tmp_path / "broker.toml"
    # The broker answers before its journal write: a kill loses answered batches, which the
    # client must send again from what it retains.
    config.write_text(
        '[journal]\nack_after = "memory"\n[[tiers]]\nname = "hbm"\ncapacity = 100000000\n[[tiers]]\nname = "dram"\ncapacity = 100000000\n'
    )
    proc = subprocess.Popen(
        [str(KVBROKER), "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}", "--journal", journal],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"serve did not start: {proc.stderr.read() if proc.stderr else ''}")
    return proc, int(json.loads(line)["port"])


async def test_sigkill_of_serve_mid_stream_loses_and_duplicates_nothing(tmp_path: pathlib.Path) -> None:
    journal = f"file://{tmp_path}/kill.journal"
    proc, port = await asyncio.to_thread(serve, tmp_path, journal)
    client = BrokerClient(f"127.0.0.1:{port}", "engine", max_batch_events=4, max_delay_s=0.001, backoff_max_s=0.25)
    n = 600
    try:
        await client.connect()

        async def stream() -> None:
            for i in range(n):
                await client.allocate(f"b{i}", 100, ts_us=i)
                if i % 10 == 9:
                    await asyncio.sleep(0.002)

        streaming = asyncio.create_task(stream())
        await until(lambda: client.batch_seq >= 40, 10, "the stream to get going")
        os.kill(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 10)
        proc, again = await asyncio.to_thread(serve, tmp_path, journal, port)
        assert again == port
        await streaming
        await asyncio.wait_for(client.flush(), 15)
        assert client.counters.connects == 2 and client.counters.unrecoverable_batches == 0
        await client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 30)
    assert proc.returncode == 0
    batches = journal_batches(journal, "engine")
    assert [b.batch_seq for b in batches] == list(range(1, len(batches) + 1))
    assert allocated_ids(batches) == [f"b{i}" for i in range(n)]


class Proxy:
    """A TCP relay that can stop passing the broker's bytes back (``mute``) and cut every
    connection (``cut``): an answer lost after the broker applied the batch."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.muted = False
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self.writers += [writer, up_writer]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, downstream: bool) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    if downstream and self.muted:
                        continue
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_writer, False), pump(up_reader, writer, True))

    def cut(self) -> None:
        for writer in self.writers:
            writer.transport.abort()
        self.writers.clear()

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


async def test_an_answer_lost_after_the_broker_applied_the_batch_is_not_sent_again() -> None:
    broker = await start_broker(config_on(0))
    proxy = Proxy(broker.port)
    await proxy.start()
    client = BrokerClient(f"127.0.0.1:{proxy.port}", "engine", backoff_max_s=0.2)
    try:
        await client.connect()
        await client.allocate("a", 100, ts_us=0)
        await client.flush()
        proxy.muted = True
        await client.allocate("b", 100, ts_us=1)
        flushing = asyncio.create_task(client.flush())
        core = broker.service.core
        await until(lambda: core.client_seq.get("engine") == 2, 10, "the broker to apply batch 2")
        proxy.muted = False
        proxy.cut()
        result = await asyncio.wait_for(flushing, 10)
        # Applied before the stream broke: resolved as the duplicate it would be if resent.
        assert result is not None and result.batch_seq == 2 and result.duplicate
        assert client.counters.lost_answers == 1 and client.counters.resent_batches == 0
        await client.allocate("c", 100, ts_us=2)
        after = await client.flush()
        assert after is not None and after.batch_seq == 3 and not after.duplicate
        stats = broker.service.stats()
        assert stats.batches == 3 and stats.duplicate_batches == 0 and set(core.blocks) == {"a", "b", "c"}
        await client.close()
    finally:
        await proxy.close()
        await broker.stop(grace=1)


@pytest.mark.parametrize("retain", [1024, 2])
async def test_a_broker_that_lost_its_state_gets_the_retained_batches_again(retain: int) -> None:
    port = free_port()
    broker = await start_broker(config_on(port))  # no journal: a restart forgets everything
    client = BrokerClient(f"127.0.0.1:{port}", "engine", max_batch_events=1, retain_batches=retain, backoff_max_s=0.2)
    try:
        await client.connect()
        for i in range(5):
            await client.allocate(f"b{i}", 100, ts_us=i)
        await client.flush()
        await broker.stop(grace=0.5)
        broker = await start_broker(config_on(port))
        await until(lambda: client.counters.connects == 2, 10, "the reconnect")
        await client.allocate("b5", 100, ts_us=5)
        await asyncio.wait_for(client.flush(), 10)
        core = broker.service.core
        if retain >= 5:
            assert set(core.blocks) == {f"b{i}" for i in range(6)}
            assert client.counters.resent_batches == 5 and client.counters.unrecoverable_batches == 0
        else:
            assert set(core.blocks) == {"b3", "b4", "b5"}
            assert client.counters.resent_batches == 2 and client.counters.unrecoverable_batches == 3
        # With batches lost for good, the client numbers what it resends from the broker's
        # last_batch_seq + 1 (a jump past it is refused: limits.max_batch_seq_gap).
        assert core.client_seq["engine"] == (6 if retain >= 5 else 3)
        await client.close()
    finally:
        await broker.stop(grace=1)


# ---- bounded queues --------------------------------------------------------------------------


async def test_drop_oldest_keeps_the_newest_batches_and_counts_the_rest() -> None:
    port = free_port()
    client = BrokerClient(
        f"127.0.0.1:{port}", "engine", max_batch_events=1, max_pending_batches=3, when_full=WhenFull.DROP_OLDEST, backoff_max_s=0.1
    )
    client.start()  # nobody listens yet
    started = time.monotonic()
    for i in range(10):
        await client.allocate(f"b{i}", 100, ts_us=i)
    assert time.monotonic() - started < 0.5  # never waited for the broker
    assert (client.counters.dropped_batches, client.counters.dropped_events, client.unanswered) == (7, 7, 3)
    broker = await start_broker(config_on(port))
    try:
        await asyncio.wait_for(client.flush(), 10)
        assert set(broker.service.core.blocks) == {"b7", "b8", "b9"}
        await client.close()
    finally:
        await broker.stop(grace=1)


async def test_raise_refuses_the_event_that_does_not_fit() -> None:
    port = free_port()
    client = BrokerClient(f"127.0.0.1:{port}", "engine", max_batch_events=1, max_pending_batches=2, when_full="raise", backoff_max_s=0.1)
    client.start()
    for i in range(3):  # two batches wait, the third event waits in the open batch
        await client.allocate(f"b{i}", 100, ts_us=i)
    with pytest.raises(BrokerQueueFull):
        await client.allocate("b3", 100, ts_us=3)
    assert client.counters.refused_events == 1 and client.unanswered == 2 and client.buffered_events == 1
    broker = await start_broker(config_on(port))
    try:
        await asyncio.wait_for(client.flush(), 10)
        assert set(broker.service.core.blocks) == {"b0", "b1", "b2"}
        await client.close()
    finally:
        await broker.stop(grace=1)


async def test_block_waits_for_room_and_goes_on_when_the_broker_comes() -> None:
    port = free_port()
    client = BrokerClient(f"127.0.0.1:{port}", "engine", max_batch_events=1, max_pending_batches=2, backoff_max_s=0.1)
    client.start()
    for i in range(2):
        await client.allocate(f"b{i}", 100, ts_us=i)
    # The third event fills a batch that has no room: the caller waits.
    blocked = asyncio.create_task(client.allocate("b2", 100, ts_us=2))
    await asyncio.sleep(0.3)
    assert not blocked.done() and client.unanswered == 2
    broker = await start_broker(config_on(port))
    try:
        await asyncio.wait_for(blocked, 10)
        await asyncio.wait_for(client.flush(), 10)
        assert set(broker.service.core.blocks) == {f"b{i}" for i in range(3)}
        assert client.counters.dropped_events == 0
        await client.close()
    finally:
        await broker.stop(grace=1)


async def test_waiting_on_a_broker_that_is_down_is_bounded() -> None:
    client = BrokerClient(f"127.0.0.1:{free_port()}", "engine", backoff_max_s=0.1)
    with pytest.raises(BrokerError, match="UNAVAILABLE"):
        await client.connect()  # the first attempt of connect() must succeed
    client = BrokerClient(f"127.0.0.1:{free_port()}", "engine", backoff_max_s=0.1)
    client.start()
    await client.allocate("a", 100)
    assert not await client.wait_connected(0.2)
    with pytest.raises(TimeoutError):
        await client.flush(timeout=0.2)
    started = time.monotonic()
    await client.close(timeout=0.3)
    assert time.monotonic() - started < 2
    assert client.counters.abandoned_batches == 1 and client.counters.abandoned_events == 1
    with pytest.raises(BrokerError, match="closed"):
        await client.allocate("b", 100)


async def test_an_unreachable_broker_is_logged_once_until_it_answers(caplog: pytest.LogCaptureFixture) -> None:
    """The first failed connect is a change of state, said at once; the retries after it are
    only counted. Before, every failure was at debug level: nothing said for as long as the
    broker was down, the failures only in connect_failures."""
    client = BrokerClient(f"127.0.0.1:{free_port()}", "engine", backoff_initial_s=0.01, backoff_max_s=0.02)
    with caplog.at_level("INFO", logger="kvbroker.client"):
        client.start()
        await until(lambda: client.counters.connect_failures >= 5, 10, "five failed connects")
        await client.close(timeout=0.1)
    said = [r for r in caplog.records if "cannot reach" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING", [r.getMessage() for r in caplog.records]
    assert client.target in said[0].getMessage() and "UNAVAILABLE" in said[0].getMessage()


async def test_a_ca_file_that_is_no_certificate_fails_the_client_for_good(tmp_path: pathlib.Path) -> None:
    """gRPC takes any bytes as a CA and fails each handshake after: a client retried forever.
    The file is checked first, and no retry mends it."""
    from clients.broker_client import ClientSecurity

    garbage = tmp_path / "ca.bin"
    garbage.write_bytes(bytes(range(256)))
    client = BrokerClient(f"127.0.0.1:{free_port()}", "engine", security=ClientSecurity(tls_ca=str(garbage)))
    client.start()
    await until(lambda: client.failed is not None, 10, "the failure")
    assert f"tls_ca {garbage}: not a PEM CA certificate" in str(client.failed)
    assert client.counters.connect_failures == 1  # counted, as every failed connect (issue 33 item 16)
    with pytest.raises(BrokerError, match="not a PEM CA certificate"):
        await client.allocate("a", 100)
    await client.close()


async def test_a_refused_client_fails_for_good(running_broker: RunningBroker) -> None:
    client = BrokerClient(f"127.0.0.1:{running_broker.port}", "future", schema_major=9)
    client.start()
    await until(lambda: client.failed is not None, 10, "the refusal")
    assert "FAILED_PRECONDITION" in str(client.failed)
    with pytest.raises(BrokerError, match="FAILED_PRECONDITION"):
        await client.allocate("a", 100)
    await client.close()


# ---- directives ------------------------------------------------------------------------------


async def test_directives_by_callback_are_acked_in_order(running_broker: RunningBroker) -> None:
    seen: list[dpb.Directive] = []
    client: BrokerClient

    async def carry_out(directive: dpb.Directive) -> None:
        seen.append(directive)
        await client.ack(directive.directive_id, ts_us=1000)

    # small_config: an HBM of 1000 bytes, so 100-byte blocks soon get demoted.
    client = BrokerClient(f"127.0.0.1:{running_broker.port}", "engine", max_batch_events=1, max_pending_batches=2, on_directive=carry_out)
    await client.connect()
    for i in range(30):
        await client.allocate(f"b{i}", 100, ts_us=i)
    await client.flush()
    stats = running_broker.service.core.stats
    await until(lambda: 0 < len(seen) == client.counters.directives == stats.acks_done, 10, "every directive acked")
    ids = [d.directive_id for d in seen]
    assert ids == sorted(ids) and client.drain_directives() == []
    await client.close()


async def test_directives_by_iterator(running_broker: RunningBroker) -> None:
    client = BrokerClient(f"127.0.0.1:{running_broker.port}", "engine", max_directives=5)
    await client.connect()
    for i in range(30):
        await client.allocate(f"b{i}", 100, ts_us=i)
    await client.flush()
    got = []
    async for directive in client.directives():
        got.append(directive)
        if len(got) == 5:
            break
    # The queue kept the newest 5; the older ones were dropped and counted.
    assert client.counters.directives == 5 + client.counters.dropped_directives and client.counters.dropped_directives > 0
    assert [d.kind for d in got] and all(d.policy == "lru" for d in got)
    iterating = asyncio.create_task(anext(client.directives(), None))
    await client.close()
    assert await asyncio.wait_for(iterating, 5) is None  # the iterator ends with the client
