"""The vLLM bridge against a real ZMQ publisher (PUB + ROUTER replay, as vLLM's) and a real broker.

``FakeVllm`` publishes exactly as vllm/distributed/kv_events.py's ZmqEventPublisher does
(``[topic, seq, payload]``; replay over ROUTER ending with seq -1) and can drop batches on
the live path (they stay in its replay buffer) or restart at seq 0. ``Engine`` is the
test's own account of what the engine holds, to compare the broker's residency with.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import zmq

from broker.config import BrokerConfig, JournalConfig, parse_config
from broker.journal import JournalSource
from broker.replay.traces import TraceOptions, read_trace
from broker.service.server import RunningBroker, start_broker
from clients.admin import get_residency
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import broker_service_pb2_grpc as spb_grpc
from kvbroker.v1 import intent_pb2 as pb
from tests.vllm_integration.events_from_vllm.test_zmq_events import BLOCK_BYTES, cleared, payload, removed, stored
from tests.vllm_integration.events_from_vllm.vllm_wire import Truth, block_removed, block_stored, engines, offloaded
from vllm_integration.events_from_vllm.bridge import BridgeConfig, RankBridge, VllmBridge, offset_endpoint
from vllm_integration.events_from_vllm.zmq_events import END_OF_REPLAY, RESTART_RECORD_SEQ, block_id, encode_seq, read_capture

pytestmark = pytest.mark.timeout(60)

KVBROKER = pathlib.Path(sys.executable).parent / "kvbroker"
ROOT = pathlib.Path(__file__).parents[3]
TIB = 2**40
BIG_TIERS = f"""
[[tiers]]
name = "hbm"
capacity = {TIB}
[[tiers]]
name = "dram"
capacity = {4 * TIB}
[[tiers]]
name = "nvme"
capacity = {16 * TIB}
"""


def big_config(journal_url: str = "none") -> BrokerConfig:
    """Tiers far larger than any test fills: nothing is ever evicted."""
    config = parse_config(f'[broker]\nlisten = "127.0.0.1:0"\n[policy]\nname = "lru"\n{BIG_TIERS}')
    return dataclasses.replace(config, journal=JournalConfig(url=journal_url))


# ---- the publisher ---------------------------------------------------------------------------


class FakeVllm:
    """vLLM's ZMQ publisher: XPUB (a PUB that also tells us when a subscriber is there) and a
    ROUTER replay socket served from a thread, like vLLM's."""

    def __init__(self, pub_port: int, replay_port: int, *, topic: str = "kv-events", rank: int = 0, new_replay_format: bool = True) -> None:
        self.ctx = zmq.Context()
        self.topic = topic.encode()
        self.rank = rank
        self.new_replay_format = new_replay_format
        self.pub = self.ctx.socket(zmq.XPUB)
        self.router = self.ctx.socket(zmq.ROUTER)
        try:
            self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
            self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        except zmq.ZMQError:
            self.ctx.destroy(linger=0)
            raise
        self.pub_port, self.replay_port = pub_port, replay_port
        self.seq = 0
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=10_000)
        self.lock = threading.Lock()
        self.replays = 0
        self._subscribed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:  # vLLM ignores anything but [identity, delimiter, start]
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            self.replays += 1
            with self.lock:
                buffered = [(s, d) for s, d in self.buffer if s >= start]
            for seq, data in buffered:
                if self.new_replay_format:
                    self.router.send_multipart([client, b"", self.topic, encode_seq(seq), data])
                else:
                    self.router.send_multipart([client, b"", encode_seq(seq), data])
            end = (
                [client, b"", b"", encode_seq(END_OF_REPLAY), b""]
                if self.new_replay_format
                else [client, b"", encode_seq(END_OF_REPLAY), b""]
            )
            self.router.send_multipart(end)

    def subscribed(self) -> bool:
        while self.pub.poll(0):
            message = self.pub.recv()
            if message[:1] == b"\x01":
                self._subscribed = True
        return self._subscribed

    def publish(self, events: list[Any], *, ts: float | None = None, encoding: str = "array", drop: bool = False) -> int:
        """One batch; ``drop``: lost on the live path (still in the replay buffer)."""
        seq = self.seq
        self.seq += 1
        data = payload(events, ts=time.time() if ts is None else ts, rank=self.rank, encoding=encoding)
        with self.lock:
            self.buffer.append((seq, data))
        if not drop:
            self.pub.send_multipart([self.topic, encode_seq(seq), data])
        return seq

    def restart(self) -> None:
        """A new engine: seq from 0, an empty replay buffer."""
        with self.lock:
            self.seq = 0
            self.buffer.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.ctx.destroy(linger=0)


def fake_ranks(n: int, **kwargs: Any) -> list[FakeVllm]:
    """n publishers on consecutive ports (rank r on base + r), as vLLM's data-parallel ranks bind."""
    rng = random.Random()
    for _ in range(50):
        pub, rep = rng.randrange(20_000, 40_000), rng.randrange(40_000, 60_000)
        made: list[FakeVllm] = []
        try:
            for r in range(n):
                made.append(FakeVllm(pub + r, rep + r, rank=r, **kwargs))
            return made
        except zmq.ZMQError:
            for fake in made:
                fake.close()
    raise RuntimeError("no free consecutive ports")


# ---- the engine's truth ----------------------------------------------------------------------


class Engine:
    """What one engine holds: block id -> media. The broker must show exactly this."""

    def __init__(self, namespace: str = "") -> None:
        self.namespace = namespace
        self.media: dict[str, set[str]] = {}

    def bid(self, h: Any, **identity: Any) -> str:
        return block_id(h, namespace=self.namespace, **identity)

    def store(self, hashes: list[Any], medium: str = "GPU", **identity: Any) -> None:
        for h in hashes:
            self.media.setdefault(self.bid(h, **identity), set()).add(medium)

    def remove(self, hashes: list[Any], medium: str = "GPU", **identity: Any) -> None:
        for h in hashes:
            media = self.media.get(self.bid(h, **identity))
            if media is not None:
                media.discard(medium)
                if not media:
                    del self.media[self.bid(h, **identity)]

    def expected(self) -> dict[str, str]:
        return {b: "hbm" if "GPU" in m else "dram" for b, m in self.media.items()}


def workload(fake: FakeVllm, engine: Engine, batches: int, *, seed: int, drop: Callable[[int], bool] = lambda seq: False) -> None:
    """Chains of bytes and int hashes (ints past 2^63 and negative), both encodings, CPU
    copies, removals, an adapter, unknown keys and an unknown event type."""
    rng = random.Random(seed)
    live: list[Any] = []
    counter = seed * 100_000
    for n in range(batches):
        encoding = "map" if n % 2 else "array"
        events: list[Any] = []
        chain: list[Any] = []
        for _ in range(rng.randrange(2, 6)):
            counter += 1
            kind = counter % 3
            if kind == 0:
                chain.append(hashlib.sha256(counter.to_bytes(8, "big")).digest())
            elif kind == 1:
                chain.append(2**63 + counter * 7_919)  # above 2^63
            else:
                chain.append(-counter)
        parent = live[-1] if live and rng.random() < 0.5 else None
        extra = {"future_field": [1, 2]} if encoding == "map" else None
        events.append(stored(chain, parent, encoding=encoding, extra=extra))
        engine.store(chain)
        live.extend(chain)
        events.append(["BlockTouched", chain[:1]] if encoding == "array" else {"type": "BlockTouched", "block_hashes": chain[:1]})
        if rng.random() < 0.4:
            offloaded = rng.sample(live, min(2, len(live)))
            events.append(stored(offloaded, medium="CPU", encoding=encoding))
            engine.store(offloaded, "CPU")
        if rng.random() < 0.5 and len(live) > 4:
            gone = rng.sample(live, 2)
            events.append(removed(gone, medium="GPU", encoding=encoding))
            engine.remove(gone, "GPU")
            live = [h for h in live if h not in gone]
        if n % 7 == 3:
            adapter = [f"a{counter}".encode()]
            events.append(stored(adapter, lora_id=2, lora_name="sql", encoding=encoding))
            engine.store(adapter, lora_name="sql")
        fake.publish(events, encoding=encoding, drop=drop(fake.seq))


# ---- helpers ---------------------------------------------------------------------------------


async def until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def bridge_config(broker_target: str, fakes: list[Any], **changes: Any) -> BridgeConfig:
    """For FakeVllm or VllmPublisher ranks."""
    base = BridgeConfig(
        events=f"tcp://127.0.0.1:{fakes[0].pub_port}",
        replay=f"tcp://127.0.0.1:{fakes[0].replay_port}",
        topic="kv-events",
        broker=broker_target,
        model="llama-3-8b",
        dp_size=len(fakes),
        replay_timeout_s=1.0,
    )
    return dataclasses.replace(base, **changes)


class Running:
    """A bridge running as a task of the test's event loop."""

    def __init__(self, config: BridgeConfig) -> None:
        self.bridge = VllmBridge(config)
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(self.bridge.run(self.stop))

    @property
    def ranks(self) -> list[RankBridge]:
        return self.bridge.ranks

    async def caught_up(self, fakes: list[Any], timeout: float = 10.0) -> None:
        """Every published batch applied and answered by the broker."""
        for rank, fake in zip(self.ranks, fakes, strict=True):

            def reached(r: RankBridge = rank, f: Any = fake) -> bool:
                return r.tracker.last == f.seq - 1

            await until(reached, timeout, f"rank {rank.rank} to reach seq {fake.seq - 1}")
            await asyncio.wait_for(rank.client.flush(), timeout)

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 15)


async def subscribed(fakes: list[FakeVllm]) -> None:
    await until(lambda: all(f.subscribed() for f in fakes), 10, "the bridge to subscribe")


async def residency_of(target: str, **query: Any) -> spb.GetResidencyResponse:
    async with grpc.aio.insecure_channel(target) as channel:
        response: spb.GetResidencyResponse = await spb_grpc.BrokerServiceStub(channel).GetResidency(spb.GetResidencyRequest(**query))
        return response


def assert_mirrors(broker: RunningBroker, expected: dict[str, str]) -> None:
    """The broker holds exactly the engine's blocks, each in the tier of its best copy."""
    core = broker.service.core
    got = {bid: core.tier_name(block.tier) for bid, block in core.blocks.items()}
    assert got == expected
    totals = broker.service.residency(spb.GetResidencyRequest(totals=True))
    assert totals is not None
    assert sum(t.blocks for t in totals.tiers) == len(expected) and totals.dropped_blocks == 0
    assert sum(t.bytes for t in totals.tiers) == len(expected) * BLOCK_BYTES


# ---- tests -----------------------------------------------------------------------------------


async def test_the_broker_holds_what_the_engine_stored_minus_what_it_removed(tmp_path: pathlib.Path) -> None:
    broker = await start_broker(big_config(f"file://{tmp_path}/j.journal"))
    fakes = fake_ranks(1)
    engine = Engine()
    try:
        running = Running(bridge_config(f"127.0.0.1:{broker.port}", fakes, capture=str(tmp_path / "cap.vllm")))
        await subscribed(fakes)
        workload(fakes[0], engine, 40, seed=1)
        await running.caught_up(fakes)
        expected = engine.expected()
        assert "dram" in expected.values() and any(int(b) > 2**63 for b in expected if b.isdigit())
        assert any(b.startswith("-") for b in expected) and any(b.startswith("0x") for b in expected)
        assert any(b.startswith("lora:sql/") for b in expected)
        assert_mirrors(broker, expected)
        # Over the wire too, one block and the totals.
        some = next(b for b, tier in expected.items() if tier == "dram")
        one = await residency_of(f"127.0.0.1:{broker.port}", block_id=some)
        assert (one.blocks[0].tier, one.blocks[0].size_bytes) == ("dram", BLOCK_BYTES)
        rank = running.ranks[0]
        stats = rank.translator.stats
        assert stats.unknown_events == 40 and stats.malformed_events == 0 and rank.stats.lost_batches == 0
        assert rank.client.counters.rejected_events == 0
        await running.finish()
    finally:
        for fake in fakes:
            fake.close()
        await broker.stop(grace=1)
    # The capture replays into exactly the events the bridge sent (after its clear on start).
    journaled = [pb.IntentBatch.FromString(r.payload) for r in JournalSource(f"file://{tmp_path}/j.journal").batches()]
    sent = [e for b in journaled for e in b.events]
    assert sent[0].WhichOneof("kind") == "cleared"
    imported = [e for b in read_trace(str(tmp_path / "cap.vllm"), "vllm-events", TraceOptions()) for e in b.events]
    assert imported == sent[1:]


@pytest.mark.parametrize("new_replay_format", [True, False])
async def test_batches_dropped_on_the_way_are_filled_from_the_replay_socket(new_replay_format: bool) -> None:
    broker = await start_broker(big_config())
    fakes = fake_ranks(1, new_replay_format=new_replay_format)
    engine = Engine()
    try:
        running = Running(bridge_config(f"127.0.0.1:{broker.port}", fakes))
        await subscribed(fakes)
        rank = running.ranks[0]
        # seq 3 and 4 never arrive live; 5 reveals the gap.
        workload(fakes[0], engine, 8, seed=2, drop=lambda seq: seq in (3, 4))
        await running.caught_up(fakes)
        assert (rank.stats.gaps, rank.stats.replay_requests, rank.stats.lost_batches) == (1, 1, 0)
        # The replay answered with everything from 3 on: 5..7 arrived live as well.
        assert rank.stats.duplicates == 3
        # Then 10 and 11; 12 reveals the gap.
        workload(fakes[0], engine, 12, seed=3, drop=lambda seq: seq in (10, 11))
        await running.caught_up(fakes)
        assert (rank.stats.gaps, rank.stats.replay_requests, rank.stats.lost_batches) == (2, 2, 0)
        assert rank.stats.applied == 20 and fakes[0].replays == 2
        assert_mirrors(broker, engine.expected())
        await running.finish()
    finally:
        for fake in fakes:
            fake.close()
        await broker.stop(grace=1)


async def test_without_a_replay_socket_a_gap_is_counted_as_lost() -> None:
    broker = await start_broker(big_config())
    fakes = fake_ranks(1)
    try:
        running = Running(bridge_config(f"127.0.0.1:{broker.port}", fakes, replay=None))
        await subscribed(fakes)
        fakes[0].publish([stored([1, 2])])
        fakes[0].publish([stored([3])], drop=True)
        fakes[0].publish([removed([1]), removed([3])])  # 3 was never seen: skipped
        await running.caught_up(fakes)
        rank = running.ranks[0]
        assert rank.stats.lost_batches == 1 and rank.translator.stats.unknown_removed == 1
        assert_mirrors(broker, {"2": "hbm"})
        await running.finish()
    finally:
        for fake in fakes:
            fake.close()
        await broker.stop(grace=1)


async def test_a_restarted_engine_has_its_blocks_cleared_and_other_ranks_keep_theirs() -> None:
    broker = await start_broker(big_config())
    fakes = fake_ranks(2)
    engines = [Engine("dp0/"), Engine("dp1/")]
    try:
        running = Running(bridge_config(f"127.0.0.1:{broker.port}", fakes))
        assert running.ranks[1].events_endpoint == f"tcp://127.0.0.1:{fakes[0].pub_port + 1}"
        assert [r.client_id for r in running.ranks] == ["vllm-dp0", "vllm-dp1"]
        await subscribed(fakes)
        for fake, engine, seed in zip(fakes, engines, (3, 4), strict=True):
            workload(fake, engine, 10, seed=seed)
        # Both ranks cache the same prefix: distinct blocks, one per rank.
        for fake, engine in zip(fakes, engines, strict=True):
            fake.publish([stored([b"shared-prefix"])])
            engine.store([b"shared-prefix"])
        await running.caught_up(fakes)
        assert_mirrors(broker, {**engines[0].expected(), **engines[1].expected()})

        # Rank 1's engine restarts. Its first batch is lost on the way; its second shows
        # the seq went back; the first comes from the (new) replay buffer.
        fakes[1].restart()
        engines[1] = Engine("dp1/")
        fakes[1].publish([stored([b"after-0"])], drop=True)
        engines[1].store([b"after-0"])
        fakes[1].publish([stored([b"after-1"], b"after-0")])
        engines[1].store([b"after-1"])
        await running.caught_up(fakes)
        rank1 = running.ranks[1]
        assert rank1.stats.restarts == 1 and rank1.translator.stats.restarts == 1 and rank1.stats.lost_batches == 0
        assert_mirrors(broker, {**engines[0].expected(), **engines[1].expected()})
        assert broker.service.core.blocks["dp1/0x" + b"after-1".hex()].parent_id == "dp1/0x" + b"after-0".hex()

        # AllBlocksCleared from rank 0 clears rank 0 only.
        fakes[0].publish([cleared()])
        await running.caught_up(fakes)
        assert_mirrors(broker, engines[1].expected())
        await running.finish()
    finally:
        for fake in fakes:
            fake.close()
        await broker.stop(grace=1)


async def test_a_small_broker_moves_blocks_by_its_policy_and_accounts_for_every_one() -> None:
    # HBM for 8 blocks, DRAM for 8, NVMe for 16 (watermarks 0.95/0.90): the broker's policy
    # demotes and finally evicts while vLLM keeps everything it stored.
    tiers = "".join(f'[[tiers]]\nname = "{n}"\ncapacity = {c * BLOCK_BYTES}\n' for n, c in (("hbm", 8), ("dram", 8), ("nvme", 16)))
    config = parse_config(f'[broker]\nlisten = "127.0.0.1:0"\n[policy]\nname = "lru"\n{tiers}')
    broker = await start_broker(dataclasses.replace(config, journal=JournalConfig(url="none")))
    fakes = fake_ranks(1)
    engine = Engine()
    try:
        running = Running(bridge_config(f"127.0.0.1:{broker.port}", fakes))
        await subscribed(fakes)
        workload(fakes[0], engine, 30, seed=6)
        await running.caught_up(fakes)
        rank = running.ranks[0]
        expected = engine.expected()
        assert len(expected) > 32
        core = broker.service.core
        # Membership is exact; placement is the policy's: every block is in a tier or dropped.
        assert set(core.blocks) == set(expected)
        totals = broker.service.residency(spb.GetResidencyRequest(totals=True))
        assert totals is not None
        held = sum(t.blocks for t in totals.tiers)
        assert held + totals.dropped_blocks == len(expected)
        assert sum(t.bytes for t in totals.tiers) == held * BLOCK_BYTES
        assert all(t.bytes <= t.capacity_bytes for t in totals.tiers)
        assert totals.dropped_blocks > 0 and rank.stats.directives_ignored > 0
        # Frees of blocks the policy moved or dropped are applied like any other.
        assert rank.client.counters.rejected_events == 0
        await running.finish()
    finally:
        for fake in fakes:
            fake.close()
        await broker.stop(grace=1)


def test_endpoints_follow_vllms_rank_offsets() -> None:
    assert offset_endpoint("tcp://10.0.0.5:5557", 0) == "tcp://10.0.0.5:5557"
    assert offset_endpoint("tcp://10.0.0.5:5557", 3) == "tcp://10.0.0.5:5560"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("inproc://kv", 2) == "inproc://kv_dp2"
    assert offset_endpoint("ipc:///tmp/kv", 0) == "ipc:///tmp/kv"
    # vLLM 0.33 raises for an ipc endpoint of a rank above 0, and leaves port 0 to the OS.
    with pytest.raises(ValueError, match="only tcp:// and inproc://"):
        offset_endpoint("ipc:///tmp/kv", 2)
    with pytest.raises(ValueError, match="port 0"):
        offset_endpoint("tcp://127.0.0.1:0", 1)
    with pytest.raises(ValueError):
        offset_endpoint("tcp://host", 1)


# ---- the broker killed under the bridge ------------------------------------------------------


def serve(tmp_path: pathlib.Path, journal: str, port: int = 0) -> tuple[subprocess.Popen[str], int]:
    config = tmp_path / "broker.toml"
    config.write_text(f'[policy]\nname = "lru"\n{BIG_TIERS}')
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


async def test_a_broker_killed_and_restarted_mid_stream_loses_and_duplicates_nothing(tmp_path: pathlib.Path) -> None:
    journal = f"file://{tmp_path}/kill.journal"
    proc, port = await asyncio.to_thread(serve, tmp_path, journal)
    fakes = fake_ranks(1)
    engine = Engine()
    target = f"127.0.0.1:{port}"
    try:
        running = Running(bridge_config(target, fakes))
        await subscribed(fakes)

        async def publish(batches: int, seed: int) -> None:
            for i in range(batches):
                workload(fakes[0], engine, 1, seed=seed * 1000 + i)
                await asyncio.sleep(0.004)

        publisher = asyncio.create_task(publish(150, seed=5))
        await asyncio.sleep(0.25)
        os.kill(proc.pid, signal.SIGKILL)  # mid-stream
        await asyncio.to_thread(proc.wait, 10)
        await asyncio.sleep(0.3)
        proc, port2 = await asyncio.to_thread(serve, tmp_path, journal, port)
        assert port2 == port
        await publisher
        await running.caught_up(fakes, timeout=15)
        client = running.ranks[0].client
        assert client.counters.connects >= 2 and client.counters.unrecoverable_batches == 0
        expected = engine.expected()
        totals = await asyncio.to_thread(get_residency, target, spb.GetResidencyRequest(totals=True))
        assert sum(t.blocks for t in totals.tiers) == len(expected)
        await running.finish()
    finally:
        for fake in fakes:
            fake.close()
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 30)
    # The journal: every batch of the bridge's client exactly once, in order, and the blocks
    # it allocated are the engine's, each allocated once.
    batches = [pb.IntentBatch.FromString(r.payload) for r in JournalSource(journal).batches()]
    seqs = [b.batch_seq for b in batches if b.client_id == "vllm-dp0"]
    assert seqs == list(range(1, len(seqs) + 1))
    live: dict[str, int] = {}
    for batch in batches:
        for event in batch.events:
            kind = event.WhichOneof("kind")
            if kind == "allocated":
                bid = event.allocated.intent.block_id
                assert bid not in live, f"{bid} allocated twice"
                live[bid] = 1
            elif kind == "freed":
                for bid in event.freed.block_ids:
                    del live[bid]
    assert set(live) == set(expected)


# ---- the command -----------------------------------------------------------------------------

CLI = """
import argparse, sys
from vllm_integration.events_from_vllm import bridge_cli
parser = argparse.ArgumentParser(prog="kvbroker")
bridge_cli.add_parser(parser.add_subparsers(dest="verb", required=True))
args = parser.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""


async def test_the_command_bridges_captures_and_exits_cleanly_on_sigterm(tmp_path: pathlib.Path) -> None:
    broker = await start_broker(big_config())
    fakes = fake_ranks(1)
    capture = tmp_path / "cli.vllm"
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CLI,
            "vllm-bridge",
            "--events",
            f"tcp://127.0.0.1:{fakes[0].pub_port}",
            "--replay",
            f"tcp://127.0.0.1:{fakes[0].replay_port}",
            "--topic",
            "kv-events",
            "--broker",
            f"127.0.0.1:{broker.port}",
            "--model",
            "llama-3-8b",
            "--tier-map",
            "GPU=hbm,CPU=nvme",
            "--capture",
            str(capture),
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stderr is not None
        first = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
        assert first == {"event": "bridging", "clients": ["vllm-dp0"], "events": [f"tcp://127.0.0.1:{fakes[0].pub_port}"]}
        await subscribed(fakes)
        fakes[0].publish([stored([1, 2]), stored([2], medium="CPU")])
        fakes[0].publish([stored([3], 2, medium="cpu")], drop=True)
        fakes[0].publish([removed([1])])
        core = broker.service.core
        await until(lambda: set(core.blocks) == {"2", "3"}, 10, "the blocks at the broker")
        assert core.tier_name(core.blocks["3"].tier) == "nvme"
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 15)
        out = (await proc.stdout.read()).decode().strip().splitlines()
        err = (await proc.stderr.read()).decode()
        assert proc.returncode == 0, err
        last = json.loads(out[-1])
        assert last["event"] == "stopped" and last["capture_records"] == 3
        [rank] = last["ranks"]
        assert (rank["received"], rank["applied"], rank["replay_requests"], rank["lost_batches"]) == (2, 3, 1, 0)
        assert rank["client"]["rejected_events"] == 0
    finally:
        for fake in fakes:
            fake.close()
        await broker.stop(grace=1)
    assert [b.batch_seq for b in read_trace(str(capture), "vllm-events", TraceOptions())] == [1, 2, 3]


async def test_the_command_refuses_bad_arguments() -> None:
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", CLI, "vllm-bridge", "--events", "tcp://127.0.0.1:1", "--broker", "127.0.0.1:1", "--model", "no-such-model"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert done.returncode == 2 and "unknown model 'no-such-model'" in done.stderr
    well_formed = ["--events", "tcp://127.0.0.1:1", "--broker", "127.0.0.1:1"]  # checked first
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", CLI, "vllm-bridge", *well_formed, "--model", "llama-3-8b", "--tier-map", "GPU"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert done.returncode == 2 and "expected MEDIUM=TIER" in done.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--events", "ipc:///tmp/kv", "--dp-size", "2"], "vLLM offsets only tcp:// and inproc:// endpoints"),
        (["--events", "tcp://127.0.0.1:0", "--dp-size", "2"], "port 0 is chosen by the OS"),
        (["--events", "tcp://127.0.0.1:5557", "--prefill-tokens-per-s", "0"], "--prefill-tokens-per-s: must be a finite number > 0"),
        (["--events", "tcp://127.0.0.1:5557", "--offload-block-size", "0"], "--offload-block-size: must be > 0"),
        (["--events", "tcp://127.0.0.1:5557", "--dp-start-rank", "-1"], "--dp-start-rank: must be >= 0"),
        (["--events", "tcp://127.0.0.1:5557", "--tier-map", "STORAGE@=nvme"], "expected MEDIUM@LOCALITY=TIER"),
        (["--events", "tcp://127.0.0.1:5557", "--stats-interval", "nan"], "--stats-interval: must be a finite number >= 0"),
    ],
)
async def test_the_command_names_the_bad_flag(flags: list[str], message: str) -> None:
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", CLI, "vllm-bridge", "--broker", "127.0.0.1:1", "--model", "llama-3-8b", *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr


async def test_the_command_serves_the_ranks_of_this_node_from_the_start_rank() -> None:
    # vLLM --data-parallel-start-rank 2 on this node: ranks 2 and 3, ports base + 2 and + 3.
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CLI,
        "vllm-bridge",
        *("--events", "tcp://127.0.0.1:15557", "--replay", "tcp://127.0.0.1:15657", "--broker", "127.0.0.1:1"),
        *("--model", "llama-3-8b", "--dp-size", "2", "--dp-start-rank", "2"),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        first = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
        assert first == {
            "event": "bridging",
            "clients": ["vllm-dp2", "vllm-dp3"],
            "events": ["tcp://127.0.0.1:15559", "tcp://127.0.0.1:15560"],
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)
    last = json.loads((await proc.stdout.read()).decode().strip().splitlines()[-1])
    assert [r["replay_endpoint"] for r in last["ranks"]] == ["tcp://127.0.0.1:15659", "tcp://127.0.0.1:15660"]


# ---- engine restarts the seq does not show (issue 21, defect 3) ----------------------------------


async def test_a_dropped_connection_to_the_same_engine_is_checked_and_not_taken_for_a_restart() -> None:
    # Fails on main: no continuity check (continuity_checks, disconnects are new counters).
    broker = await start_broker(big_config())
    truth = Truth()
    (engine,) = engines(truth, 1)
    publisher = engine.publisher
    try:
        running = Running(bridge_config(f"127.0.0.1:{broker.port}", [publisher]))
        await until(publisher.subscribed, 10, "the bridge to subscribe")
        for n in range(5):
            engine.send(block_stored([n], n - 1 if n else None))
        await running.caught_up([publisher])
        rank = running.ranks[0]
        # The connection drops and comes back; the engine goes on with seq 5.
        publisher.reconnect()
        await until(publisher.subscribed, 10, "the bridge to subscribe again")
        engine.send(block_stored([5], 4))
        await running.caught_up([publisher])
        assert rank.stats.disconnects >= 1 and rank.stats.continuity_checks == 1
        assert (rank.stats.restarts, rank.stats.gaps, rank.stats.lost_batches) == (0, 0, 0)
        # Again, and two batches go by while it reconnects: replayed, the same engine.
        publisher.reconnect()
        engine.send(block_stored([6], 5), missed=True)
        engine.send(block_stored([7], 6), missed=True)
        await until(publisher.subscribed, 10, "the bridge to subscribe again")
        engine.send(block_removed([0]), block_stored([8], 7))
        await running.caught_up([publisher])
        assert rank.stats.continuity_checks == 2 and rank.stats.restarts == 0 and rank.translator.stats.clears == 0
        assert (rank.stats.gaps, rank.stats.lost_batches) == (1, 0)
        assert_mirrors(broker, truth.expected())
        await running.finish()
    finally:
        publisher.close()
        await broker.stop(grace=1)


async def test_without_a_replay_socket_a_reconnect_whose_seq_jumps_is_a_restart() -> None:
    # Fails on main: the old engine's blocks stayed and nothing was logged.
    broker = await start_broker(big_config())
    truth = Truth()
    (engine,) = engines(truth, 1, replay=False)
    try:
        running = Running(bridge_config(f"127.0.0.1:{broker.port}", [engine.publisher], replay=None))
        await until(engine.publisher.subscribed, 10, "the bridge to subscribe")
        for n in range(5):
            engine.send(block_stored([f"old-{n}".encode()]))
        await running.caught_up([engine.publisher])
        engine.restart()
        for n in range(20):
            engine.send(block_stored([f"new-{n}".encode()]), missed=True)
        await until(engine.publisher.subscribed, 10, "the bridge to subscribe again")
        engine.send(block_stored([b"new-20"]))
        await running.caught_up([engine.publisher])
        rank = running.ranks[0]
        assert rank.stats.restarts == 1 and rank.stats.restart_causes == {"reconnect_jump": 1}
        # Without a replay socket the new engine's first 20 batches cannot be had: counted.
        assert rank.stats.lost_batches == 20
        assert_mirrors(broker, {block_id(b"new-20"): "hbm"})
        # A reconnect after which the seq follows on is the same engine.
        engine.publisher.reconnect()
        await until(engine.publisher.subscribed, 10, "the bridge to subscribe again")
        engine.send(block_stored([b"new-21"]))
        await running.caught_up([engine.publisher])
        assert rank.stats.restarts == 1
        assert_mirrors(broker, {block_id(b"new-20"): "hbm", block_id(b"new-21"): "hbm"})
        await running.finish()
    finally:
        engine.publisher.close()
        await broker.stop(grace=1)


async def test_a_detected_restart_is_in_the_capture_and_replays_as_the_bridge_sent_it(tmp_path: pathlib.Path) -> None:
    broker = await start_broker(big_config(f"file://{tmp_path}/j.journal"))
    truth = Truth()
    (engine,) = engines(truth, 1)
    try:
        running = Running(bridge_config(f"127.0.0.1:{broker.port}", [engine.publisher], capture=str(tmp_path / "cap.vllm")))
        await until(engine.publisher.subscribed, 10, "the bridge to subscribe")
        for n in range(5):
            engine.send(block_stored([f"old-{n}".encode()]), offloaded(f"old-{n}".encode(), "CPU"))
        await running.caught_up([engine.publisher])
        engine.restart()
        for n in range(20):
            engine.send(block_stored([f"new-{n}".encode()]), missed=True)
        await until(engine.publisher.subscribed, 10, "the bridge to subscribe again")
        for n in range(20, 23):
            engine.send(block_stored([f"new-{n}".encode()]))
        await running.caught_up([engine.publisher])
        assert running.ranks[0].stats.restart_causes == {"replay_differs": 1}
        assert_mirrors(broker, truth.expected())
        await running.finish()
    finally:
        engine.publisher.close()
        await broker.stop(grace=1)
    header, records = read_capture(str(tmp_path / "cap.vllm"))
    assert header["tier_map"] == [["GPU", "hbm"], ["CPU", "dram"], ["STORAGE", "nvme"]]
    seqs = [r.seq for r in records if not isinstance(r, Exception)]
    assert seqs == [0, 1, 2, 3, 4, RESTART_RECORD_SEQ, *range(23)]
    journaled = [pb.IntentBatch.FromString(r.payload) for r in JournalSource(f"file://{tmp_path}/j.journal").batches()]
    sent = [e for b in journaled for e in b.events]
    imported = [e for b in read_trace(str(tmp_path / "cap.vllm"), "vllm-events", TraceOptions()) for e in b.events]
    assert imported == sent[1:]
    assert [e.WhichOneof("kind") for e in imported].count("cleared") == 1


async def test_a_bridge_that_receives_nothing_says_so_and_its_stats_read_as_words(caplog: pytest.LogCaptureFixture) -> None:
    """Pointed at an engine that publishes nothing (the wrong port, or a vLLM without
    --kv-events-config), the bridge warned of nothing and waited silently; its stats line
    was a wall of nested counters."""
    caplog.set_level("WARNING", logger="vllm_integration")
    broker = await start_broker(big_config())
    fakes = fake_ranks(2)
    try:
        running = Running(bridge_config(f"127.0.0.1:{broker.port}", fakes, quiet_warning_s=2.0))
        await subscribed(fakes)
        fakes[1].publish([stored([1, 2])])  # rank 1 hears its engine; rank 0 hears nothing
        await until(lambda: any("nothing received" in r.getMessage() for r in caplog.records), 10, "the warning")
        await until(lambda: running.ranks[1].stats.applied == 1, 10, "rank 1's batch")
        await asyncio.sleep(2.1)  # past rank 1's deadline too: it received, so it says nothing
        quiet = [r.getMessage() for r in caplog.records if "nothing received" in r.getMessage()]
        assert len(quiet) == 1, quiet
        assert quiet[0].startswith(f"rank 0: nothing received from tcp://127.0.0.1:{fakes[0].pub_port} in "), quiet[0]
        assert "--kv-events-config" in quiet[0] and '"topic": "kv-events"' in quiet[0]
        summary = running.bridge.snapshot()["summary"]
        assert summary.startswith("rank 0: 0 batches received, 0 applied, 0 blocks held; broker connected, ")
        assert "; rank 1: 1 batches received, 1 applied, 2 blocks held; broker connected" in summary
        await running.finish()
    finally:
        for fake in fakes:
            fake.close()
        await broker.stop(grace=1)
