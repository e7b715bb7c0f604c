"""BrokerClient: the async Python client of the broker.

It batches events by count and by time, sends them on one bidirectional stream, yields the
directives that come back, and acks them. Event time (``ts_us``) is whatever the caller
passes, or microseconds of a monotonic clock since the client started.

    async with BrokerClient("127.0.0.1:50051", "engine-0") as client:
        await client.allocate("blk-1", 2 * 2**20, request_id="req-1")
        await client.access(["blk-1"])
        result = await client.flush()          # the DirectiveBatch of the last batch
        async for directive in client.directives():
            ...                                # carry it out, then:
            await client.ack(directive.directive_id)
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Iterable
from types import TracebackType

import grpc

from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb

SCHEMA_MAJOR = 1
SCHEMA_MINOR = 0
STREAM_METHOD = "/kvbroker.v1.BrokerService/Stream"


class BrokerError(Exception):
    """The broker refused the stream or the stream broke."""


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
    ) -> None:
        if max_batch_events <= 0:
            raise ValueError("max_batch_events must be > 0")
        self.target = target
        self.client_id = client_id
        self.tenant = tenant
        self.max_batch_events = max_batch_events
        self.max_delay_s = max_delay_s
        self.schema_major = schema_major
        self.hello_reply: spb.HelloReply | None = None
        self.batch_seq = 0
        self._events: list[pb.Event] = []
        self._first_event_at = 0.0
        self._t0 = time.monotonic_ns()
        self._channel: grpc.aio.Channel | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._pending: collections.deque[asyncio.Future[dpb.DirectiveBatch]] = collections.deque()
        self._directives: asyncio.Queue[dpb.Directive | None] = asyncio.Queue()
        self._send_lock = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self.results: list[dpb.DirectiveBatch] = []
        self.keep_results = False

    # ---- lifecycle -----------------------------------------------------------------------

    async def connect(self) -> spb.HelloReply:
        """Open the stream and exchange hellos; raises BrokerError if refused."""
        self._channel = grpc.aio.insecure_channel(self.target)
        stream = self._channel.stream_stream(
            STREAM_METHOD,
            request_serializer=spb.StreamRequest.SerializeToString,
            response_deserializer=spb.StreamResponse.FromString,
        )
        self._call = stream()
        hello = spb.Hello(schema_major=self.schema_major, schema_minor=SCHEMA_MINOR, client_id=self.client_id, tenant=self.tenant)
        try:
            await self._call.write(spb.StreamRequest(hello=hello))
            first = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            await self._channel.close()
            raise BrokerError(f"{exc.code().name}: {exc.details()}") from exc
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "hello":
            code = await self._call.code()
            details = await self._call.details()
            await self._channel.close()
            raise BrokerError(f"{code.name}: {details}")
        self.hello_reply = first.hello
        # Resume after what the broker already applied for this client id.
        self.batch_seq = self.hello_reply.last_batch_seq
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        self._ticker = asyncio.get_running_loop().create_task(self._tick_loop())
        return self.hello_reply

    async def close(self) -> None:
        """Send what is buffered, wait for its answers, and close the stream."""
        if self._call is None:
            return
        try:
            if self._error is None:
                await self.flush()
                await self._call.done_writing()
        finally:
            if self._ticker is not None:
                self._ticker.cancel()
            if self._reader is not None:
                try:
                    await asyncio.wait_for(self._reader, 5)
                except (TimeoutError, asyncio.CancelledError):
                    self._reader.cancel()
            assert self._channel is not None
            await self._channel.close()
            self._call = None

    async def __aenter__(self) -> BrokerClient:
        await self.connect()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    # ---- events --------------------------------------------------------------------------

    def now_us(self) -> int:
        return (time.monotonic_ns() - self._t0) // 1000

    async def add(self, event: pb.Event) -> None:
        """Buffer one event; sends the batch when it is full."""
        if self._error is not None:
            raise BrokerError(f"stream failed: {self._error}")
        if not self._events:
            self._first_event_at = time.monotonic()
        self._events.append(event)
        if len(self._events) >= self.max_batch_events:
            await self._send()

    async def allocate(self, block_id: str, size_bytes: int, *, ts_us: int | None = None, tier: str = "", **intent: object) -> None:
        """Allocate a block; ``intent`` takes MemoryIntent field names."""
        mi = pb.MemoryIntent(block_id=block_id, size_bytes=size_bytes, **intent)  # type: ignore[arg-type]
        await self.add(pb.Event(ts_us=self._ts(ts_us), allocated=pb.BlockAllocated(intent=mi, tier=tier)))

    async def access(self, block_ids: Iterable[str], *, ts_us: int | None = None) -> None:
        await self.add(pb.Event(ts_us=self._ts(ts_us), accessed=pb.BlocksAccessed(block_ids=block_ids)))

    async def update(self, block_id: str, *, ts_us: int | None = None, **changes: object) -> None:
        """Change intent; ``changes`` takes IntentUpdated field names."""
        upd = pb.IntentUpdated(block_id=block_id, **changes)  # type: ignore[arg-type]
        await self.add(pb.Event(ts_us=self._ts(ts_us), intent_updated=upd))

    async def release(self, block_ids: Iterable[str], *, ts_us: int | None = None) -> None:
        await self.add(pb.Event(ts_us=self._ts(ts_us), released=pb.BlocksReleased(block_ids=block_ids)))

    async def free(self, block_ids: Iterable[str], *, ts_us: int | None = None) -> None:
        await self.add(pb.Event(ts_us=self._ts(ts_us), freed=pb.BlocksFreed(block_ids=block_ids)))

    async def clear(self, *, ts_us: int | None = None) -> None:
        await self.add(pb.Event(ts_us=self._ts(ts_us), cleared=pb.AllBlocksCleared()))

    async def ack(
        self, directive_id: int, *, failed: bool = False, actual_tier: str = "", error: str = "", ts_us: int | None = None
    ) -> None:
        """Report a directive done, or failed with the tier the block really is in."""
        status = pb.ACK_STATUS_FAILED if failed else pb.ACK_STATUS_DONE
        acked = pb.DirectiveAcked(directive_id=directive_id, status=status, actual_tier=actual_tier, error=error)
        await self.add(pb.Event(ts_us=self._ts(ts_us), acked=acked))

    def _ts(self, ts_us: int | None) -> int:
        return self.now_us() if ts_us is None else ts_us

    # ---- sending and receiving -----------------------------------------------------------

    async def flush(self) -> dpb.DirectiveBatch | None:
        """Send the buffered events and wait for every answer outstanding; returns the last."""
        await self._send()
        last: dpb.DirectiveBatch | None = None
        while self._pending:
            last = await asyncio.shield(self._pending[-1])
        if self._error is not None:
            raise BrokerError(f"stream failed: {self._error}")
        return last

    async def _send(self) -> None:
        async with self._send_lock:
            if not self._events:
                return
            if self._call is None:
                raise BrokerError("not connected")
            events, self._events = self._events, []
            self.batch_seq += 1
            batch = pb.IntentBatch(client_id=self.client_id, batch_seq=self.batch_seq, events=events)
            future: asyncio.Future[dpb.DirectiveBatch] = asyncio.get_running_loop().create_future()
            self._pending.append(future)
            try:
                await self._call.write(spb.StreamRequest(batch=batch))
            except grpc.aio.AioRpcError as exc:
                self._fail(exc)
                raise BrokerError(f"{exc.code().name}: {exc.details()}") from exc

    async def _tick_loop(self) -> None:
        """Send a partly filled batch once its oldest event waited ``max_delay_s``."""
        while True:
            await asyncio.sleep(self.max_delay_s)
            if self._events and time.monotonic() - self._first_event_at >= self.max_delay_s:
                try:
                    await self._send()
                except BrokerError:
                    return

    async def _read_loop(self) -> None:
        assert self._call is not None
        try:
            # read() rather than ``async for``: grpc.aio forbids mixing the two on one call,
            # and the hello was taken with read().
            while (response := await self._call.read()) is not grpc.aio.EOF:
                result = response.directives
                if self.keep_results:
                    self.results.append(result)
                for directive in result.directives:
                    self._directives.put_nowait(directive)
                if self._pending:
                    future = self._pending.popleft()
                    if not future.done():
                        future.set_result(result)
        except grpc.aio.AioRpcError as exc:
            self._fail(exc)
            return
        except BaseException as exc:  # never die silently: waiters must learn the stream is gone
            self._fail(exc)
            raise
        self._fail(None)

    def _fail(self, exc: BaseException | None) -> None:
        if exc is not None and self._error is None:
            self._error = exc
        while self._pending:
            future = self._pending.popleft()
            if not future.done():
                future.set_exception(BrokerError(f"stream ended before the answer: {exc}"))
        self._directives.put_nowait(None)

    async def directives(self) -> AsyncIterator[dpb.Directive]:
        """Directives as they arrive, until the stream ends."""
        while True:
            directive = await self._directives.get()
            if directive is None:
                return
            yield directive

    def drain_directives(self) -> list[dpb.Directive]:
        """Directives received so far and not yet taken, without waiting."""
        out = []
        while not self._directives.empty():
            directive = self._directives.get_nowait()
            if directive is None:
                self._directives.put_nowait(None)
                break
            out.append(directive)
        return out
