"""SyncBrokerClient: the broker client for engines whose scheduler is synchronous.

A BrokerClient runs on an event loop in a daemon thread of its own. The engine's calls put
events into a bounded hand-off queue and return: they never wait on the network. When the
broker is down the client buffers up to its own bounds (``max_pending_batches`` batches,
it resends them on reconnect), then stops taking from the hand-off queue; once that queue
holds ``max_queued_events``, a call waits at most ``max_block_s`` for room, then
``when_full`` decides: ``drop_oldest`` (the default: the oldest queued event goes, the new
one is taken), ``drop_newest`` (the new one is refused; the call returns False), or
``raise`` (QueueFull). Every event dropped is counted (``counters()``).

    client = SyncBrokerClient("127.0.0.1:50051", "vllm-dp0-hooks", max_block_s=0.001)
    client.allocate("blk-1", 2 * 2**20, request_id="req-1")   # returns at once
    client.flush(timeout=1.0)                                  # waits at most 1 s
    for directive in client.drain_directives():
        client.ack(directive.directive_id)
    print(client.counters())        # {"dropped_events": 0, "queued_events": 0, ...}
    client.close(timeout=2.0)

Methods that wait (``flush``, ``wait_connected``, ``close``) take a timeout and default to
``call_timeout_s``; they raise TimeoutError (flush) or return False rather than wait more.
``on_directive``, if given, is called on the client's thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from clients.broker_client import (
    BrokerClient,
    BrokerError,
    WhenFull,
    accessed_event,
    acked_event,
    allocated_event,
    cleared_event,
    freed_event,
    released_event,
    updated_event,
)
from clients.loop_thread import run_loop
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb

log = logging.getLogger("kvbroker.sync_client")

DROP_OLDEST = "drop_oldest"
DROP_NEWEST = "drop_newest"
RAISE = "raise"


class QueueFull(Exception):
    """``when_full="raise"``: the hand-off queue stayed full for ``max_block_s``."""


class SyncBrokerClient:
    def __init__(
        self,
        target: str,
        client_id: str,
        *,
        max_queued_events: int = 65536,
        max_block_s: float = 0.0,
        when_full: str = DROP_OLDEST,
        call_timeout_s: float = 1.0,
        max_directives: int = 65536,
        on_directive: Callable[[dpb.Directive], None] | None = None,
        **client_options: Any,
    ) -> None:
        """``client_options`` go to BrokerClient (max_batch_events, max_pending_batches, ...);
        its ``when_full`` is always ``block``: drops happen here, where they are counted."""
        if max_queued_events <= 0:
            raise ValueError("max_queued_events must be > 0")
        if max_block_s < 0 or call_timeout_s <= 0:
            raise ValueError("max_block_s must be >= 0 and call_timeout_s > 0")
        if when_full not in (DROP_OLDEST, DROP_NEWEST, RAISE):
            raise ValueError(f"when_full must be {DROP_OLDEST}, {DROP_NEWEST} or {RAISE}, got {when_full!r}")
        if "when_full" in client_options:
            raise ValueError("the inner client always blocks; set when_full for the hand-off queue")
        self.target = target
        self.client_id = client_id
        self.max_queued_events = max_queued_events
        self.max_block_s = max_block_s
        self.when_full = when_full
        self.call_timeout_s = call_timeout_s
        self._on_directive = on_directive
        self._t0 = time.monotonic_ns()
        self._cond = threading.Condition()
        self._queue: collections.deque[pb.Event] = collections.deque()
        self._directives: collections.deque[dpb.Directive] = collections.deque()
        self._max_directives = max_directives
        self._closed = False
        # Counted under _cond.
        self._accepted = 0
        self._dropped = 0
        self._refused = 0
        self._dropped_directives = 0
        self._undeliverable = 0
        # Events the pump took from the queue and has not yet handed to the client (loop thread only).
        self._in_hand = 0
        self._loop = asyncio.new_event_loop()
        self._wake: asyncio.Event | None = None
        self._stopping: asyncio.Event | None = None
        self._client = BrokerClient(target, client_id, when_full=WhenFull.BLOCK, on_directive=self._take_directive, **client_options)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name=f"kvbroker-client-{client_id}", daemon=True)
        self._thread.start()
        self._ready.wait(5.0)

    # ---- the client thread ---------------------------------------------------------------

    def _thread_main(self) -> None:
        run_loop(self._loop, self._main, self._ready, f"client {self.client_id}", log)

    async def _main(self) -> None:
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._client.start()
        self._ready.set()
        await self._pump()

    async def _pump(self) -> None:
        """Move events from the hand-off queue into the client, a batch at a time."""
        assert self._wake is not None and self._stopping is not None
        chunk = self._client.max_batch_events
        while True:
            self._wake.clear()
            with self._cond:
                events = [self._queue.popleft() for _ in range(min(chunk, len(self._queue)))]
                if events:
                    self._cond.notify_all()
            if not events:
                if self._stopping.is_set():
                    return
                await self._wake.wait()
                continue
            self._in_hand = len(events)
            for i, event in enumerate(events):
                try:
                    await self._client.add(event)
                except BrokerError as exc:
                    with self._cond:
                        self._undeliverable += len(events) - i
                    log.warning("client %s: dropping %d events: %s", self.client_id, len(events) - i, exc)
                    break
                finally:
                    self._in_hand -= 1
            self._in_hand = 0

    def _take_directive(self, directive: dpb.Directive) -> None:
        if self._on_directive is not None:
            self._on_directive(directive)
            return
        with self._cond:
            if len(self._directives) >= self._max_directives:
                self._directives.popleft()
                self._dropped_directives += 1
            self._directives.append(directive)

    def _call(self, factory: Callable[[], Any], timeout: float | None) -> Any:
        """Run a coroutine on the client's loop; wait at most ``timeout`` (call_timeout_s)."""
        if self._closed or not self._thread.is_alive():
            raise BrokerError("client is closed")
        future = asyncio.run_coroutine_threadsafe(factory(), self._loop)
        limit = self.call_timeout_s if timeout is None else timeout
        try:
            return future.result(limit)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"broker client {self.client_id}: no answer within {limit:.3f}s") from None

    # ---- events --------------------------------------------------------------------------

    def now_us(self) -> int:
        return (time.monotonic_ns() - self._t0) // 1000

    def add(self, event: pb.Event) -> bool:
        """Queue one event for the broker. Never waits longer than ``max_block_s``; returns
        False if the event was refused (``drop_newest``)."""
        with self._cond:
            if self._closed:
                raise BrokerError("client is closed")
            if len(self._queue) >= self.max_queued_events and self.max_block_s > 0:
                self._cond.wait_for(lambda: len(self._queue) < self.max_queued_events or self._closed, self.max_block_s)
            if len(self._queue) >= self.max_queued_events:
                if self.when_full == DROP_NEWEST:
                    self._refused += 1
                    return False
                if self.when_full == RAISE:
                    self._refused += 1
                    raise QueueFull(f"{len(self._queue)} events queued (max_queued_events {self.max_queued_events})")
                self._queue.popleft()
                self._dropped += 1
            was_empty = not self._queue
            self._queue.append(event)
            self._accepted += 1
        if was_empty and self._wake is not None:
            # Wake the pump only when the queue turns non-empty: one cross-thread call per
            # drain, not per event.
            with contextlib.suppress(RuntimeError):  # the loop is gone (closing)
                self._loop.call_soon_threadsafe(self._wake.set)
        return True

    def allocate(self, block_id: str, size_bytes: int, *, ts_us: int | None = None, tier: str = "", **intent: Any) -> bool:
        return self.add(allocated_event(block_id, size_bytes, self._ts(ts_us), tier=tier, **intent))

    def access(self, block_ids: Iterable[str], *, ts_us: int | None = None, next_use_us: int | None = None) -> bool:
        return self.add(accessed_event(block_ids, self._ts(ts_us), next_use_us=next_use_us))

    def update(self, block_id: str, *, ts_us: int | None = None, **changes: Any) -> bool:
        return self.add(updated_event(block_id, self._ts(ts_us), **changes))

    def release(self, block_ids: Iterable[str], *, ts_us: int | None = None) -> bool:
        return self.add(released_event(block_ids, self._ts(ts_us)))

    def free(self, block_ids: Iterable[str], *, ts_us: int | None = None) -> bool:
        return self.add(freed_event(block_ids, self._ts(ts_us)))

    def clear(self, *, ts_us: int | None = None) -> bool:
        return self.add(cleared_event(self._ts(ts_us)))

    def ack(self, directive_id: int, *, failed: bool = False, actual_tier: str = "", error: str = "", ts_us: int | None = None) -> bool:
        return self.add(acked_event(directive_id, self._ts(ts_us), failed=failed, actual_tier=actual_tier, error=error))

    def _ts(self, ts_us: int | None) -> int:
        return self.now_us() if ts_us is None else ts_us

    # ---- waiting, with a bound -----------------------------------------------------------

    def flush(self, timeout: float | None = None) -> dpb.DirectiveBatch | None:
        """Wait until every event queued so far is answered; at most ``timeout`` seconds
        (default ``call_timeout_s``), then TimeoutError."""

        async def run() -> dpb.DirectiveBatch | None:
            assert self._wake is not None
            while True:
                with self._cond:
                    if not self._queue and not self._in_hand:
                        break
                self._wake.set()
                await asyncio.sleep(0.001)
            return await self._client.flush()

        result: dpb.DirectiveBatch | None = self._call(run, timeout)
        return result

    def wait_connected(self, timeout: float | None = None) -> bool:
        limit = self.call_timeout_s if timeout is None else timeout
        try:
            return bool(self._call(lambda: self._client.wait_connected(limit), limit + 0.5))
        except TimeoutError:
            return False

    @property
    def connected(self) -> bool:
        return self._client.connected

    @property
    def rejected_events(self) -> int:
        """Events the broker answered as rejected (not applied; each also logged, at most one
        line per few seconds): counters()["client_rejected_events"]."""
        return self._client.counters.rejected_events

    def drain_directives(self) -> list[dpb.Directive]:
        """Directives received and not yet taken (when no ``on_directive`` was given)."""
        with self._cond:
            out = list(self._directives)
            self._directives.clear()
        return out

    def counters(self) -> dict[str, int]:
        """What was taken and dropped here, and the inner client's counters."""
        with self._cond:
            mine = {
                "accepted_events": self._accepted,
                "queued_events": len(self._queue),
                "in_hand_events": self._in_hand,
                "dropped_events": self._dropped,
                "refused_events": self._refused,
                "undeliverable_events": self._undeliverable,
                "dropped_directives": self._dropped_directives,
            }
        inner = {f"client_{k}": v for k, v in self._client.counters.as_dict().items()}
        inner["client_unanswered_batches"] = self._client.unanswered
        inner["client_buffered_events"] = self._client.buffered_events
        return {**mine, **inner}

    def close(self, timeout: float | None = None) -> bool:
        """Deliver what is queued within ``timeout`` (default ``call_timeout_s``), then stop.
        True if everything was answered; what was not is in the counters (``client_abandoned_*``
        and ``queued_events``)."""
        limit = self.call_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        if self._closed:
            return True
        clean = True
        try:
            self.flush(limit)
        except (TimeoutError, BrokerError):
            clean = False
        with self._cond:
            self._closed = True
            self._cond.notify_all()

        async def stop() -> None:
            assert self._stopping is not None and self._wake is not None
            await self._client.close(timeout=0)
            self._stopping.set()
            self._wake.set()

        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(stop(), self._loop).result(max(0.2, deadline - time.monotonic()))
            self._thread.join(max(0.1, deadline - time.monotonic()))
        return clean and not self._thread.is_alive()

    def __enter__(self) -> SyncBrokerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
