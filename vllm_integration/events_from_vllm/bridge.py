"""The vLLM sidecar bridge: vLLM's KV-cache events (ZMQ) in, broker events (gRPC) out.

One ``RankBridge`` per data-parallel rank: a SUB socket on the rank's events endpoint (port
+ rank, as vLLM offsets it), a DEALER for its replay endpoint, an ``EngineTranslator`` and a
``BrokerClient`` with the client id ``<client_id>-dp<rank>``. Per batch received:

1. seq is the next one: decode, translate, send (and capture).
2. seq jumped (a loss, the bridge joined late, or a new engine whose first batches it
   missed): ask the replay socket for everything from the last seq applied on, check that
   the batch it holds at that seq is the one applied (the same engine), and apply the rest
   in order, then the live batch. A different batch there, or none at or after it, means
   the engine restarted: its blocks are cleared and the new engine's whole replay buffer is
   applied from seq 0. What the replay buffer no longer holds is counted in
   ``lost_batches`` and logged; the bridge goes on with what it has (a later BlockRemoved
   of a block it never saw is skipped).
3. seq went back: the engine restarted. Its blocks are cleared with the first batch of the
   new engine (then the gap logic applies from seq 0).
4. seq already applied through a replay: a duplicate, dropped.

**Restarts the seq does not show.** A new engine starts at seq 0; if the bridge misses its
first batches while it reconnects, the first one it sees can be the old engine's next seq, or
above it. So the SUB socket is monitored (ZMQ socket monitor): when its connection to the
engine dropped since the last batch, the next batch, whatever its seq, is checked against the
replay socket as in 2. Without a replay socket the check cannot be made: after a dropped
connection a batch that does not follow the last one is taken as a restart (the engine's
connection went away and its seq does not continue: what a restart looks like), the next seq
as the same engine. Batch timestamps cannot tell (wall clock, continuous across a restart),
and the replay buffer's oldest seq cannot either (a running engine's buffer also starts at 0
for its first 10,000 batches): the batch content at a seq both engines reached can.

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
import collections
import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from clients import kvsize
from clients.broker_client import BrokerClient, BrokerError, BrokerQueueFull, WhenFull
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb
from vllm_integration.events_from_vllm.to_intents import DEFAULT_TIER_MAP, EngineTranslator, MappingOptions, format_tier_map, resolve_model
from vllm_integration.events_from_vllm.zmq_events import (
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
    # The first data-parallel rank this bridge serves (vLLM's --data-parallel-start-rank on
    # a node that runs ranks start .. start + dp_size - 1): ports are offset by the rank.
    dp_start_rank: int = 0
    # See vllm_integration.events_from_vllm.to_intents.MappingOptions.
    offload_block_size: int | None = None
    prefill_tokens_per_s: float | None = None
    gpu_reuse_reports: bool = False
    # Every this many seconds: the stats snapshot to on_stats and to stats_file (0: never).
    stats_interval_s: float = 0.0
    stats_file: str | None = None
    # A rank that has received nothing this long is said in a warning (0: never): a bridge
    # pointed at the wrong port, or at a vLLM without --kv-events-config, waited silently.
    quiet_warning_s: float = 30.0

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.dp_start_rank < 0:
            raise ValueError(f"dp_start_rank must be >= 0, got {self.dp_start_rank}")
        WhenFull(self.when_full)
        if self.replay_timeout_s <= 0:
            raise ValueError("replay_timeout_s must be > 0")
        if self.stats_interval_s < 0:
            raise ValueError(f"stats_interval_s must be >= 0, got {self.stats_interval_s}")
        if self.quiet_warning_s < 0:
            raise ValueError(f"quiet_warning_s must be >= 0, got {self.quiet_warning_s}")

    @property
    def ranks(self) -> range:
        return range(self.dp_start_rank, self.dp_start_rank + self.dp_size)

    def mapping(self, rank: int) -> MappingOptions:
        return MappingOptions(
            model=self.model,
            dtype=self.dtype,
            block_bytes=self.block_bytes,
            tier_map=self.tier_map,
            namespace=rank_namespace(rank, self.dp_size),
            tenant=self.tenant,
            offload_block_size=self.offload_block_size,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            gpu_reuse_reports=self.gpu_reuse_reports,
        )


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of data-parallel rank ``rank``, as vLLM 0.33 offsets it
    (ZmqEventPublisher.offset_endpoint_port): tcp port + rank, inproc name + ``_dp<rank>``.
    vLLM refuses any other scheme for a rank above 0 (and leaves port 0 to the OS, which the
    bridge cannot follow)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("ipc://"):
        raise ValueError(f"endpoint {endpoint!r}: vLLM offsets only tcp:// and inproc:// endpoints per data-parallel rank; use tcp://")
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or parts.port is None:
        raise ValueError(f"endpoint {endpoint!r}: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    if parts.port == 0:
        raise ValueError(f"endpoint {endpoint!r}: port 0 is chosen by the OS per rank; give vLLM and the bridge a fixed port")
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
    # The SUB socket's connection to the engine dropped (ZMQ socket monitor).
    disconnects: int = 0
    # Replays that checked the batch at the last applied seq: same engine, or restarted.
    continuity_checks: int = 0
    # Per cause: seq_back, replay_differs (another batch at the last seq), replay_behind
    # (nothing at or after it), reconnect_jump (no replay socket, the seq did not follow).
    restart_causes: dict[str, int] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
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
        self.translator = EngineTranslator(config.mapping(rank), shape)
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
        # The payload of the last batch applied: a replay holding another one at its seq
        # comes from another engine.
        self._last_payload = b""
        # The connection to the engine dropped since the last batch: check the next one.
        self._suspect = False
        self._monitor: zmq.Socket[bytes] | None = None

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
        self._monitor = self._watch(sub)
        sub.connect(self.events_endpoint)
        log.info("rank %d: %s -> broker %s as %s", self.rank, self.events_endpoint, self.config.broker, self.client_id)
        try:
            while True:
                frames = await sub.recv_multipart()
                await self.on_live(frames)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            if self._monitor is not None:
                self._monitor.close(linger=0)
            sub.close(linger=0)

    def _watch(self, sub: zmq.asyncio.Socket) -> zmq.Socket[bytes]:
        """A socket monitor on ``sub``, read synchronously (drained before each batch)."""
        address = f"inproc://kvbroker-vllm-bridge-monitor-{id(self)}"
        sub.monitor(address, zmq.EVENT_DISCONNECTED)
        monitor: zmq.Socket[bytes] = zmq.Context.shadow(self.ctx.underlying).socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(address)
        return monitor

    def _drain_monitor(self) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        while monitor.poll(0):
            event = parse_monitor_message(monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.stats.disconnects += 1
                log.info(
                    "rank %d: the connection to %s dropped; the next batch is checked for an engine restart",
                    self.rank,
                    self.events_endpoint,
                )
                self._suspect = True

    async def on_live(self, frames: list[bytes]) -> None:
        try:
            _topic, seq, payload = split_live(frames)
        except DecodeError as exc:
            self.stats.bad_frames += 1
            log.warning("rank %d: bad message skipped: %s", self.rank, exc)
            return
        self.stats.received += 1
        self._drain_monitor()
        tracker = self.tracker
        verdict = tracker.classify(seq)
        if verdict == SeqTracker.RESTART:
            self._restarted("seq_back", f"seq went back from {tracker.last} to {seq}")
            verdict = tracker.classify(seq)
        if verdict == SeqTracker.DUPLICATE:
            self.stats.duplicates += 1
            return
        suspect, self._suspect = self._suspect, False
        if verdict == SeqTracker.GAP or (suspect and tracker.last >= 0):
            await self._catch_up(seq, suspect)
            if seq <= tracker.last:
                self.stats.duplicates += 1
                return
            if seq > tracker.last + 1:
                missing = seq - tracker.last - 1
                self.stats.lost_batches += missing
                log.warning("rank %d: batches %d..%d lost (not in the replay buffer)", self.rank, tracker.last + 1, seq - 1)
        await self._apply(seq, payload)

    def _restarted(self, cause: str, why: str) -> None:
        log.warning("rank %d: the engine restarted (%s); clearing its blocks", self.rank, why)
        self.stats.restarts += 1
        self.stats.restart_causes[cause] = self.stats.restart_causes.get(cause, 0) + 1
        self.tracker.restarted()
        self._last_payload = b""
        self._suspect = False
        # The clear goes with the first batch of the new engine, as the capture importer does it.
        self._restart_pending = True
        if self.capture is not None:
            self.capture.restarted(self.rank, time.time())

    async def _catch_up(self, until: int, suspect: bool) -> None:
        """Before live seq ``until``: check the engine is the one followed so far and apply
        what it sent that was missed (from its replay socket)."""
        tracker = self.tracker
        if until > tracker.last + 1:
            self.stats.gaps += 1
        if self.replay_endpoint is None:
            if suspect and until != tracker.last + 1:
                self._restarted(
                    "reconnect_jump",
                    f"the connection dropped and seq jumped from {tracker.last} to {until}; "
                    "without a replay socket (--replay) a restart cannot be told from a loss",
                )
            return
        if tracker.last < 0:
            await self._fill(0, check=False)
            return
        last = tracker.last
        cause = await self._fill(last, check=True)
        if cause is not None:
            why = {
                "replay_differs": f"its replay socket holds another batch at seq {last} than the one applied",
                "replay_behind": f"its replay socket holds nothing at or after seq {last}",
            }[cause]
            self._restarted(cause, why)
            await self._fill(0, check=False)

    async def _fill(self, start: int, *, check: bool) -> str | None:
        """Apply what the replay socket holds from ``start`` on. With ``check``, ``start`` is
        the last seq applied and its batch must be the one applied: returns the restart cause
        ("replay_differs", "replay_behind") when it is not, having applied nothing."""
        assert self.replay_endpoint is not None
        self.stats.replay_requests += 1
        if check:
            self.stats.continuity_checks += 1
        log.info("rank %d: replaying from %d", self.rank, start)
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        tracker = self.tracker
        first = check
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
                if first:
                    first = False
                    if seq == END_OF_REPLAY:
                        return "replay_behind"  # nothing at or after our last seq
                    if seq == start:
                        if payload != self._last_payload:
                            return "replay_differs"
                        continue  # the same engine: go on from there
                    log.warning("rank %d: the replay buffer no longer holds seq %d; continuity cannot be checked", self.rank, start)
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
        return None

    async def _apply(self, seq: int, payload: bytes) -> None:
        received = time.time()
        events: list[pb.Event] = []
        batch: EventBatch | None = None
        try:
            batch = decode_batch(payload)
        except DecodeError as exc:
            self.translator.stats.bad_batches += 1
            log.warning("rank %d: batch %d skipped: %s", self.rank, seq, exc)
        if batch is not None:
            if batch.problems:
                log.debug("rank %d: batch %d: %s", self.rank, seq, "; ".join(batch.problems))
            self._note_unknown(batch)
        ts = ts_to_us(batch.ts if batch is not None else None, received)
        if self._restart_pending:
            self._restart_pending = False
            events.extend(self.translator.restart(ts))
        if batch is not None:
            events.extend(self.translator.translate(batch, ts))
        if self.capture is not None:
            self.capture.write(self.rank, seq, received, payload)
        self.tracker.applied(seq)
        self._last_payload = payload
        self.stats.applied += 1
        for event in events:
            # when_full="raise": an event refused is counted by the client (refused_events); go on.
            with contextlib.suppress(BrokerQueueFull):
                await self.client.add(event)

    def _note_unknown(self, batch: EventBatch) -> None:
        """Say once per name what this bridge does not know (counted in the stats)."""
        stats = self.translator.stats
        for key in batch.unknown_keys:
            if key not in stats.unknown_keys:
                log.warning("rank %d: unknown key %r in vLLM's events (a newer vLLM?): skipped, counted in unknown_keys", self.rank, key)
        for kind in batch.unknown_types:
            if kind not in stats.unknown_event_types:
                log.warning("rank %d: unknown event type %r (a newer vLLM?): skipped, counted in unknown_event_types", self.rank, kind)

    # ---- directives ----------------------------------------------------------------------

    def _on_directive(self, directive: dpb.Directive) -> None:
        self.stats.directives_ignored += 1

    def summary(self) -> str:
        """The rank's counters as a person reads them, in one line."""
        s, client = self.stats, self.client
        line = f"rank {self.rank}: {s.received:,} batches received, {s.applied:,} applied, {len(self.translator.held):,} blocks held"
        trouble = {"lost": s.lost_batches, "restarts": s.restarts, "bad frames": s.bad_frames, "disconnects": s.disconnects}
        line += "".join(f", {n:,} {what}" for what, n in trouble.items() if n)
        state = "connected" if client.connected else "NOT connected"
        return f"{line}; broker {state}, {client.unanswered:,} unanswered"

    async def warn_when_quiet(self, after_s: float) -> None:
        """Warn, once, when nothing has come from the engine ``after_s`` seconds after the
        start: what vLLM must run with for the bridge to receive anything."""
        await asyncio.sleep(after_s)
        if self.stats.received == 0:
            log.warning(
                "rank %d: nothing received from %s in %.0f s: is vLLM running with --kv-events-config "
                '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:PORT"%s} (this rank: PORT + %d)? '
                "still waiting",
                self.rank,
                self.events_endpoint,
                after_s,
                f', "topic": "{self.config.topic}"' if self.config.topic else "",
                self.rank,
            )

    def snapshot(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "client_id": self.client_id,
            "events_endpoint": self.events_endpoint,
            "replay_endpoint": self.replay_endpoint,
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
        if self.shape is not None:  # which geometry sizes the blocks, and where it was read
            where = kvsize.model_config_source(config.model) or "the built-in table"
            shape = self.shape
            log.info("model %s: %d layers, %d KV heads of %d, from %s", config.model, shape.layers, shape.kv_heads, shape.head_dim, where)
        self.ctx = zmq.asyncio.Context()
        self.capture: CaptureWriter | None = None
        # Called with the stats snapshot every stats_interval_s.
        self.on_stats: Callable[[dict[str, Any]], None] | None = None
        try:
            self.ranks = [RankBridge(rank, config, self.ctx, self.shape, None) for rank in config.ranks]
        except BaseException:
            self.ctx.destroy(linger=0)
            raise
        if config.capture:
            header = {
                "model": config.model,
                "tier_map": [list(pair) for pair in config.tier_map],
                "client_id": config.client_id,
                "dp_size": config.dp_size,
                "dp_start_rank": config.dp_start_rank,
                "topic": config.topic,
                "dtype": config.dtype,
                "block_bytes": config.block_bytes,
                "tenant": config.tenant,
                "offload_block_size": config.offload_block_size,
                "prefill_tokens_per_s": config.prefill_tokens_per_s,
                "gpu_reuse_reports": config.gpu_reuse_reports,
            }
            self.capture = CaptureWriter(config.capture, header)
            for rank in self.ranks:
                rank.capture = self.capture

    async def run(self, stop: asyncio.Event) -> None:
        """Bridge until ``stop`` is set; then flush (bounded by close_timeout_s) and close.
        Raises BrokerError if the broker refused a client for good."""
        log.info("bridging %d rank(s) to %s; tiers %s", len(self.ranks), self.config.broker, format_tier_map(self.config.tier_map))
        tasks = [asyncio.create_task(rank.run(), name=f"vllm-bridge rank {rank.rank}") for rank in self.ranks]
        reporter = asyncio.create_task(self._report_every())
        if self.config.quiet_warning_s > 0:
            quiet = self.config.quiet_warning_s
            reporter = asyncio.create_task(self._watch(reporter, [rank.warn_when_quiet(quiet) for rank in self.ranks]))
        stopper = asyncio.create_task(stop.wait())
        failure: BaseException | None = None
        try:
            done, _ = await asyncio.wait({*tasks, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                if task in done and task.exception() is not None:
                    failure = task.exception()
        finally:
            stopper.cancel()
            reporter.cancel()
            for task in tasks:
                task.cancel()
            for task in [*tasks, reporter]:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await asyncio.gather(*(self._close_client(rank) for rank in self.ranks), return_exceptions=True)
            if self.capture is not None:
                self.capture.close()
            self.ctx.destroy(linger=0)
            if self.config.stats_file:
                self._write_stats_file()
        if failure is not None:
            if isinstance(failure, BrokerError):
                raise failure
            raise RuntimeError(f"bridge rank failed: {failure}") from failure

    @staticmethod
    async def _close_client(rank: RankBridge) -> None:
        """Deliver what is unanswered within close_timeout_s, if a broker is there to answer:
        with none, waiting only delays the stop (SIGTERM took 5.5 s); what is left is
        counted (abandoned_*) and vLLM's replay buffer has it for the next start."""
        if rank.client.connected:
            await rank.client.close()
            return
        log.warning("rank %d: the broker %s is not connected; stopping without waiting for answers", rank.rank, rank.config.broker)
        await rank.client.close(timeout=0.0)

    @staticmethod
    async def _watch(reporter: asyncio.Task[None], watchers: list[Any]) -> None:
        """The reporter and the quiet watchers as one task, cancelled together at the stop."""
        try:
            await asyncio.gather(reporter, *watchers)
        finally:
            reporter.cancel()

    async def _report_every(self) -> None:
        interval = self.config.stats_interval_s
        if self.config.stats_file:
            self._write_stats_file()  # at once: a readiness probe looks for it
        if interval <= 0:
            return
        while True:
            await asyncio.sleep(interval)
            snapshot = self.snapshot()
            if self.on_stats is not None:
                self.on_stats(snapshot)
            if self.config.stats_file:
                self._write_stats_file(snapshot)

    def _write_stats_file(self, snapshot: dict[str, Any] | None = None) -> None:
        """The snapshot as JSON, replaced atomically (a reader never sees half a file)."""
        path = self.config.stats_file
        assert path is not None
        record = {"time": time.time(), **(snapshot or self.snapshot())}
        temporary = f"{path}.tmp"
        try:
            with open(temporary, "w", encoding="utf-8") as f:
                json.dump(record, f)
            os.replace(temporary, path)
        except OSError as exc:
            log.warning("cannot write the stats file %s: %s", path, exc)

    def snapshot(self) -> dict[str, Any]:
        unknown: collections.Counter[str] = collections.Counter()
        for rank in self.ranks:
            unknown.update(rank.translator.stats.unknown_keys)
        return {
            # First, for a person reading the line: each rank's counters in words.
            "summary": "; ".join(rank.summary() for rank in self.ranks),
            "ranks": [rank.snapshot() for rank in self.ranks],
            "capture_records": self.capture.records if self.capture else 0,
            "unknown_keys": dict(sorted(unknown.items())),
        }
