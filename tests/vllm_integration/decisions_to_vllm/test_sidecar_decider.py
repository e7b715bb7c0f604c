"""Sidecar mode against a real `kvbroker serve` on loopback, without vLLM: the translator
(what KvbrokerCachePolicy runs) is driven as vLLM's manager drives a CachePolicy (insert,
touch, evict before a store into a full tier), with the sidecar decider in its seam.

- broker up: every victim is the one the broker's policy chooses (a core with the broker's
  config, fed exactly what the broker was sent, chooses the same);
- broker killed (SIGKILL) mid-run: every evict returns within the bound (each call timed)
  with the fallback's victims, and nothing raises;
- broker restarted on the port (journal kept): the decider reconnects, the broker decides
  again, and what it holds in the rank's tier is exactly what vLLM holds.
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from broker.config import parse_config
from broker.model.apply import apply_batch
from broker.model.core import Core
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import broker_service_pb2_grpc as spb_grpc
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb
from tests.redis_server import free_port
from tests.vllm_integration.decisions_to_vllm.fakes import Chunk, Ctx
from tests.vllm_integration.decisions_to_vllm.test_sidecar_link import ROOT, start_broker, stop
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.link import BrokerLink, Unanswered
from vllm_integration.decisions_to_vllm.policy_calls import Translator
from vllm_integration.decisions_to_vllm.settings import load_settings
from vllm_integration.decisions_to_vllm.sidecar import SidecarDecider, make_decider

pytestmark = pytest.mark.e2e

CHUNKS = 32
DEADLINE_MS = 5.0
# What a loaded 2-core CI box may add to a bound of a few ms (a process waiting for a CPU:
# up to 140 ms seen with the broker down, when an evict waits for nothing). Far below what
# a wait on the network would cost (a connect attempt: 2 s); the median is held tighter.
MARGIN_S = 1.0
MEDIAN_MARGIN_S = 0.05
CLIENT = "vllm-dp0"
TIER = "cpu0"


def broker_config(policy: str) -> str:
    # One tier per data-parallel rank, each of vLLM's chunk count; watermarks at 1.0 (vLLM
    # makes room itself, with EvictionRequested).
    tiers = "".join(f'[[tiers]]\nname = "cpu{r}"\ncapacity = {CHUNKS}\nhigh_watermark = 1.0\nlow_watermark = 1.0\n' for r in (0, 1))
    return f'[policy]\nname = "{policy}"\n{tiers}'


class Engine:
    """Stores and touches as vLLM's manager does: a store into a full tier evicts first."""

    def __init__(self, translator: Translator) -> None:
        self.translator = translator
        self.evict_times: list[float] = []
        self.victims: list[list[bytes]] = []

    def store(self, i: int) -> None:
        key = key_of(i)
        request = Ctx(f"r{i}")
        if self.translator.get(key) is not None:
            self.translator.touch([key], request)
            return
        if len(self.translator.entries) >= CHUNKS:
            started = time.perf_counter()
            victims = self.translator.evict(1, {key})
            self.evict_times.append(time.perf_counter() - started)
            assert victims is not None and len(victims) == 1
            self.victims.append([k for k, _ in victims])
        self.translator.insert(key, Chunk(0), request)


def key_of(i: int) -> bytes:
    # A skewed stream: a small hot set and a long cold tail (an OffloadKey is bytes).
    n = i % 7 if i % 3 else (i * 7919) % 200
    return n.to_bytes(8, "big") + b"\x00\x00\x00\x00"


class Oracle:
    """A core with the broker's config, fed exactly what the decider sends the broker."""

    def __init__(self, policy: str, link: BrokerLink) -> None:
        self.core = Core(parse_config(broker_config(policy)).core)
        self.seq = 0
        self.choices: list[list[str]] = []
        self.on = True
        send, send_later, ask = link.send, link.send_later, link.ask

        def record_send(events: Sequence[pb.Event]) -> None:
            self.apply(events)
            send(events)

        def record_send_later(make: Callable[[], Sequence[pb.Event]]) -> None:
            self.apply(make())
            send_later(make)

        def record_ask(events: Sequence[pb.Event], timeout: float) -> dpb.DirectiveBatch | Unanswered:
            directives = self.apply(events)
            self.choices.append([d.block_id for d in directives])
            return ask(events, timeout)

        link.send, link.send_later, link.ask = record_send, record_send_later, record_ask  # type: ignore[method-assign]

    def apply(self, events: Sequence[pb.Event]) -> list[Any]:
        if not self.on or not events:
            return []
        self.seq += 1
        return apply_batch(self.core, pb.IntentBatch(client_id=CLIENT, batch_seq=self.seq, events=events)).directives


def serve(tmp_path: Path, policy: str, port: int = 0) -> tuple[subprocess.Popen[str], int]:
    journal = f"file://{tmp_path}/broker.journal"
    return start_broker(tmp_path, broker_config(policy), "--journal", journal, "--listen", f"127.0.0.1:{port}")


def broker_holds(port: int, held: set[str], client: str = CLIENT, tier: str = TIER) -> bool:
    """The rank's tier at the broker holds exactly ``held``: as many blocks, each of them there."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = spb_grpc.BrokerServiceStub(channel)
        totals = stub.GetResidency(spb.GetResidencyRequest(totals=True), timeout=10)
        if [t.blocks for t in totals.tiers if t.name == tier] != [len(held)]:
            return False
        for block_id in held:
            try:
                reply = stub.GetResidency(spb.GetResidencyRequest(block_id=f"{client}/{block_id}"), timeout=10)
            except grpc.RpcError:
                return False
            if reply.blocks[0].tier != tier:
                return False
    return True


def sidecar(port: int, fallback: str, tier: str = "cpu{rank}", rank: int = 0) -> tuple[Translator, SidecarDecider]:
    settings = load_settings(
        {
            "kvbroker_mode": "sidecar",
            "kvbroker_broker": f"127.0.0.1:{port}",
            "kvbroker_deadline_ms": DEADLINE_MS,
            "kvbroker_fallback_policy": fallback,
            "kvbroker_client_id": "vllm-dp{rank}",
            "kvbroker_broker_tier": tier,
        },
        environ={},
        rank=rank,  # vLLM's data-parallel index (KvbrokerCachePolicy finds it on the stack)
    )
    local = EmbeddedCore(settings, CHUNKS, policy=settings.fallback_policy)
    translator = Translator(local)
    decider = make_decider(settings, local, translator)
    translator.decider = decider
    return translator, decider


@pytest.mark.parametrize("policy", ["arc", "s3fifo"])
def test_broker_decides_then_the_fallback_holds_the_bound_through_a_kill_then_the_broker_again(tmp_path: Path, policy: str) -> None:
    proc, port = serve(tmp_path, policy)
    translator, decider = sidecar(port, "lru")  # the fallback's policy differs from the broker's
    decider.cooldown_s = 0.2
    link = decider.link
    oracle = Oracle(policy, link)
    engine = Engine(translator)
    try:
        assert link.wait_connected(10)
        # 1. Broker up: every victim is the one the broker's policy chooses. The bound is
        # generous here so that a loaded box never falls back (that is step 2's subject).
        decider.deadline_s = 5.0
        for i in range(400):
            engine.store(i)
        counts = decider.counters()
        assert counts["broker_decisions"] >= 50 and counts["fallback_decisions"] == 0, counts
        assert oracle.choices == [[f"{CLIENT}/{k.hex()}" for k in victims] for victims in engine.victims]
        oracle.on = False

        # 2. SIGKILL: the evicts that follow fall back within the bound, and nothing raises.
        decider.deadline_s = DEADLINE_MS / 1000
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        engine.evict_times.clear()
        for i in range(400, 800):
            engine.store(i)
        assert engine.evict_times and max(engine.evict_times) < DEADLINE_MS / 1000 + MARGIN_S, max(engine.evict_times)
        assert statistics.median(engine.evict_times) < DEADLINE_MS / 1000 + MEDIAN_MARGIN_S
        counts = decider.counters()
        assert counts["fallback_decisions"] >= 50, counts
        assert counts["fallback_down"] + counts["fallback_timeout"] + counts["fallback_cooldown"] == counts["fallback_decisions"], counts

        # 3. Restart on the same port (same journal): the decider reconnects and asks again.
        # The first answers may come late while the broker takes the resent backlog (then
        # the decider stops asking for cooldown_s): store on until it decides again.
        proc, port2 = serve(tmp_path, policy, port)
        assert port2 == port and link.wait_connected(10)
        decided = counts["broker_decisions"]
        i = 800
        deadline = time.monotonic() + 30
        while decider.counters()["broker_decisions"] < decided + 50 and time.monotonic() < deadline:
            engine.store(i)
            i += 1
        counts = decider.counters()
        assert counts["broker_decisions"] >= decided + 50, counts
        # What the broker holds in the rank's tier is what vLLM holds.
        held = {key.hex() for key in translator.entries}
        deadline = time.monotonic() + 10
        while not broker_holds(port, held) and time.monotonic() < deadline:
            time.sleep(0.05)
            decider.flush()  # late directives are settled, the tier restated if needed
        assert broker_holds(port, held)
    finally:
        decider.close()
        stop(proc)
    replay_verifies(tmp_path)  # across the kill and the restart


def wait_until_broker_holds(port: int, translator: Translator, decider: SidecarDecider) -> None:
    held = {key.hex() for key in translator.entries}
    deadline = time.monotonic() + 15
    while not broker_holds(port, held) and time.monotonic() < deadline:
        time.sleep(0.05)
        decider.flush()  # late directives are settled, the tier restated if needed
    assert broker_holds(port, held)


def test_a_hung_broker_costs_the_bound_then_its_late_answers_are_put_right(tmp_path: Path) -> None:
    # FIFO at the broker, LRU as the fallback, and every store first touches the oldest
    # chunk: FIFO evicts that chunk, LRU the one after it. So the late answers name a chunk
    # vLLM kept, and the broker must put it back.
    proc, port = serve(tmp_path, "fifo")
    translator, decider = sidecar(port, "lru")
    decider.cooldown_s = 60.0  # once rested, the broker is not asked again in this test
    engine = Engine(translator)
    order: list[bytes] = []  # keys in the order they were stored

    def step(i: int) -> None:
        key = i.to_bytes(8, "big")
        if order:
            oldest = next(k for k in order if translator.get(k) is not None)
            translator.touch([oldest], Ctx(f"t{i}"))
        if len(translator.entries) >= CHUNKS:
            started = time.perf_counter()
            victims = translator.evict(1, {key})
            engine.evict_times.append(time.perf_counter() - started)
            assert victims is not None and len(victims) == 1
        translator.insert(key, Chunk(0), Ctx(f"r{i}"))
        order.append(key)

    try:
        assert decider.link.wait_connected(10)
        decider.deadline_s = 5.0
        for i in range(CHUNKS + 20):
            step(i)
        assert decider.counters()["broker_decisions"] == 20
        # SIGSTOP: the stream stays up, no answer comes. Each evict costs at most the bound;
        # after three late answers in a row the broker is not asked for cooldown_s.
        decider.deadline_s = DEADLINE_MS / 1000
        proc.send_signal(signal.SIGSTOP)
        engine.evict_times.clear()
        for i in range(CHUNKS + 20, CHUNKS + 60):
            step(i)
        assert max(engine.evict_times) < DEADLINE_MS / 1000 + MARGIN_S, max(engine.evict_times)
        assert statistics.median(engine.evict_times) < DEADLINE_MS / 1000 + MEDIAN_MARGIN_S
        counts = decider.counters()
        assert counts["fallback_timeout"] == 3 and counts["fallback_cooldown"] == 37, counts
        proc.send_signal(signal.SIGCONT)
        # The three requests reach the broker late. The first evicts the touched chunk, which
        # vLLM kept (LRU evicted the next one): the decider acks it FAILED and the broker puts
        # it back. (That access of a chunk the broker had dropped brings it back as newest, so
        # the next two late victims are the ones the fallback chose too: acked DONE.) The
        # broker ends up holding exactly what vLLM holds.
        wait_until_broker_holds(port, translator, decider)
        counts = decider.counters()
        assert counts["link_late_answers"] == 3, counts
        assert counts["late_victims_kept"] >= 1 and counts["late_victims_kept"] + counts["late_victims_evicted"] == 3, counts
        assert counts["resyncs"] == 0, counts
    finally:
        proc.send_signal(signal.SIGCONT)
        decider.close()
        stop(proc)
    # The broker's journal (late requests, FAILED acks, fallbacks' frees and all) replays to
    # exactly the directives the broker sent.
    replay_verifies(tmp_path)


def replay_verifies(tmp_path: Path) -> None:
    replay = subprocess.run(
        [sys.executable, "-m", "broker.cli.main", "replay", "--journal", f"file://{tmp_path}/broker.journal", "--verify"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert replay.returncode == 0, replay.stdout + replay.stderr


def test_a_broker_that_lost_its_state_gets_the_tier_restated(tmp_path: Path) -> None:
    # No journal: a restarted broker knows nothing of this client; the resend cannot give
    # back what the client no longer retains, so the decider restates the tier.
    config = broker_config("lru")
    proc, port = start_broker(tmp_path, config, "--journal", "none")
    translator, decider = sidecar(port, "lru")
    # Retain no answered batch (as if the run were longer than retain_batches): what the
    # restarted broker lost cannot be resent.
    decider.link._client._retain = 0
    engine = Engine(translator)
    try:
        assert decider.link.wait_connected(10)
        for i in range(200):
            engine.store(i)
        decider.flush()
        wait_until_broker_holds(port, translator, decider)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc, port2 = start_broker(tmp_path, config, "--journal", "none", "--listen", f"127.0.0.1:{port}")
        assert port2 == port and decider.link.wait_connected(10)
        for i in range(200, 260):
            engine.store(i)
        wait_until_broker_holds(port, translator, decider)
        assert decider.counters()["resyncs"] >= 1
    finally:
        decider.close()
        stop(proc)


def test_one_broker_serves_two_data_parallel_ranks(tmp_path: Path) -> None:
    proc, port = serve(tmp_path, "lru")
    ranks = []
    for rank in (0, 1):
        translator, decider = sidecar(port, "lru", rank=rank)
        decider.deadline_s = 5.0  # the broker decides: no fallback on a loaded box
        ranks.append((Engine(translator), translator, decider))
    try:
        assert all(decider.link.wait_connected(10) for _, _, decider in ranks)
        # Both ranks store the same keys (each its own prefix cache), interleaved, rank 1
        # with a shifted stream: the ids do not collide at the broker, and each rank's
        # victims come from its own tier.
        for i in range(300):
            ranks[0][0].store(i)
            ranks[1][0].store(i + 3)
        for rank, (_, translator, decider) in enumerate(ranks):
            counts = decider.counters()
            assert counts["broker_decisions"] >= 50 and counts["fallback_decisions"] == 0, counts
            decider.flush()
            held = {key.hex() for key in translator.entries}
            deadline = time.monotonic() + 10
            while not broker_holds(port, held, f"vllm-dp{rank}", f"cpu{rank}") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert broker_holds(port, held, f"vllm-dp{rank}", f"cpu{rank}")
    finally:
        for _, _, decider in ranks:
            decider.close()
        stop(proc)


def test_a_tier_the_broker_does_not_have_is_said_in_the_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    proc, port = serve(tmp_path, "lru")
    _, decider = sidecar(port, "lru", tier="cpu9")
    try:
        deadline = time.monotonic() + 15
        while not any("no tier 'cpu9'" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.05)
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "no tier 'cpu9'" in r.getMessage()]
        assert errors and "cpu0, cpu1" in errors[0], [r.getMessage() for r in caplog.records]
    finally:
        decider.close()
        stop(proc)


def test_vllm_may_start_before_the_broker(tmp_path: Path) -> None:
    # The sidecar starts with no broker on its port: it decides locally at once, and once a
    # broker comes up it connects by itself, sends everything vLLM did so far, and the
    # broker decides from then on, holding what vLLM holds.
    port = free_port()
    translator, decider = sidecar(port, "lru")
    engine = Engine(translator)
    proc = None
    try:
        for i in range(200):
            engine.store(i)
        counts = decider.counters()
        assert counts["fallback_down"] == counts["evictions_asked"] > 0, counts
        assert statistics.median(engine.evict_times) < DEADLINE_MS / 1000 + MEDIAN_MARGIN_S
        proc, port2 = serve(tmp_path, "lru", port)
        assert port2 == port and decider.link.wait_connected(10)
        decider.deadline_s = 5.0
        for i in range(200, 400):
            engine.store(i)
        assert decider.counters()["broker_decisions"] > 0
        wait_until_broker_holds(port, translator, decider)
    finally:
        decider.close()
        if proc is not None:
            stop(proc)
