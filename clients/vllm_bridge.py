"""The vLLM sidecar bridge: vLLM's KV-cache events (ZMQ) in, broker events (gRPC) out.

One ``RankBridge`` per data-parallel rank: a SUB socket on the rank's events endpoint (port
+ rank), a DEALER for its replay endpoint, an ``EngineTranslator`` and a ``BrokerClient``
with the client id ``<client_id>-dp<rank>``. Per batch received:

1. seq is the next one: decode, translate, send (and capture).
2. seq jumped (a loss, or the bridge joined late): ask the replay socket for everything
   from the first missing seq, apply what it returns in order, then the live batch. What
   the replay buffer no longer holds is counted in ``lost_batches`` and logged; the bridge
   goes on with what it has (a later BlockRemoved of a block it never saw is skipped).
3. seq went back: the engine restarted. Its blocks are cleared at the broker with the first
   batch of the new engine (then the gap logic applies from seq 0).
4. seq already applied through a replay: a duplicate, dropped.

The broker side is the client's business: batches are bounded (``when_full``; ``block``
by default, so a broker outage backs up into ZMQ, whose losses the replay socket then
repairs), a broken stream is reopened with backoff and resumed by batch_seq. On start the
bridge clears what the broker holds for its client ids (it cannot know which of those
blocks the engine still has).

Directives are counted and not acked: vLLM decides its own evictions and takes no orders,
so the broker's tier placement is what its policy would have done with vLLM's blocks; block
membership stays exact (every block vLLM holds is allocated at the broker, in some tier or
dropped by the policy, and every block vLLM removed is freed).
Acking them as failed to pin the model to vLLM's placement would make the policy pick
another victim for each, without end, whenever vLLM's cache is fuller than the broker's
watermark (it usually is); and acks would put directive ids of the live policy into the
journal, which replays of other policies cannot apply. The journal stays what vLLM did, for
``kvbroker replay`` / ``compare`` of policies against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from clients import kvsize
from clients.broker_client import BrokerClient, BrokerError, BrokerQueueFull, WhenFull
from clients.vllm_events import (
    END_OF_REPLAY,
    CaptureWriter,
    DecodeError,
    EventBatch,
    SeqTracker,
    decode_batch,
    rank_namespace,
    replay_request,
    split_live,
    split_replay,
    ts_to_us,
)
from clients.vllm_translator import DEFAULT_TIER_MAP, EngineTranslator, MappingOptions, format_tier_map, resolve_model
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb

log = logging.getLogger("kvbroker.vllm_bridge")


@dataclasses.dataclass(frozen=True)
class BridgeConfig:
    events: str
    broker: str
    model: str = "llama-3-8b"
    replay: str | None = None
    topic: str = ""
    dp_size: int = 1
    client_id: str = "vllm"
    tier_map: tuple[tuple[str, str], ...] = DEFAULT_TIER_MAP
    dtype: str = "fp16"
    block_bytes: int | None = None
    tenant: str = ""
    capture: str | None = None
    when_full: str = WhenFull.BLOCK
    max_pending_batches: int = 1024
    max_batch_events: int = 512
    max_delay_s: float = 0.005
    # How long to wait for the next replay reply before giving the rest up as lost.
    replay_timeout_s: float = 2.0
    clear_on_start: bool = True
    rcvhwm: int = 100_000
    close_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        WhenFull(self.when_full)
        if self.replay_timeout_s <= 0:
            raise ValueError("replay_timeout_s must be > 0")


def offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's convention: rank r publishes on port + r (tcp), or ``<endpoint>_dp<r>`` (ipc/inproc)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or parts.port is None:
        raise ValueError(f"endpoint {endpoint!r}: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    host = endpoint[len("tcp://") : endpoint.rindex(":")]
    return f"tcp://{host}:{parts.port + rank}"


def now_us() -> int:
    return int(time.time() * 1_000_000)


@dataclasses.dataclass
class RankStats:
    received: int = 0
    applied: int = 0
    duplicates: int = 0
    gaps: int = 0
    replay_requests: int = 0
    replayed: int = 0
    replay_timeouts: int = 0
    lost_batches: int = 0
    restarts: int = 0
    bad_frames: int = 0
    directives_ignored: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class RankBridge:
    """One data-parallel rank: its sockets, its sequence, its translator and its client."""

    def __init__(
        self,
        rank: int,
        config: BridgeConfig,
        ctx: zmq.asyncio.Context,
        shape: kvsize.ModelShape | None,
        capture: CaptureWriter | None,
    ) -> None:
        self.rank = rank
        self.config = config
        self.ctx = ctx
        self.capture = capture
        self.events_endpoint = offset_endpoint(config.events, rank)
        self.replay_endpoint = offset_endpoint(config.replay, rank) if config.replay else None
        options = MappingOptions(
            model=config.model,
            dtype=config.dtype,
            block_bytes=config.block_bytes,
            tier_map=config.tier_map,
            namespace=rank_namespace(rank, config.dp_size),
            tenant=config.tenant,
        )
        self.translator = EngineTranslator(options, shape)
        self.tracker = SeqTracker()
        self.stats = RankStats()
        self.client_id = f"{config.client_id}-dp{rank}"
        self.client = BrokerClient(
            config.broker,
            self.client_id,
            tenant=config.tenant,
            max_batch_events=config.max_batch_events,
            max_delay_s=config.max_delay_s,
            max_pending_batches=config.max_pending_batches,
            when_full=config.when_full,
            on_directive=self._on_directive,
            close_timeout_s=config.close_timeout_s,
        )
        self._restart_pending = False

    # ---- receiving -----------------------------------------------------------------------

    async def run(self) -> None:
        """Subscribe and apply batches until cancelled."""
        self.client.start()
        if self.config.clear_on_start:
            await self.client.clear(ts_us=now_us())
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.config.rcvhwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
        sub.connect(self.events_endpoint)
        log.info("rank %d: %s -> broker %s as %s", self.rank, self.events_endpoint, self.config.broker, self.client_id)
        try:
            while True:
                frames = await sub.recv_multipart()
                await self.on_live(frames)
        finally:
            sub.close(linger=0)

    async def on_live(self, frames: list[bytes]) -> None:
        try:
            _topic, seq, payload = split_live(frames)
        except DecodeError as exc:
            self.stats.bad_frames += 1
            log.warning("rank %d: bad message skipped: %s", self.rank, exc)
            return
        self.stats.received += 1
        tracker = self.tracker
        verdict = tracker.classify(seq)
        if verdict == SeqTracker.RESTART:
            log.warning("rank %d: seq went back from %d to %d: the engine restarted; clearing its blocks", self.rank, tracker.last, seq)
            self.stats.restarts += 1
            tracker.restarted()
            # The clear goes with the first batch of the new engine, as the capture importer does it.
            self._restart_pending = True
            verdict = tracker.classify(seq)
        if verdict == SeqTracker.DUPLICATE:
            self.stats.duplicates += 1
            return
        if verdict == SeqTracker.GAP:
            await self._fill(tracker.last + 1, seq)
            if seq <= tracker.last:
                self.stats.duplicates += 1
                return
            if seq > tracker.last + 1:
                missing = seq - tracker.last - 1
                self.stats.lost_batches += missing
                log.warning("rank %d: batches %d..%d lost (not in the replay buffer)", self.rank, tracker.last + 1, seq - 1)
        await self._apply(seq, payload)

    async def _fill(self, start: int, until: int) -> None:
        """Apply what the replay socket holds from ``start`` on (at least up to ``until``)."""
        self.stats.gaps += 1
        if self.replay_endpoint is None:
            return
        self.stats.replay_requests += 1
        log.info("rank %d: gap before seq %d; replaying from %d", self.rank, until, start)
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        tracker = self.tracker
        try:
            await dealer.send_multipart(replay_request(start))
            timeout_ms = int(self.config.replay_timeout_s * 1000)
            while True:
                if not await dealer.poll(timeout_ms):
                    self.stats.replay_timeouts += 1
                    log.warning("rank %d: the replay socket %s did not answer in time", self.rank, self.replay_endpoint)
                    break
                frames = await dealer.recv_multipart()
                try:
                    seq, payload = split_replay(frames)
                except DecodeError as exc:
                    self.stats.bad_frames += 1
                    log.warning("rank %d: bad replay reply skipped: %s", self.rank, exc)
                    continue
                if seq == END_OF_REPLAY:
                    break
                self.stats.replayed += 1
                if seq <= tracker.last:
                    continue
                if seq > tracker.last + 1:
                    self.stats.lost_batches += seq - tracker.last - 1
                    log.warning("rank %d: batches %d..%d lost (not in the replay buffer)", self.rank, tracker.last + 1, seq - 1)
                await self._apply(seq, payload)
        finally:
            dealer.close(linger=0)
        tracker.filled(start)

    async def _apply(self, seq: int, payload: bytes) -> None:
        received = time.time()
        events: list[pb.Event] = []
        batch: EventBatch | None = None
        try:
            batch = decode_batch(payload)
        except DecodeError as exc:
            self.translator.stats.bad_batches += 1
            log.warning("rank %d: batch %d skipped: %s", self.rank, seq, exc)
        if batch is not None and batch.problems:
            log.debug("rank %d: batch %d: %s", self.rank, seq, "; ".join(batch.problems))
        ts = ts_to_us(batch.ts if batch is not None else None, received)
        if self._restart_pending:
            self._restart_pending = False
            events.extend(self.translator.restart(ts))
        if batch is not None:
            events.extend(self.translator.translate(batch, ts))
        if self.capture is not None:
            self.capture.write(self.rank, seq, received, payload)
        self.tracker.applied(seq)
        self.stats.applied += 1
        for event in events:
            # when_full="raise": an event refused is counted by the client (refused_events); go on.
            with contextlib.suppress(BrokerQueueFull):
                await self.client.add(event)

    # ---- directives ----------------------------------------------------------------------

    def _on_directive(self, directive: dpb.Directive) -> None:
        self.stats.directives_ignored += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "client_id": self.client_id,
            "events_endpoint": self.events_endpoint,
            "last_seq": self.tracker.last,
            "held_blocks": len(self.translator.held),
            **self.stats.as_dict(),
            "translator": self.translator.stats.as_dict(),
            "client": {**self.client.counters.as_dict(), "connected": self.client.connected, "unanswered": self.client.unanswered},
        }


class VllmBridge:
    """All ranks of one engine deployment; ``run`` until ``stop`` is set."""

    def __init__(self, config: BridgeConfig) -> None:
        self.config = config
        # Fail early on a model that cannot be sized.
        self.shape = None if config.block_bytes is not None else resolve_model(config.model)
        self.ctx = zmq.asyncio.Context()
        self.capture: CaptureWriter | None = None
        try:
            self.ranks = [RankBridge(rank, config, self.ctx, self.shape, None) for rank in range(config.dp_size)]
        except BaseException:
            self.ctx.destroy(linger=0)
            raise
        if config.capture:
            header = {
                "model": config.model,
                "tier_map": [list(pair) for pair in config.tier_map],
                "client_id": config.client_id,
                "dp_size": config.dp_size,
                "topic": config.topic,
                "dtype": config.dtype,
                "block_bytes": config.block_bytes,
                "tenant": config.tenant,
            }
            self.capture = CaptureWriter(config.capture, header)
            for rank in self.ranks:
                rank.capture = self.capture

    async def run(self, stop: asyncio.Event) -> None:
        """Bridge until ``stop`` is set; then flush (bounded by close_timeout_s) and close.
        Raises BrokerError if the broker refused a client for good."""
        log.info("bridging %d rank(s) to %s; tiers %s", len(self.ranks), self.config.broker, format_tier_map(self.config.tier_map))
        tasks = [asyncio.create_task(rank.run(), name=f"vllm-bridge rank {rank.rank}") for rank in self.ranks]
        stopper = asyncio.create_task(stop.wait())
        failure: BaseException | None = None
        try:
            done, _ = await asyncio.wait({*tasks, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                if task in done and task.exception() is not None:
                    failure = task.exception()
        finally:
            stopper.cancel()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await asyncio.gather(*(rank.client.close() for rank in self.ranks), return_exceptions=True)
            if self.capture is not None:
                self.capture.close()
            self.ctx.destroy(linger=0)
        if failure is not None:
            if isinstance(failure, BrokerError):
                raise failure
            raise RuntimeError(f"bridge rank failed: {failure}") from failure

    def snapshot(self) -> dict[str, Any]:
        return {"ranks": [rank.snapshot() for rank in self.ranks], "capture_records": self.capture.records if self.capture else 0}
