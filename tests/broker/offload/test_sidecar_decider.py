"""SidecarDecider against a real `kvbroker serve` on loopback, driven as vLLM's manager drives
a CachePolicy (store, touch, evict), without vLLM.

- broker up: the victims are exactly the ones the broker's policy chooses (the same stream
  replayed into a core with the broker's config chooses the same);
- broker killed (SIGKILL) mid-run: every evict returns within the bound (measured per call)
  with the fallback's victims, nothing raises;
- broker restarted on the port (journal kept): the decider reconnects and the broker decides
  again, and its view is what the engine really holds.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from broker.config import parse_config
from broker.model.apply import apply_batch
from broker.model.core import Core
from broker.offload.link import BrokerLink
from broker.offload.sidecar import SidecarDecider
from clients.broker_client import accessed_event, allocated_event, freed_event
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import broker_service_pb2_grpc as spb_grpc
from kvbroker.v1 import intent_pb2 as pb
from policies.base import DROPPED
from tests.broker.offload.test_sidecar_link import stop
from tests.e2e.test_cli import start_serve

pytestmark = pytest.mark.e2e

CHUNKS = 32
DEADLINE_S = 0.005
# What a loaded 2-core CI box may add to a bound of a few ms (thread wake-ups, GC).
MARGIN_S = 0.25


def tier_config(policy: str, capacity: int = CHUNKS) -> str:
    return f'[policy]\nname = "{policy}"\n[[tiers]]\nname = "cpu"\ncapacity = {capacity}\nhigh_watermark = 1.0\nlow_watermark = 1.0\n'


class CoreMirror:
    """The local tier: a core of one tier of CHUNKS one-byte blocks (what the embedded mode runs)."""

    tier = "cpu"

    def __init__(self, policy: str = "lru") -> None:
        self.core = Core(parse_config(tier_config(policy)).core)
        self.seq = 0

    def apply(self, events: list[pb.Event]) -> list[str]:
        self.seq += 1
        outcome = apply_batch(self.core, pb.IntentBatch(client_id="local", batch_seq=self.seq, events=events))
        assert not outcome.rejections, outcome.rejections
        return [d.block_id for d in outcome.directives]

    def evict(self, n: int, protected: set[str]) -> list[str] | None:
        request = pb.EvictionRequested(tier=self.tier, count=n, protected_block_ids=sorted(protected))
        self.seq += 1
        event = pb.Event(ts_us=self.core.clock.now_us, eviction_requested=request)
        batch = pb.IntentBatch(client_id="local", batch_seq=self.seq, events=[event])
        outcome = apply_batch(self.core, batch)
        if outcome.rejections:
            return None
        victims = [d.block_id for d in outcome.directives]
        self.forget(victims)
        return victims

    def forget(self, keys: list[str]) -> None:
        self.apply([freed_event(keys, self.core.clock.now_us)])

    def block_id(self, key: str) -> str:
        return key

    def key_of(self, block_id: str) -> str | None:
        block = self.core.blocks.get(block_id)
        return block_id if block is not None and block.tier != DROPPED else None

    def evictable(self, key: str) -> bool:
        return not self.core.blocks[key].pinned

    def restate(self) -> list[pb.Event]:
        return [allocated_event(b, 1, self.core.clock.now_us, tier=self.tier) for b in self.core.blocks]


class Engine:
    """Stores and touches like vLLM's manager: a store that finds the tier full evicts first."""

    def __init__(self, decider: SidecarDecider[str], mirror: CoreMirror, clock: list[int]) -> None:
        self.decider = decider
        self.mirror = mirror
        self.held: set[str] = set()
        self.clock = clock
        self.evict_times: list[float] = []
        self.evicted: list[list[str]] = []

    def call(self, events: list[pb.Event]) -> None:
        self.mirror.apply(events)
        self.decider.forward(events)

    @property
    def ts(self) -> int:
        return self.clock[0]

    def store(self, key: str) -> None:
        self.clock[0] += 1
        if key in self.held:
            self.call([accessed_event([key], self.ts)])
            return
        if len(self.held) >= CHUNKS:
            started = time.perf_counter()
            victims = self.decider.evict(1, {key})
            self.evict_times.append(time.perf_counter() - started)
            assert victims is not None and len(victims) == 1
            assert victims[0] in self.held
            self.held.difference_update(victims)
            self.evicted.append(victims)
        self.held.add(key)
        self.call([allocated_event(key, 1, self.ts, tier="cpu")])


def keys(i: int) -> str:
    # A skewed stream: a small hot set and a long cold tail.
    return f"k{i % 7}" if i % 3 else f"k{(i * 7919) % 200}"


def serve(tmp_path: Path, policy: str, port: int = 0) -> tuple[subprocess.Popen[str], int]:
    journal = f"file://{tmp_path}/broker.journal"
    return start_serve(tmp_path, "--journal", journal, "--listen", f"127.0.0.1:{port}", config_text=tier_config(policy))


def broker_holds(port: int, held: set[str]) -> bool:
    """The broker's tier holds exactly ``held``: as many blocks, each of them there."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = spb_grpc.BrokerServiceStub(channel)
        totals = stub.GetResidency(spb.GetResidencyRequest(totals=True), timeout=10)
        if [t.blocks for t in totals.tiers if t.name == "cpu"] != [len(held)]:
            return False
        for block_id in held:
            reply = stub.GetResidency(spb.GetResidencyRequest(block_id=block_id), timeout=10)
            if reply.blocks[0].tier != "cpu":
                return False
    return True


@pytest.mark.parametrize("policy", ["arc", "s3fifo"])
def test_victims_are_the_brokers_and_the_fallback_holds_the_bound_through_a_kill(tmp_path: Path, policy: str) -> None:
    proc, port = serve(tmp_path, policy)
    mirror = CoreMirror("lru")  # the fallback policy differs from the broker's on purpose
    link = BrokerLink(f"127.0.0.1:{port}", "vllm-dp0", backoff_initial_s=0.02, backoff_max_s=0.1)
    clock = [0]
    # Event time is the engine's, for its events and the decider's alike.
    decider: SidecarDecider[str] = SidecarDecider(
        link, mirror, deadline_s=DEADLINE_S, cooldown_s=0.2, log_every_s=0.5, now_us=lambda: clock[0]
    )
    engine = Engine(decider, mirror, clock)
    # The broker's decisions, replayed: a core with the broker's config fed the same stream.
    oracle = CoreMirror(policy)
    try:
        assert link.wait_connected(10)
        # 1. Broker up: every victim is the one the broker's policy chooses. The bound is
        # generous here so that a loaded CI box never falls back (that is step 2's subject).
        decider.deadline_s = 2.0
        for i in range(400):
            key = keys(i)
            before = len(engine.evicted)
            engine.store(key)
            if len(engine.evicted) > before:
                assert engine.evicted[-1] == oracle.evict(1, {key}), f"step {i}"
            held = key in oracle.core.blocks
            oracle.apply([accessed_event([key], engine.ts) if held else allocated_event(key, 1, engine.ts, tier="cpu")])
        counts = decider.counters()
        assert counts["broker_decisions"] >= 50, counts
        assert counts["fallback_decisions"] == 0, counts

        # 2. SIGKILL: the evicts that follow fall back within the bound, and never raise.
        decider.deadline_s = DEADLINE_S
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        engine.evict_times.clear()
        for i in range(400, 800):
            engine.store(keys(i))
        assert engine.evict_times and max(engine.evict_times) < DEADLINE_S + MARGIN_S, max(engine.evict_times)
        counts = decider.counters()
        assert counts["fallback_decisions"] >= 50, counts
        assert counts["fallback_down"] + counts["fallback_timeout"] == counts["fallback_decisions"], counts

        # 3. Restart on the same port (same journal): the decider reconnects and asks again.
        proc, port2 = serve(tmp_path, policy, port)
        assert port2 == port and link.wait_connected(10)
        # The first answers may come late while the broker takes the resent backlog (then the
        # decider stops asking for cooldown_s): store on until it decides again.
        decided = counts["broker_decisions"]
        i = 800
        deadline = time.monotonic() + 30
        while decider.counters()["broker_decisions"] < decided + 50 and time.monotonic() < deadline:
            engine.store(keys(i))
            i += 1
        counts = decider.counters()
        assert counts["broker_decisions"] >= decided + 50, counts
        # What the broker holds in the tier is what the engine holds.
        deadline = time.monotonic() + 10
        while not broker_holds(port, engine.held) and time.monotonic() < deadline:
            time.sleep(0.05)
            decider.settle()  # late directives answered, the tier restated if needed
        assert broker_holds(port, engine.held)
    finally:
        decider.close()
        stop(proc)
