"""Issue 25: the Redis journal on a Redis Cluster (``redis+cluster://``).

The real-cluster tests start six ``redis-server --cluster-enabled yes`` of their own on
loopback ports (tests/redis_cluster.py: three masters with a replica each), stop them by
pid, and remove their directories."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from redis.cluster import RedisCluster as SyncCluster

from broker.cli.main import main
from broker.config import BrokerConfig, ConfigError, parse_config
from broker.journal import JournalError, JournalRecord, RecordKind, open_journal
from broker.journal.cluster import RedisClusterJournal, sync_key
from broker.journal.redis_urls import cluster_nodes, sync_client
from broker.journal.spool import SpooledJournal
from broker.service.server import RunningBroker, start_broker
from clients.broker_client import BrokerClient
from kvbroker.v1 import intent_pb2 as pb
from tests.conftest import small_config
from tests.redis_cluster import RedisCluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


async def wait_for(predicate: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


# ---- keys, URLs and config ---------------------------------------------------------------------


def test_a_stream_key_without_a_hash_tag_is_refused_on_a_cluster() -> None:
    with pytest.raises(JournalError) as refused:
        RedisClusterJournal("redis+cluster://127.0.0.1:7000", "kvbroker:pod-7:journal", maxlen=1000)
    message = str(refused.value)
    assert "journal.stream 'kvbroker:pod-7:journal'" in message and "hash slot" in message
    assert 'stream = "kvbroker:{{id}}:journal"' in message
    RedisClusterJournal("redis+cluster://127.0.0.1:7000", "kvbroker:{pod-7}:journal", maxlen=1000)  # tagged: accepted


def test_the_default_stream_is_hash_tagged_on_a_cluster_only() -> None:
    on_cluster = parse_config('[broker]\nid = "pod-7"\n[journal]\nurl = "redis+cluster://10.0.0.5:6379"\n')
    assert on_cluster.stream_key() == "kvbroker:{pod-7}:journal"
    single = parse_config('[broker]\nid = "pod-7"\n[journal]\nurl = "redis://10.0.0.5:6379/0"\n')
    assert single.stream_key() == "kvbroker:pod-7:journal", "a single Redis keeps the key it always had"
    chosen = parse_config('[broker]\nid = "pod-7"\n[journal]\nurl = "redis+cluster://h:1"\nstream = "kv:{{id}}:j"\n')
    assert chosen.stream_key() == "kv:{pod-7}:j"


def test_wait_replicas_is_a_validated_config_key() -> None:
    assert parse_config("[journal]\nwait_replicas = 0\n").journal.wait_replicas == 0
    assert parse_config("").journal.wait_replicas == 1
    with pytest.raises(ConfigError, match=r"journal.wait_replicas: must be >= 0, got -1"):
        parse_config("[journal]\nwait_replicas = -1\n")


def test_cluster_urls_name_their_nodes_and_refuse_what_a_cluster_lacks() -> None:
    first, nodes = cluster_nodes("redis+cluster://user:pw@10.0.0.1:7000,10.0.0.2:7001?stream=x")
    assert first == "redis://user:pw@10.0.0.1:7000/0?stream=x" and nodes == [("10.0.0.1", 7000), ("10.0.0.2", 7001)]
    assert cluster_nodes("rediss+cluster://h:1")[0] == "rediss://h:1/0"
    with pytest.raises(JournalError, match="database 0 only"):
        cluster_nodes("redis+cluster://h:1/3")
    with pytest.raises(JournalError, match=r"expected HOST:PORT\[,HOST:PORT...\].*'h'"):
        cluster_nodes("redis+cluster://h")
    with pytest.raises(JournalError, match="redis\\+cluster://\\*\\*\\*@h:1"):
        cluster_nodes("redis+cluster://u:secret@h:1/2")


# ---- a real cluster ------------------------------------------------------------------------------


@pytest.fixture
def cluster() -> Iterator[RedisCluster]:
    c = RedisCluster()
    try:
        c.start()
        yield c
    finally:
        c.stop()


def cluster_config(cluster: RedisCluster, tmp_path: Path, broker_id: str, **journal: object) -> BrokerConfig:
    config = dataclasses.replace(small_config(journal_url=cluster.url), broker_id=broker_id)
    fields = {"spool_dir": str(tmp_path / f"spool-{broker_id}"), **journal}
    return dataclasses.replace(config, journal=dataclasses.replace(config.journal, **fields))  # type: ignore[arg-type]


def stream_records(cluster: RedisCluster, key: str) -> list[tuple[int, bytes]]:
    client = cast(SyncCluster, sync_client(cluster.url, socket_timeout=10))
    try:
        rows = client.xrange(key, "-", "+")
    finally:
        client.close()
    return [(int(fields[b"k"]), fields[b"d"]) for _, fields in cast(list[tuple[bytes, dict[bytes, bytes]]], rows)]


def stream_seqs(cluster: RedisCluster, key: str) -> list[int]:
    return [pb.IntentBatch.FromString(d).batch_seq for k, d in stream_records(cluster, key) if k == RecordKind.BATCH]


@contextlib.asynccontextmanager
async def running(config: BrokerConfig) -> AsyncIterator[RunningBroker]:
    broker = await start_broker(config)
    try:
        yield broker
    finally:
        await asyncio.wait_for(broker.stop(grace=1), 60)


async def steady_load(client: BrokerClient, stop: asyncio.Event, limit: int = 100_000) -> int:
    i = 0
    deadline = time.monotonic() + 60
    while not stop.is_set() and i < limit and time.monotonic() < deadline:
        await client.allocate(f"b{i}", 10, ts_us=2 * i + 1)
        await client.free([f"b{i}"], ts_us=2 * i + 2)
        i += 1
        if i % 4 == 0:
            await asyncio.sleep(0.002)  # a steady stream, not a flood
    return i


async def test_a_master_killed_mid_stream_loses_no_answered_batch(cluster: RedisCluster, tmp_path: Path) -> None:
    """Issue 25 acceptance: the master of the journal's slot is killed (SIGKILL) while a
    client streams; the broker keeps answering (the spool), the cluster promotes the replica,
    the killed node comes back as a replica, the spool drains, and the stream holds every
    answered batch exactly once, in order."""
    config = cluster_config(cluster, tmp_path, "pod-failover")
    key = config.stream_key()
    assert key == "kvbroker:{pod-failover}:journal"
    async with running(config) as broker:
        journal = broker.service.journal
        assert isinstance(journal, RedisClusterJournal) and isinstance(journal, SpooledJournal)
        async with BrokerClient(f"127.0.0.1:{broker.port}", "engine", max_batch_events=4, max_delay_s=0.001) as client:
            stop = asyncio.Event()
            producer = asyncio.create_task(steady_load(client, stop))
            await wait_for(lambda: client.counters.batches_answered >= 50, "batches journaled to the cluster")
            master = cluster.master_of(key)
            cluster.kill(master)  # mid-stream, by pid
            at_kill = client.counters.batches_answered
            await wait_for(lambda: journal.spool_records > 0, "records spooled while the slot has no master")
            await asyncio.to_thread(cluster.wait_failover, key, master)  # the replica promoted
            await asyncio.sleep(0.5)
            assert client.counters.batches_answered - at_kill >= 20, "answers stalled during the failover"
            assert journal.spool_records > 0, "no write counts before a replica holds it (wait_replicas = 1)"
            cluster.restart(master)  # back, as the new master's replica
            await asyncio.to_thread(cluster.wait_ok)
            await wait_for(lambda: journal.spool_records == 0 and not journal.unreachable, "the spool drained", timeout=60)
            await asyncio.sleep(0.3)  # more batches, straight to the cluster again
            stop.set()
            await asyncio.wait_for(producer, 30)
            await asyncio.wait_for(client.flush(), 30)
            await journal.flush()
            counters = client.counters
            assert client.failed is None and counters.disconnects == 0 and counters.rejected_events == 0
            assert counters.batches_answered == counters.batches_sent == client.batch_seq
            last_seq = client.batch_seq
        assert journal.dropped == 0 and journal.spooled > 0 and journal.drained == journal.spooled
        assert cluster.role(master) == "slave"
    assert stream_seqs(cluster, key) == list(range(1, last_seq + 1)), "every answered batch exactly once, in order"
    # The read-back's marker lives in the stream's slot, beside it.
    client = cast(SyncCluster, sync_client(cluster.url))
    try:
        assert client.keyslot(sync_key(key)) == client.keyslot(key) == client.keyslot(f"{key}:directives")
    finally:
        client.close()


async def test_a_fleet_on_a_cluster_replays_as_one_report(
    cluster: RedisCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three brokers journal to one cluster (their keys in different slots, on different
    masters); one replay finds them all by pattern (SCAN on every master), verifies each
    pod's live policy, and adds the fleet row."""
    pods = ("pod-a", "pod-b", "pod-c")
    for n, pod in enumerate(pods):
        async with running(cluster_config(cluster, tmp_path, pod)) as broker:
            client = BrokerClient(f"127.0.0.1:{broker.port}", "engine", max_batch_events=8, max_delay_s=0.001)
            async with client:
                for i in range(40 * (n + 1)):
                    await client.allocate(f"b{i}", 300, ts_us=3 * i + 1)
                    await client.access([f"b{i // 2}"], ts_us=3 * i + 2)
                await client.flush()
    masters = {cluster.master_of(f"kvbroker:{{{pod}}}:journal") for pod in pods}
    assert len(masters) > 1, "the pods' streams are spread over the masters"
    capsys.readouterr()
    argv = ["replay", "--journal", f"{cluster.url}?stream=kvbroker:*:journal", "--policy", "lru,fifo", "--verify", "--json", "--jobs", "1"]
    code = await asyncio.to_thread(main, argv)
    out = capsys.readouterr()
    assert code == 0, out.err
    records = json.loads(out.out)
    sources = [r["source"] for r in records]
    assert sources == [*(f"{cluster.url}?stream=kvbroker:{{{p}}}:journal" for p in pods), "fleet"] * 2
    lru = [r for r in records if r["policy"] == "lru"]
    assert all(r["verified"] is True for r in lru) and lru[-1]["sources"] == 3
    assert lru[-1]["events"] == sum(r["events"] for r in lru[:3]) == 2 * 40 * (1 + 2 + 3)
    assert lru[-1]["accesses"] == sum(r["accesses"] for r in lru[:3])


async def test_a_cluster_without_enough_replicas_says_so_and_keeps_the_records(cluster: RedisCluster, tmp_path: Path) -> None:
    """wait_replicas above the shard's replicas: no write counts; the error names the key
    to change, and the records wait in the spool (nothing answered is lost)."""
    journal = open_journal(
        cluster.url, stream="kvb-test:{w}:journal", maxlen=1000, fsync=False, max_group=16, spool_dir=str(tmp_path), wait_replicas=2
    )
    await journal.start()
    try:
        journal.append(JournalRecord(RecordKind.BATCH, 1, 1, b"x"))
        assert isinstance(journal, SpooledJournal)
        await wait_for(lambda: journal.spool_records == 1, "the record spooled", timeout=20)
        assert "WAIT: 1 of 2 replica(s)" in journal.last_error and "journal.wait_replicas" in journal.last_error
    finally:
        await journal.close()


def test_serve_refuses_an_untagged_cluster_stream_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "broker.toml"
    config.write_text(
        '[broker]\nid = "pod-7"\nlisten = "127.0.0.1:0"\n[journal]\nurl = "redis+cluster://127.0.0.1:1"\nstream = "kv:pod:journal"\n'
    )
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "kvbroker serve: journal: journal.stream 'kv:pod:journal': on a Redis Cluster" in err and "no hash tag" in err
