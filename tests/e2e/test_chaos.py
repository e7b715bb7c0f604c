"""Chaos: every fault of issue 19 in one run, while two honest clients stream.

A real `kvbroker serve` on a Redis journal (a test-owned `redis-server`, with a spool) is,
at random moments drawn from a seed: killed with SIGKILL and started again on its journal;
its Redis stopped (SIGTERM, data saved) and started again, or frozen (SIGSTOP) and thawed;
its journal writes failed by lowering RLIMIT_FSIZE on the broker's pid (the spool is a
file); and a second tenant sends abusive batches all along (far-future event times, a
batch_seq of 2**64-1, a batch of 10,000 `cleared`, a batch over the event limit, an empty
message). Two honest BrokerClients stream allocations, accesses and frees throughout.

Asserted at the end: every batch the honest clients had answered is in the journal exactly
once and in order (each client's batch_seq 1..N, nothing missing, nothing twice); the
broker restarted on its journal after every kill; and no honest batch waited longer than
WAIT_BOUND_S for its answer while the broker was up and its disk writable (a kill, or a
disk that refuses writes, holds answers back by design: an answer means durable).

Short by default (CI): KVBROKER_CHAOS_SECONDS (default 30) of faults. By hand, e.g.
``KVBROKER_CHAOS_SECONDS=600 KVBROKER_CHAOS_SEED=7 pytest tests/e2e/test_chaos.py -s``.
The seed is printed, and named in every assertion message, so a failure can be replayed.
"""

from __future__ import annotations

import asyncio
import os
import random
import resource
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from broker.journal import JournalSource
from clients.broker_client import BrokerClient
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import intent_pb2 as pb
from tests.e2e.test_cli import start_serve
from tests.redis_server import RedisServer, free_port

SECONDS = float(os.environ.get("KVBROKER_CHAOS_SECONDS", "30"))
# An honest batch's answer, while the broker is up and can write: the Redis timeout (0.2 s)
# plus the spool, with a wide margin for a loaded 2-core CI machine.
WAIT_BOUND_S = 5.0
STREAM_METHOD = "/kvbroker.v1.BrokerService/Stream"


def config(redis_url: str, spool: Path) -> str:
    return f"""
[journal]
url = "{redis_url}"
stream = "chaos"
spool_dir = "{spool}"
spool_max_bytes = "256KiB"
fsync = true
redis_timeout_s = 0.2
[limits]
max_events_per_batch = 2000
max_batch_work = 50000
[[tiers]]
name = "hbm"
capacity = "64MiB"
[[tiers]]
name = "dram"
capacity = "1GiB"
"""


@dataclass
class Run:
    seed: int
    faults: list[tuple[str, float, float]] = field(default_factory=list)  # (kind, start, end)
    waits: list[tuple[float, float]] = field(default_factory=list)  # honest (sent, answered)
    restarts: int = 0

    def why(self) -> str:
        return f"(chaos seed {self.seed}; rerun with KVBROKER_CHAOS_SEED={self.seed})"


class Broker:
    def __init__(self, tmp_path: Path, text: str) -> None:
        self.tmp_path = tmp_path
        self.text = text
        self.port = free_port()
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.proc, port = start_serve(self.tmp_path, "--listen", f"127.0.0.1:{self.port}", config_text=self.text)
        assert port == self.port

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            resource.prlimit(self.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


async def honest(target: str, name: str, run: Run, stop: asyncio.Event) -> int:
    """Stream until ``stop``; returns the highest batch_seq answered."""
    client = BrokerClient(target, name, max_batch_events=16, max_delay_s=30, backoff_initial_s=0.02, backoff_max_s=0.3)
    client.start()
    live: list[str] = []
    i = 0
    try:
        while not stop.is_set():
            for _ in range(4):
                block = f"{name}-{i}"
                await client.allocate(block, 4096, ts_us=i, request_id=f"r{i // 32}")
                live.append(block)
                i += 1
            await client.access(live[-4:], ts_us=i)
            if len(live) > 512:
                await client.free(live[:64], ts_us=i)
                del live[:64]
            sent = time.monotonic()
            await client.flush(timeout=300)
            run.waits.append((sent, time.monotonic()))
        return client.batch_seq
    finally:
        await client.close(timeout=60)


async def abuser(port: int, rng: random.Random, stop: asyncio.Event) -> int:
    """Send abusive batches as tenant "mallory" until ``stop``; returns how many."""
    sent = 0
    seq = 0
    while not stop.is_set():
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.stream_stream(STREAM_METHOD, request_serializer=None, response_deserializer=spb.StreamResponse.FromString)()
                await call.write(
                    spb.StreamRequest(hello=spb.Hello(schema_major=1, client_id="mallory", tenant="mallory")).SerializeToString()
                )
                seq = (await call.read()).hello.last_batch_seq
                while not stop.is_set():
                    kind = rng.randrange(5)
                    if kind == 0:  # far-future time
                        events = [pb.Event(ts_us=2**63 - 1, cleared=pb.AllBlocksCleared())]
                        batch = pb.IntentBatch(client_id="mallory", batch_seq=seq + 1, events=events, tenant="mallory")
                    elif kind == 1:  # the last batch_seq
                        batch = pb.IntentBatch(client_id="mallory", batch_seq=2**64 - 1, tenant="mallory")
                    elif kind == 2:  # 10,000 clears
                        events = [pb.Event(ts_us=1, cleared=pb.AllBlocksCleared())] * 10_000
                        batch = pb.IntentBatch(client_id="mallory", batch_seq=seq + 1, events=events, tenant="mallory")
                    elif kind == 3:  # over the event limit
                        events = [pb.Event(ts_us=1, cleared=pb.AllBlocksCleared())] * 2001
                        batch = pb.IntentBatch(client_id="mallory", batch_seq=seq + 1, events=events, tenant="mallory")
                    else:
                        await call.write(b"")  # an empty message
                        await call.read()
                        sent += 1
                        continue
                    await call.write(spb.StreamRequest(batch=batch).SerializeToString())
                    answer = (await call.read()).directives
                    if not answer.duplicate and not any(r.event_index == -1 for r in answer.rejections):
                        seq = answer.batch_seq
                    sent += 1
                    await asyncio.sleep(rng.uniform(0, 0.05))
        except Exception:  # the broker was killed (a broken call, an EOF): connect again
            await asyncio.sleep(0.1)
    return sent


async def test_chaos_nothing_answered_is_lost_and_no_honest_stream_stalls(tmp_path: Path) -> None:
    seed = int(os.environ.get("KVBROKER_CHAOS_SEED", str(random.randrange(1 << 30))))
    run = Run(seed)
    print(f"chaos seed {seed}, {SECONDS:.0f} s of faults")
    rng = random.Random(seed)
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    redis = RedisServer(free_port(), redis_dir)
    await asyncio.to_thread(redis.start)
    broker = Broker(tmp_path, config(redis.url, tmp_path / "spool"))
    await asyncio.to_thread(broker.start)
    stop = asyncio.Event()
    target = f"127.0.0.1:{broker.port}"
    clients = [asyncio.create_task(honest(target, f"honest-{k}", run, stop)) for k in range(2)]
    abuse = asyncio.create_task(abuser(broker.port, random.Random(seed + 1), stop))
    frozen = False
    kinds = ["kill9", "redis-stop", "redis-freeze", "fsize"]
    first = rng.sample(kinds, len(kinds))  # each kind at least once, then at random
    try:
        deadline = time.monotonic() + SECONDS
        while time.monotonic() < deadline or first:
            await asyncio.sleep(rng.uniform(0.3, 1.5))
            for task in (*clients, abuse):
                assert not task.done(), f"{task} ended early {run.why()}: {task.exception() if task.done() else ''}"
            fault = first.pop() if first else rng.choice(kinds)
            start = time.monotonic()
            if fault == "kill9":
                await asyncio.to_thread(broker.kill9)
                if frozen:  # a broker starts only on a journal it can recover from
                    os.kill(redis.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
                    frozen = False
                if redis.proc is None:
                    await asyncio.to_thread(redis.start)
                await asyncio.sleep(rng.uniform(0, 0.5))
                await asyncio.to_thread(broker.start)  # raises if it does not restart on its journal
                run.restarts += 1
            elif fault == "redis-stop" and redis.proc is not None and not frozen:
                await asyncio.to_thread(redis.stop)
                await asyncio.sleep(rng.uniform(0.2, 1.5))
                await asyncio.to_thread(redis.start)
            elif fault == "redis-freeze" and redis.proc is not None and not frozen:
                os.kill(redis.proc.pid, signal.SIGSTOP)
                frozen = True
                await asyncio.sleep(rng.uniform(0.2, 1.5))
                os.kill(redis.proc.pid, signal.SIGCONT)
                frozen = False
            elif fault == "fsize" and broker.proc is not None:
                # The spool (a file) can take almost nothing more while Redis is away too.
                spool = tmp_path / "spool"
                used = sum(p.stat().st_size for p in spool.glob("*")) if spool.exists() else 0
                resource.prlimit(broker.proc.pid, resource.RLIMIT_FSIZE, (used + 300, resource.RLIM_INFINITY))
                if redis.proc is not None and not frozen:
                    os.kill(redis.proc.pid, signal.SIGSTOP)
                await asyncio.sleep(rng.uniform(0.2, 1.0))
                resource.prlimit(broker.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
                if redis.proc is not None and not frozen:
                    os.kill(redis.proc.pid, signal.SIGCONT)
            run.faults.append((fault, start, time.monotonic()))
        stop.set()
        answered = await asyncio.wait_for(asyncio.gather(*clients), 300)
        abused = await asyncio.wait_for(abuse, 60)
    finally:
        stop.set()
        if redis.proc is not None and frozen:
            os.kill(redis.proc.pid, signal.SIGCONT)
        for task in (*clients, abuse):
            if not task.done():
                task.cancel()
        await asyncio.to_thread(broker.stop)
    try:
        # Every honest batch answered is in the journal once, in order, and nothing else of theirs.
        seqs: dict[str, list[int]] = {"honest-0": [], "honest-1": []}
        for record in JournalSource(redis.url, "chaos").batches():
            batch = pb.IntentBatch.FromString(record.payload)
            if batch.client_id in seqs:
                seqs[batch.client_id].append(batch.batch_seq)
        for k, top in enumerate(answered):
            assert top > 0, f"honest-{k} had nothing answered {run.why()}"
            got = seqs[f"honest-{k}"]
            missing = sorted(set(range(1, top + 1)) - set(got))
            twice = sorted({s for s in got if got.count(s) > 1})
            disorder = next((i for i in range(1, len(got)) if got[i] <= got[i - 1]), None)
            assert got == list(range(1, top + 1)), (
                f"honest-{k}: {len(got)} batches journaled, answered up to {top}; missing {missing[:20]}, twice {twice[:20]}, "
                f"first out of order at {disorder} {got[max(0, (disorder or 0) - 3) : (disorder or 0) + 3]} {run.why()}"
            )
        # No honest batch waited longer than the bound while the broker was up and could write.
        excused = [(a, b) for kind, a, b in run.faults if kind in ("kill9", "fsize")]
        slow = [w for w in run.waits if w[1] - w[0] > WAIT_BOUND_S and not any(a <= w[1] and w[0] <= b for a, b in excused)]
        worst = max((b - a for a, b in run.waits), default=0.0)
        bounded = [b - a for a, b in run.waits if not any(x <= b and a <= y for x, y in excused)]
        seen = sorted({kind for kind, _, _ in run.faults})
        print(
            f"chaos: {len(run.faults)} faults {seen}, {run.restarts} restarts, {len(run.waits)} honest batches, "
            f"worst wait {worst:.2f}s ({max(bounded, default=0.0):.2f}s outside kills and disk faults), {abused} abusive batches"
        )
        t0 = run.waits[0][0] if run.waits else 0.0
        for a, b in sorted(run.waits, key=lambda w: w[0] - w[1])[:3]:  # the slowest, with the faults they met
            met = [f"{kind}@{x - t0:.1f}-{y - t0:.1f}s" for kind, x, y in run.faults if x <= b and a <= y]
            print(f"  slow honest batch: sent at {a - t0:.1f}s, waited {b - a:.2f}s; faults meanwhile: {', '.join(met) or 'none'}")
        assert not slow, f"{len(slow)} honest batches waited over {WAIT_BOUND_S}s outside kills and disk faults {run.why()}"
        assert run.restarts >= 1 and seen == sorted(kinds), f"faults {seen} {run.why()}"
        assert abused > 0, f"the abuser sent nothing {run.why()}"
    finally:
        await asyncio.to_thread(redis.stop)


@pytest.fixture(autouse=True)
def _redis_installed() -> None:
    import shutil

    assert shutil.which("redis-server"), "redis-server is not installed (.ci/run installs it)"
