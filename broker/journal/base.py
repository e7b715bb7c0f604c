"""The journal interface: appends are queued on the request path and written by one
background task in order, grouped and pipelined."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from abc import ABC, abstractmethod

from broker.journal.records import JournalRecord

log = logging.getLogger("kvbroker.journal")


class Journal(ABC):
    """Queue-and-write-behind journal; subclasses implement ``_write`` for one group."""

    def __init__(self, max_group: int = 512) -> None:
        self._queue: list[JournalRecord] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.max_group = max_group
        self.written = 0
        self.appended = 0
        self.errors = 0
        self.last_error = ""
        # Records given up on (a full spool under spool_full = "drop"); counted in ``written``
        # too, which counts every record no longer waiting.
        self.dropped = 0
        # (ordinal, future) of callers waiting for a record to be written, in ordinal order.
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    @abstractmethod
    def description(self) -> str: ...

    @property
    def pending(self) -> int:
        return len(self._queue)

    @property
    def spool_bytes(self) -> int:
        """Bytes in the local spool (journals with one: broker.journal.spool)."""
        return 0

    @property
    def spool_records(self) -> int:
        """Records in the local spool, not yet in the backend."""
        return 0

    @property
    def saturated(self) -> bool | None:
        """Whether the journal can take no more records durably; None when it does not
        know (no spool): the health watch then goes by ``errors``, ``written``, ``pending``."""
        return None

    def refusal(self, nbytes: int) -> str | None:
        """Why a new batch of about ``nbytes`` must be refused before it is applied (the
        spool is full and spool_full = "refuse"), or None to accept it."""
        return None

    async def start(self) -> None:
        await self._open()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"journal-writer {self.description}")

    def append(self, record: JournalRecord) -> int:
        """Queue a record; never blocks. Records are written in the order appended.
        Returns the record's ordinal, for ``durable``."""
        self._queue.append(record)
        self.appended += 1
        self._idle.clear()
        self._wake.set()
        return self.appended

    async def durable(self, ordinal: int) -> None:
        """Wait until the record with this ordinal (and so every one before it) is written."""
        if self.written >= ordinal:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((ordinal, future))
        await future

    async def flush(self) -> None:
        """Wait until everything appended so far is written."""
        while self._queue or not self._idle.is_set():
            if self._task is None or self._task.done():
                raise RuntimeError(f"journal {self.description} is not running")
            await self._idle.wait()

    async def close(self) -> None:
        """Write what is queued, then stop."""
        if self._task is not None and not self._task.done():
            await self.flush()
            self._closing = True
            self._wake.set()
            await self._task
        await self._close()

    async def abort(self) -> list[JournalRecord]:
        """Stop now, without waiting for what is queued (an exit whose wait for the backend
        is over): the writer task is cancelled, a write in flight with it, and the backend
        released. Returns the records not written, in order. A cancelled Redis write may
        still have reached Redis: those records count as not written."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):  # the backend is failing; release what can be
            await self._close()
        return list(self._queue)

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            if not self._queue:
                self._idle.set()
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            group = self._queue[: self.max_group]
            try:
                await self._write(group)
            except Exception as exc:  # keep the records and retry: nothing accepted is lost
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("journal %s write failed (%s); retrying in %.2fs", self.description, self.last_error, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.05
            del self._queue[: len(group)]
            self._settle(len(group))

    def _settle(self, n: int) -> None:
        """The next ``n`` queued records are written (or spooled, or dropped): release the
        callers waiting for them."""
        self.written += n
        waiters = self._waiters
        while waiters and waiters[0][0] <= self.written:
            _, future = waiters.popleft()
            if not future.done():
                future.set_result(None)

    async def _open(self) -> None:
        """Prepare the backend (create or repair the file, connect)."""

    async def _close(self) -> None:
        """Release the backend."""

    @abstractmethod
    async def _write(self, group: list[JournalRecord]) -> None:
        """Durably hand one group of records to the backend, in order, or raise."""


class NullJournal(Journal):
    """Journal nothing (``--journal none``): replay of this broker is impossible."""

    @property
    def description(self) -> str:
        return "none"

    def append(self, record: JournalRecord) -> int:
        # Nothing to write, so the record is "written" at once: callers of ``durable`` (every
        # batch with ack_after = "journal") return without a trip through the writer task.
        self.appended += 1
        self._settle(1)
        return self.appended

    async def _write(self, group: list[JournalRecord]) -> None:
        return None
