"""Crash recovery: a restarted broker rebuilds residency and client sequences from its journal."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc

from broker.config import JournalConfig
from broker.journal import JournalSource
from broker.replay.replay import replay_source
from broker.service.server import start_broker
from clients.admin import get_residency, get_stats
from clients.broker_client import BrokerClient
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import intent_pb2 as pb
from tests.conftest import REDIS_URL, small_config


def config_with(journal_url: str):  # type: ignore[no-untyped-def]
    return dataclasses.replace(small_config("lru"), journal=JournalConfig(url=journal_url))


async def fill(port: int, first: int, count: int) -> None:
    async with BrokerClient(f"127.0.0.1:{port}", "engine", max_batch_events=5) as client:
        for i in range(first, first + count):
            await client.allocate(f"b{i}", 100, ts_us=i, request_id=f"r{i % 3}")
        await client.flush()


async def check_restart(journal_url: str, read_url: str) -> None:
    broker = await start_broker(config_with(journal_url))
    await fill(broker.port, 0, 40)  # 8 batches; HBM overflows into DRAM and NVMe
    before = broker.service.residency(spb.GetResidencyRequest(totals=True))
    blocks_before = {b: (blk.tier, blk.size) for b, blk in broker.service.core.blocks.items()}
    await broker.stop(grace=1)

    again = await start_broker(config_with(journal_url))
    try:
        assert again.service.recovered_batches == 8
        after = again.service.residency(spb.GetResidencyRequest(totals=True))
        assert after == before
        assert {b: (blk.tier, blk.size) for b, blk in again.service.core.blocks.items()} == blocks_before
        # The client resumes after its last applied batch; an old batch is a duplicate.
        client = BrokerClient(f"127.0.0.1:{again.port}", "engine")
        reply = await client.connect()
        assert reply.last_batch_seq == 8
        await client.close()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{again.port}") as channel:
            from kvbroker.v1 import broker_service_pb2_grpc as spb_grpc

            stub = spb_grpc.BrokerServiceStub(channel)
            old = pb.IntentBatch(client_id="engine", batch_seq=8, events=[pb.Event(ts_us=99, freed=pb.BlocksFreed(block_ids=["b0"]))])
            response = await stub.Submit(spb.SubmitRequest(hello=spb.Hello(schema_major=1, client_id="engine"), batch=old))
            assert response.directives.duplicate and "b0" in again.service.core.blocks
        await fill(again.port, 40, 10)
    finally:
        await again.stop(grace=1)
    # Across the restart, replay still reproduces every directive the broker sent.
    [result] = replay_source(JournalSource(read_url), ["lru"], verify=True)
    assert result.mismatches == 0 and result.batches == 10


async def test_file_journal_restart_rebuilds_the_same_residency(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/j.journal"
    await check_restart(url, url)


async def test_redis_journal_restart_rebuilds_the_same_residency(redis_stream_key: str) -> None:
    url = f"{REDIS_URL}?stream={redis_stream_key}"
    await check_restart(url, url)


def test_kill_9_of_serve_loses_no_acknowledged_batch(tmp_path: Path) -> None:
    """A real `kvbroker serve` killed with SIGKILL: the restarted one answers as before."""
    kvbroker = Path(sys.executable).parent / "kvbroker"
    journal = f"file://{tmp_path}/kill.journal"
    config = tmp_path / "b.toml"
    config.write_text("[journal]\nfsync = true\n[[tiers]]\nname = 'hbm'\ncapacity = 1000\n[[tiers]]\nname = 'dram'\ncapacity = 100000\n")

    def serve(port: int = 0) -> tuple[subprocess.Popen[str], int]:
        proc = subprocess.Popen(
            [str(kvbroker), "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}", "--journal", journal],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        import json

        return proc, json.loads(proc.stdout.readline())["port"]

    proc, port = serve()
    code = f"""
import asyncio
from clients.broker_client import BrokerClient
async def main():
    async with BrokerClient("127.0.0.1:{port}", "engine", max_batch_events=4) as c:
        for i in range(30):
            await c.allocate(f"b{{i}}", 100, ts_us=i)
            if i % 4 == 3:
                await c.flush()   # acknowledged: answered by the broker
        await c.flush()
asyncio.run(main())
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=Path(__file__).parents[3])
    before = get_residency(f"127.0.0.1:{port}", spb.GetResidencyRequest(totals=True))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    proc2, port2 = serve(port)
    try:
        after = get_residency(f"127.0.0.1:{port2}", spb.GetResidencyRequest(totals=True))
        assert after == before
        stats = get_stats(f"127.0.0.1:{port2}")
        assert stats.events["allocated"] == 30
    finally:
        proc2.send_signal(signal.SIGTERM)
        proc2.wait(timeout=30)
    seqs = [pb.IntentBatch.FromString(r.payload).batch_seq for r in JournalSource(journal).batches()]
    assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) == 8
