"""BrokerClient: the async Python client of the broker.

It batches events by count and by time, sends them on one bidirectional stream, hands back
the directives that come back, and acks them. Event time (``ts_us``) is whatever the caller
passes, or microseconds of a monotonic clock since the client started.

    async with BrokerClient("127.0.0.1:50051", "engine-0") as client:
        await client.allocate("blk-1", 2 * 2**20, request_id="req-1")
        await client.access(["blk-1"])
        result = await client.flush()          # the DirectiveBatch of the last batch
        async for directive in client.directives():
            ...                                # carry it out, then:
            await client.ack(directive.directive_id)

**Reconnect and resume.** A stream that breaks is reopened with exponential backoff (a new
channel each attempt, so gRPC's own reconnect backoff never delays the return). The hello
reply's ``last_batch_seq`` says what the broker applied for this client id: unanswered
batches at or below it are resolved as duplicates (applied; their answer was lost) and
never resent; those above it are resent in order with their original ``batch_seq``, so the
broker applies each exactly once. Batches are numbered when first written, so a client
that starts while the broker is down numbers its first batch after what the broker already
has. The last ``retain_batches`` answered batches are kept too: a broker that answered
before its journal write and then crashed restarts with a lower ``last_batch_seq``, and
those batches are sent again. Directives of a batch whose answer was lost are not
redelivered (the broker keeps no directive outbox); ``counters.lost_answers`` counts them.

**Bounded queues.** At most ``max_pending_batches`` batches are unanswered (written or
waiting to be) and the open batch holds at most ``max_batch_events`` events. When full,
``when_full`` decides: ``block`` (the caller awaits room: backpressure), ``drop_oldest``
(the oldest unanswered batch is given up, never resent, counted in ``dropped_batches`` and
``dropped_events``; its ``flush`` result is None), or ``raise`` (``add`` raises
BrokerQueueFull and the event is not taken). Received directives wait in a queue of
``max_directives`` (oldest dropped and counted) unless ``on_directive`` takes them.

**Directives** come by callback (``on_directive``, a function or coroutine function, called
in order by a task of the client's event loop; it may send, e.g. ack) or, without one, from
``directives()`` / ``drain_directives()``.

**Security.** ``security=ClientSecurity(...)`` connects over TLS (``tls_ca``: the CA that
signed the broker's certificate), with a client certificate for mutual TLS (``tls_cert``,
``tls_key``) and a bearer token (``token``). Without it, ``ClientSecurity.from_env()`` reads
``KVBROKER_TLS_CA``, ``KVBROKER_TLS_CERT``, ``KVBROKER_TLS_KEY``, ``KVBROKER_TLS_SERVER_NAME``
and ``KVBROKER_TOKEN`` (or ``KVBROKER_TOKEN_FILE``), so sidecars are configured by their
environment. A refusal (UNAUTHENTICATED, PERMISSION_DENIED) is final: no retry.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import inspect
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from types import TracebackType
from typing import Any

import grpc

from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb

log = logging.getLogger("kvbroker.client")

SCHEMA_MAJOR = 1
SCHEMA_MINOR = 0
STREAM_METHOD = "/kvbroker.v1.BrokerService/Stream"
MAX_MESSAGE_BYTES = 64 * 2**20
# Refusals that are retried are logged at most this often.
LOG_EVERY_S = 5.0
# IntentBatch.batch_seq is a uint64: the last number a client id can use.
MAX_BATCH_SEQ = 2**64 - 1

# Refusals that a retry cannot fix: the broker does not serve us.
_PERMANENT = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)

DirectiveCallback = Callable[[dpb.Directive], Awaitable[None] | None]


class BrokerError(Exception):
    """The broker refused the stream, or the client was closed or failed for good."""


@dataclasses.dataclass(frozen=True)
class ClientSecurity:
    """How to reach a broker that serves TLS or wants a bearer token. Paths are PEM files.
    The token is never logged (it is left out of ``repr``)."""

    # CA bundle the broker's certificate must chain to; turns TLS on.
    tls_ca: str = ""
    # Client certificate and key, for a broker with mutual TLS (security.tls_client_ca).
    tls_cert: str = ""
    tls_key: str = ""
    # TLS with the system's CAs, when tls_ca is not given.
    tls: bool = False
    # The name the broker's certificate is checked for, when not the target's host.
    server_name: str = ""
    token: str = dataclasses.field(default="", repr=False)

    @classmethod
    def from_env(cls, environ: Any = None) -> ClientSecurity:
        """From KVBROKER_TLS_CA, KVBROKER_TLS_CERT, KVBROKER_TLS_KEY, KVBROKER_TLS_SERVER_NAME
        and KVBROKER_TOKEN or KVBROKER_TOKEN_FILE (unset: plaintext, no token)."""
        env = os.environ if environ is None else environ
        token = env.get("KVBROKER_TOKEN", "")
        if not token and env.get("KVBROKER_TOKEN_FILE"):
            token = read_token(env["KVBROKER_TOKEN_FILE"])
        return cls(
            tls_ca=env.get("KVBROKER_TLS_CA", ""),
            tls_cert=env.get("KVBROKER_TLS_CERT", ""),
            tls_key=env.get("KVBROKER_TLS_KEY", ""),
            server_name=env.get("KVBROKER_TLS_SERVER_NAME", ""),
            token=token,
        )

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls or self.tls_ca or self.tls_cert)

    def credentials(self) -> grpc.ChannelCredentials | None:
        """Channel credentials for TLS, or None for plaintext. Raises ValueError naming the
        file that cannot be read."""
        if not self.uses_tls:
            return None
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key: give both (mutual TLS) or neither")
        check_pem(self)
        return grpc.ssl_channel_credentials(
            root_certificates=_read_pem(self.tls_ca, "tls_ca") if self.tls_ca else None,
            private_key=_read_pem(self.tls_key, "tls_key") if self.tls_key else None,
            certificate_chain=_read_pem(self.tls_cert, "tls_cert") if self.tls_cert else None,
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name and self.uses_tls else []

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the bearer token, if any (sent on plaintext channels too, e.g. to
        a broker on loopback; use TLS anywhere else)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def aio_channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        creds = self.credentials()
        opts = [*options, *self.channel_options()]
        if creds is None:
            return grpc.aio.insecure_channel(target, options=opts)
        return grpc.aio.secure_channel(target, creds, options=opts)

    def channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A synchronous channel (tools: clients.admin)."""
        creds = self.credentials()
        opts = [*options, *self.channel_options()]
        if creds is None:
            return grpc.insecure_channel(target, options=opts)
        return grpc.secure_channel(target, creds, options=opts)


def read_token(path: str) -> str:
    """A bearer token from a file (its first line; surrounding whitespace dropped)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().strip()
    except OSError as exc:
        raise ValueError(f"token file {path}: cannot read it: {exc.strerror or exc}") from exc


def _read_pem(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{what} {path}: cannot read it: {exc.strerror or exc}") from exc


def check_pem(security: ClientSecurity, names: dict[str, str] | None = None) -> None:
    """Raise ValueError, one line naming the file, unless the CA bundle, the client
    certificate and its key are PEM that OpenSSL takes (and the key is the certificate's).

    gRPC takes any bytes as a certificate and only fails at the handshake, with lines of its
    own on stderr and the call ending as "cannot reach": a bad file said as what it is.
    ``names`` maps tls_ca, tls_cert, tls_key to what the caller calls them (a flag)."""
    import ssl

    called = {"tls_ca": "tls_ca", "tls_cert": "tls_cert", "tls_key": "tls_key", **(names or {})}
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if security.tls_ca:
        _read_pem(security.tls_ca, called["tls_ca"])  # a missing file said as that
        try:
            context.load_verify_locations(cafile=security.tls_ca)
        except (ssl.SSLError, ValueError) as exc:
            why = getattr(exc, "reason", None) or str(exc)
            raise ValueError(f"{called['tls_ca']} {security.tls_ca}: not a PEM CA certificate ({why})") from None
    if security.tls_cert and security.tls_key:
        _read_pem(security.tls_cert, called["tls_cert"])
        _read_pem(security.tls_key, called["tls_key"])
        try:
            context.load_cert_chain(security.tls_cert, security.tls_key)
        except (ssl.SSLError, ValueError) as exc:
            why = getattr(exc, "reason", None) or str(exc)
            raise ValueError(
                f"{called['tls_cert']} {security.tls_cert} and {called['tls_key']} {security.tls_key}: "
                f"not a PEM certificate and its private key ({why})"
            ) from None


class BrokerQueueFull(BrokerError):
    """``when_full="raise"``: the event was not taken; the unanswered batches are at the bound."""


class WhenFull(enum.StrEnum):
    BLOCK = "block"
    DROP_OLDEST = "drop_oldest"
    RAISE = "raise"


@dataclasses.dataclass
class ClientCounters:
    """What the client did; all monotonic. Read them any time (``as_dict`` for a snapshot)."""

    batches_sent: int = 0
    batches_answered: int = 0
    # Batches written again after a reconnect (unanswered ones, and answered ones the broker lost).
    resent_batches: int = 0
    # Batches the broker had applied but whose answer was lost with the stream.
    lost_answers: int = 0
    # Batches the broker lost that were no longer retained (see retain_batches): not resent.
    unrecoverable_batches: int = 0
    duplicate_answers: int = 0
    unmatched_answers: int = 0
    rejected_events: int = 0
    # Batches the broker refused whole (not applied): every one, then how each ended.
    refused_batches: int = 0
    # ... resent with the same batch_seq after a backoff (UNAVAILABLE: journal spool full;
    # batch_seq: an earlier batch was refused, so this one came too early).
    retried_batches: int = 0
    # ... given up and reported (flush raises BrokerError naming them): a refusal no resend
    # can fix (a batch over the broker's limits, another tenant's, malformed).
    failed_batches: int = 0
    dropped_batches: int = 0
    dropped_events: int = 0
    refused_events: int = 0
    directives: int = 0
    dropped_directives: int = 0
    connects: int = 0
    connect_failures: int = 0
    disconnects: int = 0
    # Batches and buffered events given up by close() when the broker did not come back in time.
    abandoned_batches: int = 0
    abandoned_events: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


# ---- event builders (shared with the sync facade and the hooks) --------------------------------


def allocated_event(block_id: str, size_bytes: int, ts_us: int, *, tier: str = "", reuse: bool = False, **intent: Any) -> pb.Event:
    """``intent`` takes MemoryIntent field names."""
    mi = pb.MemoryIntent(block_id=block_id, size_bytes=size_bytes, **intent)
    return pb.Event(ts_us=ts_us, allocated=pb.BlockAllocated(intent=mi, tier=tier, reuse=reuse))


def accessed_event(block_ids: Iterable[str], ts_us: int, *, next_use_us: int | None = None) -> pb.Event:
    accessed = pb.BlocksAccessed(block_ids=block_ids)
    if next_use_us is not None:
        accessed.next_use_us = next_use_us
    return pb.Event(ts_us=ts_us, accessed=accessed)


def updated_event(block_id: str, ts_us: int, **changes: Any) -> pb.Event:
    """``changes`` takes IntentUpdated field names."""
    return pb.Event(ts_us=ts_us, intent_updated=pb.IntentUpdated(block_id=block_id, **changes))


def released_event(block_ids: Iterable[str], ts_us: int) -> pb.Event:
    return pb.Event(ts_us=ts_us, released=pb.BlocksReleased(block_ids=block_ids))


def freed_event(block_ids: Iterable[str], ts_us: int) -> pb.Event:
    return pb.Event(ts_us=ts_us, freed=pb.BlocksFreed(block_ids=block_ids))


def cleared_event(ts_us: int) -> pb.Event:
    return pb.Event(ts_us=ts_us, cleared=pb.AllBlocksCleared())


def acked_event(directive_id: int, ts_us: int, *, failed: bool = False, actual_tier: str = "", error: str = "") -> pb.Event:
    status = pb.ACK_STATUS_FAILED if failed else pb.ACK_STATUS_DONE
    acked = pb.DirectiveAcked(directive_id=directive_id, status=status, actual_tier=actual_tier, error=error)
    return pb.Event(ts_us=ts_us, acked=acked)


# ---- the client --------------------------------------------------------------------------------


class _Batch:
    """One batch from sealing to its answer. ``seq`` is 0 until it is first written."""

    __slots__ = ("events", "future", "message", "seq")

    def __init__(self, events: list[pb.Event], future: asyncio.Future[dpb.DirectiveBatch | None]) -> None:
        self.events = events
        self.future = future
        self.seq = 0
        self.message: pb.IntentBatch | None = None


class _Refused(Exception):
    """The broker will not serve this client (a retry cannot fix it)."""


class _Conn:
    def __init__(self, channel: grpc.aio.Channel, call: Any, reply: spb.HelloReply) -> None:
        self.channel = channel
        self.call = call
        self.reply = reply


class BrokerClient:
    def __init__(
        self,
        target: str,
        client_id: str,
        *,
        tenant: str = "",
        max_batch_events: int = 256,
        max_delay_s: float = 0.002,
        schema_major: int = SCHEMA_MAJOR,
        reconnect: bool = True,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 2.0,
        connect_timeout_s: float = 5.0,
        max_pending_batches: int = 1024,
        when_full: WhenFull | str = WhenFull.BLOCK,
        retain_batches: int = 1024,
        max_directives: int = 65536,
        on_directive: DirectiveCallback | None = None,
        close_timeout_s: float | None = 30.0,
        channel_options: Sequence[tuple[str, Any]] = (),
        security: ClientSecurity | None = None,
    ) -> None:
        """``security``: TLS and bearer token (default: ``ClientSecurity.from_env()``)."""
        if max_batch_events <= 0:
            raise ValueError("max_batch_events must be > 0")
        if max_pending_batches <= 0:
            raise ValueError("max_pending_batches must be > 0")
        if retain_batches < 0 or max_directives <= 0:
            raise ValueError("retain_batches must be >= 0 and max_directives > 0")
        if backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s:
            raise ValueError("backoff: need 0 < backoff_initial_s <= backoff_max_s")
        self.target = target
        self.client_id = client_id
        self.tenant = tenant
        self.security = security if security is not None else ClientSecurity.from_env()
        self.max_batch_events = max_batch_events
        self.max_delay_s = max_delay_s
        self.schema_major = schema_major
        self.reconnect = reconnect
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.connect_timeout_s = connect_timeout_s
        self.max_pending_batches = max_pending_batches
        self.when_full = WhenFull(when_full)
        self.on_directive = on_directive
        self.close_timeout_s = close_timeout_s
        self.channel_options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            *channel_options,
        ]
        self.hello_reply: spb.HelloReply | None = None
        # Permanent refusals since the last flush(), which raises them (then they are cleared).
        self.refusals: list[str] = []
        # Set by the reader when the stream must be reopened to resend refused batches; the
        # wait doubles while the broker keeps refusing (a long Redis outage), up to backoff_max_s.
        self._resync_after: float | None = None
        self._refusal_backoff = backoff_initial_s
        self._last_refusal_log = -LOG_EVERY_S
        # Rejected events (not applied) are said in a log line, the first at once, then at
        # most one line per LOG_EVERY_S with the count since: a counter alone goes unseen.
        self._last_rejection_log = -LOG_EVERY_S
        self._rejections_unsaid = 0
        # Highest batch_seq given to a batch (or reported applied by the broker).
        self.batch_seq = 0
        self.counters = ClientCounters()
        self.results: list[dpb.DirectiveBatch] = []
        self.keep_results = False
        self._t0 = time.monotonic_ns()
        self._events: list[pb.Event] = []
        self._first_event_at = 0.0
        self._unsent: collections.deque[_Batch] = collections.deque()
        self._inflight: dict[int, _Batch] = {}
        self._retained: collections.deque[pb.IntentBatch] = collections.deque(maxlen=retain_batches or None)
        self._retain = retain_batches
        self._directives: collections.deque[dpb.Directive] = collections.deque()
        self._max_directives = max_directives
        self._directive_ready = asyncio.Event()
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._connected = asyncio.Event()
        self._conn: _Conn | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._closing = False
        self._closed = False
        self._error: BaseException | None = None
        self._stop_backoff = asyncio.Event()

    # ---- lifecycle -----------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._conn is not None

    @property
    def failed(self) -> BaseException | None:
        """Why the client stopped for good (refused, or reconnect off and the stream broke)."""
        return self._error

    async def connect(self) -> spb.HelloReply:
        """Open the stream and exchange hellos; raises BrokerError if this first attempt
        fails. Afterwards a broken stream is reopened in the background (``reconnect``)."""
        self._check_open()
        if self._supervisor is not None:
            raise BrokerError("already connected or connecting (connect or start, once)")
        try:
            conn = await self._open()
        except _Refused as exc:
            raise BrokerError(str(exc)) from None
        except (grpc.aio.AioRpcError, TimeoutError, OSError) as exc:
            raise BrokerError(_describe(exc)) from exc
        self._adopt(conn)
        self._start_tasks(conn)
        assert self.hello_reply is not None
        return self.hello_reply

    def start(self) -> None:
        """Connect in the background, retrying with backoff; events are buffered meanwhile
        (within the bounds). Never waits for the broker."""
        self._check_open()
        self._start_tasks(None)

    async def wait_connected(self, timeout: float | None = None) -> bool:
        """True once a stream is up (now or within ``timeout`` seconds)."""
        if self._conn is not None:
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._connected.wait(), timeout)
        return self._conn is not None

    def _start_tasks(self, conn: _Conn | None) -> None:
        loop = asyncio.get_running_loop()
        if self._supervisor is None:
            self._supervisor = loop.create_task(self._supervise(conn), name=f"kvbroker-client {self.client_id}")
        if self._ticker is None:
            self._ticker = loop.create_task(self._tick_loop())
        if self.on_directive is not None and self._dispatcher is None:
            self._dispatcher = loop.create_task(self._dispatch())

    async def close(self, timeout: float | None = None) -> None:
        """Send what is buffered, wait for its answers (at most ``timeout``, default
        ``close_timeout_s``), and close the stream. What could not be delivered in time is
        counted in ``abandoned_*`` and logged."""
        if self._closed:
            return
        if self._supervisor is None:
            self._closed = True
            return
        limit = self.close_timeout_s if timeout is None else timeout
        # Nothing buffered or unanswered: nothing to wait for (a wait of 0 s, as
        # SyncBrokerClient.close gives after its own flush, would time out even so).
        if self._error is None and (self._events or self._unsent or self._inflight):
            try:
                await asyncio.wait_for(self.flush(), limit)
            except (TimeoutError, BrokerError) as exc:
                log.warning("client %s: closing without every answer (%s)", self.client_id, _describe(exc))
        self._closing = True
        self._wake.set()
        self._stop_backoff.set()
        for task in (self._ticker, self._dispatcher):
            if task is not None:
                task.cancel()
        try:
            # The stream's last answers were flushed above; a connect attempt may be under way.
            await asyncio.wait_for(asyncio.shield(self._supervisor), 2.0 if limit is None else max(0.1, min(2.0, limit)))
        except (TimeoutError, asyncio.CancelledError, Exception):
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._supervisor
        await self._drop_conn()
        left = list(self._unsent) + list(self._inflight.values())
        if left or self._events:
            self.counters.abandoned_batches += len(left)
            self.counters.abandoned_events += sum(len(b.events) for b in left) + len(self._events)
            log.warning("client %s closed with %d unanswered batches and %d buffered events", self.client_id, len(left), len(self._events))
        for batch in left:
            if not batch.future.done():
                batch.future.set_exception(BrokerError("client closed before the broker answered"))
                batch.future.exception()  # retrieved: nobody may be waiting
        self._unsent.clear()
        self._inflight.clear()
        self._events = []
        self._closed = True
        self._directive_ready.set()
        self._room.set()

    async def __aenter__(self) -> BrokerClient:
        await self.connect()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise BrokerError("client is closed")

    def _check_usable(self) -> None:
        self._check_open()
        if self._error is not None:
            raise BrokerError(f"stream failed: {_describe(self._error)}")

    # ---- events --------------------------------------------------------------------------

    def now_us(self) -> int:
        return (time.monotonic_ns() - self._t0) // 1000

    @property
    def batch_limit(self) -> int:
        """Events per batch: ``max_batch_events``, or the broker's limit if lower (learned
        from the hello reply, so the broker never refuses a batch for its size)."""
        reply = self.hello_reply
        broker = reply.max_events_per_batch if reply is not None else 0
        return min(self.max_batch_events, broker) if broker else self.max_batch_events

    async def add(self, event: pb.Event) -> None:
        """Buffer one event; seals the batch when it is full (``when_full`` applies)."""
        self._check_usable()
        limit = self.batch_limit
        if len(self._events) >= limit:
            # A full batch that could not be sealed before (no room): this is where we wait or refuse.
            try:
                await self._seal(wait=True)
            except BrokerQueueFull:
                self.counters.refused_events += 1
                raise
        if not self._events:
            self._first_event_at = time.monotonic()
        self._events.append(event)
        if len(self._events) >= limit:
            with contextlib.suppress(BrokerQueueFull):  # the event is taken; the batch waits
                await self._seal(wait=True)

    async def allocate(self, block_id: str, size_bytes: int, *, ts_us: int | None = None, tier: str = "", **intent: Any) -> None:
        """Allocate a block; ``intent`` takes MemoryIntent field names."""
        await self.add(allocated_event(block_id, size_bytes, self._ts(ts_us), tier=tier, **intent))

    async def access(self, block_ids: Iterable[str], *, ts_us: int | None = None, next_use_us: int | None = None) -> None:
        await self.add(accessed_event(block_ids, self._ts(ts_us), next_use_us=next_use_us))

    async def update(self, block_id: str, *, ts_us: int | None = None, **changes: Any) -> None:
        """Change intent; ``changes`` takes IntentUpdated field names."""
        await self.add(updated_event(block_id, self._ts(ts_us), **changes))

    async def release(self, block_ids: Iterable[str], *, ts_us: int | None = None) -> None:
        await self.add(released_event(block_ids, self._ts(ts_us)))

    async def free(self, block_ids: Iterable[str], *, ts_us: int | None = None) -> None:
        await self.add(freed_event(block_ids, self._ts(ts_us)))

    async def clear(self, *, ts_us: int | None = None) -> None:
        await self.add(cleared_event(self._ts(ts_us)))

    async def ack(
        self, directive_id: int, *, failed: bool = False, actual_tier: str = "", error: str = "", ts_us: int | None = None
    ) -> None:
        """Report a directive done, or failed with the tier the block really is in."""
        await self.add(acked_event(directive_id, self._ts(ts_us), failed=failed, actual_tier=actual_tier, error=error))

    def _ts(self, ts_us: int | None) -> int:
        return self.now_us() if ts_us is None else ts_us

    # ---- batches and bounds --------------------------------------------------------------

    @property
    def unanswered(self) -> int:
        """Batches sealed and not yet answered (written or waiting to be)."""
        return len(self._unsent) + len(self._inflight)

    @property
    def buffered_events(self) -> int:
        return len(self._events)

    async def _seal(self, *, wait: bool, flushing: bool = False) -> bool:
        """Turn the buffered events into a batch to send; False if there was no room (and
        ``wait`` was False or the policy is not to wait). ``flushing``: the caller asked to
        wait, so ``raise`` waits for room like ``block``."""
        if not self._events:
            return True
        while self.unanswered >= self.max_pending_batches:
            if self.when_full is WhenFull.DROP_OLDEST:
                self._drop_oldest()
            elif self.when_full is WhenFull.RAISE and not flushing:
                if wait:
                    raise BrokerQueueFull(f"{self.unanswered} batches unanswered (max_pending_batches {self.max_pending_batches})")
                return False
            else:
                if not wait:
                    return False
                self._room.clear()
                await self._room.wait()
                self._check_usable()
            if not self._events:  # another waiter sealed them meanwhile
                return True
        limit = self.batch_limit
        events, self._events = self._events[:limit], self._events[limit:]
        self._unsent.append(_Batch(events, asyncio.get_running_loop().create_future()))
        if self._events:  # more than the broker takes in one batch (its limit was learned late)
            return await self._seal(wait=wait, flushing=flushing)
        self._wake.set()
        return True

    def _drop_oldest(self) -> None:
        if self._unsent:
            batch = self._unsent.popleft()
        else:
            seq = next(iter(self._inflight))
            batch = self._inflight.pop(seq)
        self.counters.dropped_batches += 1
        self.counters.dropped_events += len(batch.events)
        if not batch.future.done():
            batch.future.set_result(None)

    def _answered(self) -> None:
        self._room.set()

    async def flush(self, timeout: float | None = None) -> dpb.DirectiveBatch | None:
        """Send the buffered events and wait for every answer outstanding; returns the answer
        to the newest batch (None if nothing was outstanding or it was dropped)."""
        if timeout is not None:
            return await asyncio.wait_for(self.flush(), timeout)
        self._check_usable()
        await self._seal(wait=True, flushing=True)
        # Oldest first: written batches, then those waiting to be.
        waiting = [b.future for b in (*self._inflight.values(), *self._unsent)]
        if waiting:
            # asyncio.wait never cancels what it waits for, so a flush cut short by its timeout
            # leaves the batches alone. (A shield per future did too, but a shield outlived its
            # flush and took the batch's later error, which nobody then read: "Future exception
            # was never retrieved" after a TimeoutError when the broker was down.)
            await asyncio.wait(waiting)
        self._raise_refusals()
        if not waiting:
            return None
        for future in waiting:
            if future.exception() is not None:
                raise BrokerError(f"stream failed: {_describe(future.exception())}")
        return waiting[-1].result()

    def _raise_refusals(self) -> None:
        """Every batch the broker refused for good since the last flush, as one BrokerError."""
        if self.refusals:
            refusals, self.refusals = self.refusals, []
            raise BrokerError(f"{len(refusals)} batches refused by the broker and not applied: " + "; ".join(refusals[:5]))

    async def _tick_loop(self) -> None:
        """Seal a partly filled batch once its oldest event waited ``max_delay_s``."""
        while True:
            await asyncio.sleep(self.max_delay_s)
            if self._events and time.monotonic() - self._first_event_at >= self.max_delay_s:
                with contextlib.suppress(BrokerError):
                    await self._seal(wait=False)

    # ---- connection ----------------------------------------------------------------------

    async def _open(self) -> _Conn:
        """A new channel and stream, hellos exchanged. Raises _Refused or a transport error."""
        channel = self.security.aio_channel(self.target, self.channel_options)
        try:
            stream = channel.stream_stream(
                STREAM_METHOD,
                request_serializer=spb.StreamRequest.SerializeToString,
                response_deserializer=spb.StreamResponse.FromString,
            )
            call = stream(metadata=self.security.metadata())
            hello = spb.Hello(schema_major=self.schema_major, schema_minor=SCHEMA_MINOR, client_id=self.client_id, tenant=self.tenant)

            async def exchange() -> Any:
                await call.write(spb.StreamRequest(hello=hello))
                return await call.read()

            try:
                first = await asyncio.wait_for(exchange(), self.connect_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _PERMANENT:
                    raise _Refused(f"{exc.code().name}: {exc.details()}") from None
                raise
            if first is grpc.aio.EOF or first.WhichOneof("kind") != "hello":
                code = await call.code()
                details = await call.details()
                if code in _PERMANENT:
                    raise _Refused(f"{code.name}: {details}")
                raise ConnectionError(f"{code.name}: {details}")
        except BaseException:
            await channel.close()
            raise
        return _Conn(channel, call, first.hello)

    def _adopt(self, conn: _Conn) -> list[pb.IntentBatch]:
        """Take a fresh stream: reconcile with what the broker applied; returns the batches
        to write again before anything new, in seq order."""
        reply = conn.reply
        self.hello_reply = reply
        self._conn = conn
        self.counters.connects += 1
        applied = reply.last_batch_seq
        highest = self.batch_seq
        if applied > highest:
            if highest:
                log.warning("client %s: broker reports batch %d applied, beyond our %d", self.client_id, applied, highest)
            self.batch_seq = applied
        resend = [m for m in self._retained if m.batch_seq > applied]
        for seq in list(self._inflight):
            if seq <= applied:
                # Applied before the stream broke; its answer was lost with it.
                batch = self._inflight.pop(seq)
                self.counters.lost_answers += 1
                if batch.message is not None and self._retain:
                    self._retained.append(batch.message)
                if not batch.future.done():
                    batch.future.set_result(dpb.DirectiveBatch(client_id=self.client_id, batch_seq=seq, duplicate=True))
        known = [m.batch_seq for m in resend] + list(self._inflight)
        if highest > applied:
            lowest = min(known, default=highest + 1)
            if lowest > applied + 1:
                missing = lowest - applied - 1
                self.counters.unrecoverable_batches += missing
                log.error(
                    "client %s: the broker lost batches %d..%d, which are no longer retained (retain_batches %d)",
                    self.client_id,
                    applied + 1,
                    lowest - 1,
                    self._retain,
                )
        resend.extend(b.message for b in self._inflight.values() if b.message is not None)
        resend.sort(key=lambda m: m.batch_seq)
        if (resend and resend[-1].batch_seq - resend[0].batch_seq + 1 != len(resend)) or (resend and resend[0].batch_seq != applied + 1):
            self._renumber(resend, applied)
        self._connected.set()
        self._answered()
        return resend

    def _renumber(self, resend: list[pb.IntentBatch], applied: int) -> None:
        """Number the batches to resend from ``applied + 1`` on, in their order: a batch
        given up (refused for good, or lost by the broker and no longer retained) leaves a
        hole the broker would refuse every later batch_seq for (limits.max_batch_seq_gap).
        None of them was applied (each is above ``applied``), so a new number is safe."""
        inflight = {id(b.message): b for b in self._inflight.values() if b.message is not None}
        self._inflight = {}
        for i, message in enumerate(resend):
            message.batch_seq = applied + 1 + i
            batch = inflight.get(id(message))
            if batch is not None:
                batch.seq = message.batch_seq
                self._inflight[batch.seq] = batch
        log.warning(
            "client %s: renumbered %d batches to resend from batch_seq %d (a refused or lost batch left a hole)",
            self.client_id,
            len(resend),
            applied + 1,
        )
        self.batch_seq = applied + len(resend)

    async def _drop_conn(self) -> None:
        conn, self._conn = self._conn, None
        self._connected.clear()
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.call.cancel()
            with contextlib.suppress(Exception):
                await conn.channel.close()

    async def _supervise(self, first: _Conn | None) -> None:
        """Keep one stream up until closed: open, run, and reopen with backoff."""
        conn = first
        resend: list[pb.IntentBatch] = []
        backoff = self.backoff_initial_s
        failing_since: float | None = None  # when the broker stopped answering connects
        try:
            while not self._closing:
                if conn is None:
                    try:
                        conn = await self._open()
                    except _Refused as exc:
                        self._fail(BrokerError(str(exc)))
                        return
                    except ValueError as exc:  # a certificate or key file that cannot be read: no retry mends it
                        self.counters.connect_failures += 1
                        self._fail(BrokerError(f"cannot connect to {self.target}: {exc}"))
                        return
                    except (grpc.aio.AioRpcError, TimeoutError, OSError, ConnectionError) as exc:
                        self.counters.connect_failures += 1
                        if failing_since is None:
                            # A change of state, said once; the retries after it are counted
                            # (connect_failures) and logged at debug only, until it connects.
                            failing_since = time.monotonic()
                            log.warning(
                                "client %s: cannot reach %s (%s); retrying every %.2f..%.1fs, events buffered meanwhile",
                                self.client_id,
                                self.target,
                                _describe(exc),
                                self.backoff_initial_s,
                                self.backoff_max_s,
                            )
                        else:
                            log.debug("client %s: connect failed (%s); retrying in %.2fs", self.client_id, _describe(exc), backoff)
                        await self._sleep(backoff * random.uniform(0.8, 1.2))
                        backoff = min(backoff * 2, self.backoff_max_s)
                        continue
                    backoff = self.backoff_initial_s
                    resend = self._adopt(conn)
                    if failing_since is not None:
                        log.info(
                            "client %s: connected to %s after %.1fs unreachable (%d attempts failed in all)",
                            self.client_id,
                            self.target,
                            time.monotonic() - failing_since,
                            self.counters.connect_failures,
                        )
                        failing_since = None
                    if self.counters.connects > 1:
                        log.info(
                            "client %s: reconnected to %s (broker applied up to %d; resending %d)",
                            self.client_id,
                            self.target,
                            conn.reply.last_batch_seq,
                            len(resend),
                        )
                try:
                    ended = await self._run(conn, resend)
                except _Refused as exc:
                    self._fail(BrokerError(str(exc)))
                    return
                resend = []
                conn = None
                await self._drop_conn()
                if self._closing:
                    return
                self.counters.disconnects += 1
                if self._resync_after is not None:
                    # Refused batches to resend: a new stream, whatever ``reconnect`` says.
                    await self._sleep(self._resync_after * random.uniform(0.8, 1.2))
                    self._resync_after = None
                    continue
                if not self.reconnect:
                    self._fail(BrokerError(f"stream ended: {ended}"))
                    return
                log.warning("client %s: stream to %s broke (%s); reconnecting", self.client_id, self.target, ended)
        finally:
            await self._drop_conn()

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop_backoff.wait(), seconds)

    async def _run(self, conn: _Conn, resend: list[pb.IntentBatch]) -> str:
        """Write and read on one stream until it ends; returns why it ended."""
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read(conn))
        writer = loop.create_task(self._write(conn, resend))
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if writer in done and writer.exception() is None and reader not in done:
                # The writer finished cleanly (closing): the reader drains the last answers.
                await reader
            task = reader if reader.done() else writer
            exc = task.exception()
            if isinstance(exc, _Refused):
                raise exc
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and _too_large(exc):
                # Sending the same batch again would fail the same way: stop.
                raise _Refused(_describe(exc))
            return _describe(exc) if exc is not None else "end of stream"
        finally:
            for task in (reader, writer):
                task.cancel()
            for task in (reader, writer):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _write(self, conn: _Conn, resend: list[pb.IntentBatch]) -> None:
        call = conn.call
        for message in resend:
            self.counters.resent_batches += 1
            await call.write(spb.StreamRequest(batch=message))
        while True:
            self._wake.clear()
            while self._unsent:
                batch = self._unsent.popleft()
                if batch.message is None:
                    if self.batch_seq >= MAX_BATCH_SEQ:
                        self._unsent.appendleft(batch)
                        raise _Refused(
                            f"batch_seq {self.batch_seq} is the last a uint64 holds: client id {self.client_id!r} "
                            "cannot number another batch (use a new client_id)"
                        )
                    self.batch_seq += 1
                    batch.seq = self.batch_seq
                    batch.message = pb.IntentBatch(client_id=self.client_id, batch_seq=batch.seq, events=batch.events)
                self._inflight[batch.seq] = batch
                self.counters.batches_sent += 1
                await call.write(spb.StreamRequest(batch=batch.message))
            if self._closing:
                await call.done_writing()
                return
            await self._wake.wait()

    async def _read(self, conn: _Conn) -> None:
        call = conn.call
        # read() rather than ``async for``: grpc.aio forbids mixing the two on one call,
        # and the hello was taken with read().
        while (response := await call.read()) is not grpc.aio.EOF:
            result = response.directives
            if result.batch_seq:
                batch = self._inflight.pop(result.batch_seq, None)
            else:  # a batch-level error without a seq answers the oldest
                batch = self._inflight.pop(next(iter(self._inflight)), None) if self._inflight else None
            refusal = _batch_refusal(result)
            if refusal is not None and batch is not None:
                if self._refused(batch, refusal):
                    return  # reopen the stream and resend from here, after a backoff
                continue
            if batch is None:
                self.counters.unmatched_answers += 1
            else:
                self._refusal_backoff = self.backoff_initial_s
                self.counters.batches_answered += 1
                if batch.message is not None and self._retain:
                    self._retained.append(batch.message)
                if not batch.future.done():
                    batch.future.set_result(result)
                self._answered()
            if result.duplicate:
                self.counters.duplicate_answers += 1
            if result.rejections:
                self._note_rejections(result)
            if self.keep_results:
                self.results.append(result)
            for directive in result.directives:
                self._deliver(directive)

    def _note_rejections(self, result: dpb.DirectiveBatch) -> None:
        """Count the events the broker rejected (it applied the rest of the batch) and say so."""
        count = len(result.rejections)
        self.counters.rejected_events += count
        self._rejections_unsaid += count
        now = time.monotonic()
        if now - self._last_rejection_log < LOG_EVERY_S:
            return
        self._last_rejection_log = now
        first = result.rejections[0]
        log.warning(
            "client %s: the broker rejected %d event(s), not applied (%d in all, counted in rejected_events), "
            "e.g. batch %d event %d: %s: %s",
            self.client_id,
            self._rejections_unsaid,
            self.counters.rejected_events,
            result.batch_seq,
            first.event_index,
            first.field or "event",
            first.reason,
        )
        self._rejections_unsaid = 0

    def _refused(self, batch: _Batch, refusal: dpb.EventRejection) -> bool:
        """A batch refused whole: True to resend it (and every later one) on a new stream,
        False when it is given up (its future fails; flush() raises it)."""
        self.counters.refused_batches += 1
        what = f"batch {batch.seq}: {refusal.code} {refusal.field}: {refusal.reason}"
        if refusal.code == "UNAVAILABLE" or refusal.field == "batch_seq":
            # Not applied, and neither is any later batch (they are refused as out of order
            # until this one is in): resend from here with the same numbers.
            self.counters.retried_batches += 1
            self._inflight[batch.seq] = batch
            self._inflight = dict(sorted(self._inflight.items()))
            wait = 0.0
            if refusal.code == "UNAVAILABLE":
                wait = self._refusal_backoff
                self._refusal_backoff = min(wait * 2, self.backoff_max_s)
            now = time.monotonic()
            if now - self._last_refusal_log >= LOG_EVERY_S:  # a long outage logs every few seconds, not per retry
                self._last_refusal_log = now
                log.warning(
                    "client %s: %s; resending in %.2fs (%d refusals so far)", self.client_id, what, wait, self.counters.refused_batches
                )
            self._resync_after = wait
            return True
        self.counters.failed_batches += 1
        self.refusals.append(what)
        log.error("client %s: %s; the batch is not applied and not resent", self.client_id, what)
        if not batch.future.done():
            batch.future.set_exception(BrokerError(f"refused by the broker: {what}"))
            batch.future.exception()  # retrieved here: flush() reports it through refusals
        self._answered()
        return False

    def _deliver(self, directive: dpb.Directive) -> None:
        self.counters.directives += 1
        if len(self._directives) >= self._max_directives:
            self._directives.popleft()
            self.counters.dropped_directives += 1
        self._directives.append(directive)
        self._directive_ready.set()

    def _fail(self, exc: BaseException) -> None:
        """Stop for good: every waiter learns why."""
        if self._error is None:
            self._error = exc
            log.error("client %s: %s", self.client_id, _describe(exc))
        for batch in (*self._unsent, *self._inflight.values()):
            if not batch.future.done():
                batch.future.set_exception(BrokerError(f"stream failed: {_describe(exc)}"))
                batch.future.exception()
        self._directive_ready.set()
        self._room.set()

    # ---- directives ----------------------------------------------------------------------

    async def _dispatch(self) -> None:
        """Hand directives to ``on_directive`` in order. A task of its own, apart from the
        reader, so a callback that sends (an ack) may wait for room without stopping the
        answers that make the room."""
        assert self.on_directive is not None
        while True:
            while self._directives:
                directive = self._directives.popleft()
                try:
                    outcome = self.on_directive(directive)
                    if inspect.isawaitable(outcome):
                        await outcome
                except BrokerError:
                    return  # closed or failed for good: nothing more can be sent
                except Exception:
                    log.exception("client %s: on_directive failed for directive %d", self.client_id, directive.directive_id)
            if self._closed or self._error is not None:
                return
            self._directive_ready.clear()
            await self._directive_ready.wait()

    async def directives(self) -> AsyncIterator[dpb.Directive]:
        """Directives as they arrive, until the client is closed or fails for good."""
        while True:
            while self._directives:
                yield self._directives.popleft()
            if self._closed or self._error is not None:
                return
            self._directive_ready.clear()
            await self._directive_ready.wait()

    def drain_directives(self) -> list[dpb.Directive]:
        """Directives received so far and not yet taken, without waiting."""
        out = list(self._directives)
        self._directives.clear()
        return out


def _batch_refusal(result: dpb.DirectiveBatch) -> dpb.EventRejection | None:
    """The rejection of a batch refused whole (event_index -1, nothing applied), or None."""
    for rejection in result.rejections:
        if rejection.event_index == -1 and not result.accepted_events and not result.duplicate:
            return rejection
    return None


def _too_large(exc: grpc.aio.AioRpcError) -> bool:
    return "larger than max" in (exc.details() or "")


def _describe(exc: BaseException | None) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and _too_large(exc):
            # gRPC's own words; say which limit it is.
            return f"{exc.code().name}: {exc.details()} (a batch over the broker's limits.max_message_bytes; send smaller batches)"
        return f"{exc.code().name}: {exc.details()}"
    if exc is None:
        return "no error"
    return str(exc) or type(exc).__name__
