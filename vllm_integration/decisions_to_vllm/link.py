"""BrokerLink: one stream from a vLLM scheduler (one data-parallel rank) to a `kvbroker serve`.

The scheduler is synchronous and must never wait on the network longer than its bound. The
link runs a BrokerClient (batching, ordered delivery, resend on reconnect) on an event loop
in a daemon thread of its own; the scheduler thread only appends to a hand-off queue.

- ``send(events)`` queues events and returns at once (O(1) plus one cross-thread wake-up
  when the queue turns non-empty); ``send_later(make)`` queues a function the link's
  thread calls, in its place in the order, for the events to send (parsing and rewriting
  a batch, building thousands of events, off the scheduler's thread).
- ``ask(events, timeout)`` queues events whose last one wants an answer (an
  EvictionRequested) and waits for the answer to the batch that carries it (sealed right
  after them), at most ``timeout`` seconds. It returns the
  DirectiveBatch, or an ``Unanswered`` saying why not: ``down`` (no stream: it sends
  nothing and does not wait), ``timeout``, ``lost`` (the broker applied the batch but its
  answer went with a broken stream) or ``failed`` (the broker refused this client for
  good, or a batch of ours).
- Every directive the broker sends, answered in time or not, also lands in ``directives``
  (a deque the scheduler thread drains): late answers are how the caller puts the broker's
  view back in line with what vLLM did.
- ``take_resync()`` is True once after something the resend cannot repair: a batch dropped
  (queue bounds during a long outage), an answer lost, batches the broker lost and the
  client no longer retained, a batch refused for good. The caller then restates its tier.

Nothing here knows vLLM; the sidecar decider (vllm_integration.decisions_to_vllm.sidecar) builds on it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from clients.broker_client import BrokerClient, BrokerError, ClientSecurity, WhenFull
from clients.loop_thread import run_loop
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb

log = logging.getLogger("vllm.kvbroker.link")

DOWN = "down"
TIMEOUT = "timeout"
LOST = "lost"
FAILED = "failed"

# How long an answer the asker gave up on is still waited for (to count it late).
LATE_S = 30.0
# Client counters that mean the broker's view lost something the resend cannot give back.
_DIVERGED = ("dropped_batches", "lost_answers", "unrecoverable_batches", "failed_batches")


class Unanswered(NamedTuple):
    """Why ``ask`` has no answer: DOWN, TIMEOUT, LOST or FAILED, and a detail to log."""

    reason: str
    detail: str = ""


# Called on the link's thread for the events to send in its place.
Maker = Callable[[], Sequence[pb.Event]]


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


class _Ask:
    """An answer wanted: set on the link's loop, waited for on the scheduler thread."""

    __slots__ = ("abandoned", "future", "timeout")

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.future: concurrent.futures.Future[dpb.DirectiveBatch | Unanswered] = concurrent.futures.Future()
        # The asker stopped waiting (set under the link's lock): an answer now is a late one.
        self.abandoned = False


class BrokerLink:
    def __init__(
        self,
        target: str,
        client_id: str,
        *,
        tenant: str = "",
        security: ClientSecurity | None = None,
        max_queued_events: int = 1 << 20,
        max_batch_events: int = 256,
        max_delay_s: float = 0.001,
        max_pending_batches: int = 4096,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 1.0,
        connect_timeout_s: float = 2.0,
    ) -> None:
        """``max_queued_events``: the hand-off queue's bound; beyond it the oldest event is
        dropped (counted; the view is restated on reconnect). ``max_pending_batches``:
        unanswered batches the client keeps for resend; beyond it the oldest is dropped
        (the same). The other options go to BrokerClient."""
        if max_queued_events <= 0:
            raise ValueError("max_queued_events must be > 0")
        self.target = target
        self.client_id = client_id
        self.max_queued_events = max_queued_events
        # Directives as they arrive (appended on the link's thread, popped on the scheduler's;
        # deque append/popleft are atomic).
        self.directives: collections.deque[dpb.Directive] = collections.deque()
        self._queue: collections.deque[pb.Event | _Ask | Maker] = collections.deque()
        self._lock = threading.Lock()
        self._dropped_events = 0
        self._late_answers = 0
        self._resync = False
        self._seen: dict[str, int] = dict.fromkeys(_DIVERGED, 0)
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._wake: asyncio.Event | None = None
        self._stopping: asyncio.Event | None = None
        self._client = BrokerClient(
            target,
            client_id,
            tenant=tenant,
            security=security,
            max_batch_events=max_batch_events,
            max_delay_s=max_delay_s,
            max_pending_batches=max_pending_batches,
            when_full=WhenFull.DROP_OLDEST,
            backoff_initial_s=backoff_initial_s,
            backoff_max_s=backoff_max_s,
            connect_timeout_s=connect_timeout_s,
            on_directive=self.directives.append,
            close_timeout_s=1.0,
        )
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name=f"kvbroker-link-{client_id}", daemon=True)
        self._thread.start()
        self._ready.wait(5.0)

    # ---- the scheduler's side --------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._client.connected and self._client.failed is None

    @property
    def failed(self) -> BaseException | None:
        """Why the broker will not serve this client (a refusal no retry fixes), or None."""
        return self._client.failed

    def send(self, events: Sequence[pb.Event]) -> None:
        """Queue events for the broker; never waits."""
        if events:
            self._put(events, None)

    def send_later(self, make: Maker) -> None:
        """Queue ``make``: the link's thread calls it, in its place in the order, for the
        events to send. It must not touch state the scheduler thread changes."""
        self._put((), None, make)

    def ask(self, events: Sequence[pb.Event], timeout: float) -> dpb.DirectiveBatch | Unanswered:
        """Queue ``events`` and wait at most ``timeout`` seconds for the answer to the batch
        that carries the last of them. Without a stream it does not wait: DOWN."""
        # Not sent at all then: a request resent after a reconnect would be answered long
        # after the caller decided without it.
        if self._client.failed is not None:
            return Unanswered(FAILED, str(self._client.failed))
        if not self._client.connected:
            return Unanswered(DOWN, "no stream to the broker")
        ask = _Ask(timeout)
        self._put(events, ask)
        try:
            return ask.future.result(timeout)
        except concurrent.futures.TimeoutError:
            with self._lock:
                if not ask.future.done():
                    ask.abandoned = True
                    return Unanswered(TIMEOUT, f"no answer within {timeout * 1000:.1f} ms")
            return ask.future.result()  # it came as the wait ended

    def _put(self, events: Sequence[pb.Event], ask: _Ask | None, make: Maker | None = None) -> None:
        with self._lock:
            if self._closed:
                return
            was_empty = not self._queue
            if make is not None:
                self._queue.append(make)
            self._queue.extend(events)
            if ask is not None:
                self._queue.append(ask)
            over = len(self._queue) - self.max_queued_events
            for _ in range(max(0, over)):
                item = self._queue.popleft()
                if isinstance(item, _Ask):
                    item.future.set_result(Unanswered(DOWN, "queue full"))
                else:  # an event, or a batch to make (counted as one)
                    self._dropped_events += 1
                    self._resync = True
        if was_empty and self._wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (closing)
                self._loop.call_soon_threadsafe(self._wake.set)

    def take_resync(self) -> bool:
        """True (once) when the broker's view lost something a resend cannot give back."""
        for name in _DIVERGED:
            value = getattr(self._client.counters, name)
            if value != self._seen[name]:
                self._seen[name] = value
                self._resync = True
        with self._lock:
            resync, self._resync = self._resync, False
        return resync

    def counters(self) -> dict[str, int]:
        with self._lock:
            mine = {"queued_events": len(self._queue), "dropped_events": self._dropped_events, "late_answers": self._late_answers}
        inner = {f"client_{k}": v for k, v in self._client.counters.as_dict().items()}
        return {**mine, **inner, "connected": int(self.connected)}

    def wait_connected(self, timeout: float) -> bool:
        if self._closed or not self._thread.is_alive():
            return False
        future = asyncio.run_coroutine_threadsafe(self._client.wait_connected(timeout), self._loop)
        try:
            return bool(future.result(timeout + 0.5))
        except (concurrent.futures.TimeoutError, BrokerError):
            return False

    def close(self, timeout: float = 1.0) -> None:
        """Deliver what is queued within ``timeout`` seconds, then stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True

        async def stop() -> None:
            assert self._stopping is not None and self._wake is not None
            self._stopping.set()
            self._wake.set()

        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout)
            self._thread.join(timeout + 2.0)

    # ---- the link's thread -----------------------------------------------------------------

    def _thread_main(self) -> None:
        run_loop(self._loop, self._main, self._ready, f"link {self.client_id}", log)

    async def _main(self) -> None:
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._client.start()
        self._ready.set()
        asks: set[asyncio.Task[None]] = set()
        while True:
            self._wake.clear()
            with self._lock:
                items = list(self._queue)
                self._queue.clear()
            for item in items:
                if isinstance(item, _Ask):
                    loop = asyncio.get_running_loop()
                    flushing = loop.create_task(self._client.flush())
                    # Its asker may be gone (cancelled at close) when it fails: retrieved
                    # here, so shutdown logs no "Task exception was never retrieved".
                    flushing.add_done_callback(_retrieve)
                    # The flush's first step seals the open batch, which ends with the asking
                    # event, before anything more is added: it runs before this task resumes
                    # (ready callbacks run in order). Not wrapped (wait_for would make it a
                    # task of its own, a step later: a slow pump then put the next asker's
                    # events in the same batch).
                    await asyncio.sleep(0)
                    task = loop.create_task(self._answer(item, flushing))
                    asks.add(task)
                    task.add_done_callback(asks.discard)
                    continue
                if isinstance(item, pb.Event):
                    await self._add(item)
                    continue
                try:
                    made = item()
                except Exception:
                    log.exception("link %s: events not made; the view will be restated", self.client_id)
                    with self._lock:
                        self._resync = True
                    continue
                for event in made:
                    await self._add(event)
            if self._stopping.is_set() and not self._queue:
                break
            if not self._queue:
                await self._wake.wait()
        with contextlib.suppress(Exception):
            await self._client.close(timeout=0.5)
        for task in asks:
            task.cancel()

    async def _add(self, event: pb.Event) -> None:
        try:
            await self._client.add(event)
        except BrokerError as exc:  # refused for good: nothing more goes out
            log.debug("link %s: event not sent: %s", self.client_id, exc)

    async def _answer(self, ask: _Ask, flushing: asyncio.Task[dpb.DirectiveBatch | None]) -> None:
        """Wait for the answer to the batch ``flushing`` sealed. One that comes after the
        asker gave up is counted late (its directives, like every directive, go to
        ``directives``); after LATE_S it is not waited for any more."""
        done, _ = await asyncio.wait({flushing}, timeout=ask.timeout + LATE_S)
        result: Any
        if not done:
            flushing.cancel()
            result = Unanswered(TIMEOUT, "no answer in time")
        elif isinstance(flushing.exception(), BrokerError):
            result = Unanswered(FAILED, str(flushing.exception()))
        elif flushing.exception() is not None:
            result = Unanswered(FAILED, repr(flushing.exception()))
        else:
            result = flushing.result()
        if result is None:
            result = Unanswered(LOST, "the batch was dropped before the broker answered")
        elif isinstance(result, dpb.DirectiveBatch) and result.duplicate:
            result = Unanswered(LOST, "the broker applied the batch; its answer was lost with the stream")
        with self._lock:
            if ask.abandoned:
                if isinstance(result, dpb.DirectiveBatch):
                    self._late_answers += 1
                return
            ask.future.set_result(result)
