"""Kill -9 of a real `kvbroker serve` in the middle of a streaming load.

The client keeps streaming allocations (8 per batch, batches pipelined) while the broker
process is killed with SIGKILL and started again on the same port and journal. Then:

- every block of every batch the broker had acknowledged before the kill is in the
  restarted broker's residency, in the tier it was in (GetResidency);
- the client resumes by itself (same client id, original batch_seq numbers) with no error;
- the journal holds batch_seq 1..N exactly once each, in order.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import grpc

from broker.journal import JournalSource
from clients.broker_client import BrokerClient
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import broker_service_pb2_grpc as spb_grpc
from kvbroker.v1 import intent_pb2 as pb
from tests.e2e.test_cli import start_serve

PER_BATCH = 8
# fsync: an acknowledged record is on disk, not only in the page cache. Tiers large enough
# that nothing is evicted, so residency is exactly the blocks allocated.
CONFIG = '[journal]\nfsync = true\n[[tiers]]\nname = "hbm"\ncapacity = "1GiB"\n[[tiers]]\nname = "dram"\ncapacity = "4GiB"\n'


def serve(tmp_path: Path, journal: str, port: int = 0) -> tuple[subprocess.Popen[str], int]:
    """``kvbroker serve`` on CONFIG and ``journal`` (the last --listen wins: 0 for a free port)."""
    return start_serve(tmp_path, "--journal", journal, "--listen", f"127.0.0.1:{port}", config_text=CONFIG)


async def residency_of(port: int, block_ids: list[str]) -> dict[str, str]:
    """block id -> tier name, for the blocks that exist."""
    out: dict[str, str] = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = spb_grpc.BrokerServiceStub(channel)
        for block_id in block_ids:
            try:
                reply = await stub.GetResidency(spb.GetResidencyRequest(block_id=block_id), timeout=10)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
                continue
            out[block_id] = reply.blocks[0].tier
    return out


async def test_kill_9_under_streaming_load_loses_no_acknowledged_batch(tmp_path: Path) -> None:
    journal = f"file://{tmp_path}/kill.journal"
    proc, port = await asyncio.to_thread(serve, tmp_path, journal)
    acked = 0  # highest batch_seq whose answer came back
    sent = 0
    stop = asyncio.Event()
    client = BrokerClient(
        f"127.0.0.1:{port}", "engine", max_batch_events=PER_BATCH, max_delay_s=30.0, backoff_initial_s=0.02, backoff_max_s=0.2
    )

    async def load() -> None:
        nonlocal acked, sent
        i = 0
        while not stop.is_set() and i < 40_000:
            for _ in range(PER_BATCH):  # exactly one batch: sealed by count
                tier = "dram" if i % 5 == 0 else ""
                await client.allocate(f"b{i}", 4096, ts_us=i, tier=tier, request_id=f"r{i // 64}")
                i += 1
            sent += 1
            if sent % 4 == 0:
                answer = await client.flush(timeout=60)
                assert answer is not None and not answer.rejections
                acked = max(acked, answer.batch_seq)
        await client.flush(timeout=60)

    task = asyncio.create_task(load())
    try:
        await client.connect()
        while acked < 40:  # well into the stream
            await asyncio.sleep(0.05)
            assert not task.done(), task
        acked_at_kill = acked
        os.kill(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 10)
        proc, port2 = await asyncio.to_thread(serve, tmp_path, journal, port)
        assert port2 == port
        # The restarted broker holds every block of every batch acknowledged before the kill.
        wanted = [f"b{i}" for i in range(acked_at_kill * PER_BATCH)]
        held = await residency_of(port, wanted)
        assert sorted(held) == sorted(wanted)
        assert all(held[f"b{i}"] == ("dram" if i % 5 == 0 else "hbm") for i in range(acked_at_kill * PER_BATCH))
        # The client resumes on its own and keeps streaming.
        while acked < acked_at_kill + 40:
            await asyncio.sleep(0.05)
            assert not task.done(), task
        stop.set()
        await asyncio.wait_for(task, 60)
        assert client.counters.dropped_batches == 0
        assert client.counters.connects >= 2  # it did lose the broker and come back
    finally:
        stop.set()
        await client.close(timeout=10)
        if not task.done():
            task.cancel()
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 30)
    # Every batch the client sent is journaled exactly once, in order, and nothing else.
    seqs = [pb.IntentBatch.FromString(r.payload).batch_seq for r in JournalSource(journal).batches()]
    assert seqs == list(range(1, sent + 1))
    # And a broker started on that journal holds every block the client allocated.
    proc, port3 = await asyncio.to_thread(serve, tmp_path, journal)
    try:
        held = await residency_of(port3, [f"b{sent * PER_BATCH - 1}", "b0", f"b{acked_at_kill * PER_BATCH}"])
        assert len(held) == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 30)
