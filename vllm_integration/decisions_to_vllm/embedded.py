"""The embedded core: kvbroker's deterministic core inside vLLM's scheduler process, and
its journal written from a thread of its own.

Every batch the adapter makes is applied with ``broker.model.apply.apply_batch`` from its wire
bytes, the path ``kvbroker serve`` and ``kvbroker replay`` take, and journaled byte for byte
(with the config first, and the directives of each batch that has some), so that
``kvbroker replay --journal ... --verify`` reproduces every decision.

The journals (broker.journal) are asyncio writers; vLLM's scheduler is not. Records go
into a deque (an append, no lock, no I/O on vLLM's path) that a thread running its own
event loop drains into the journal every ``journal_flush_ms``. The thread is a daemon; the
journal is flushed, given its trailer and closed when the process exits (and by ``close``),
within ``journal_exit_s``. ``close`` and ``flush`` wake the thread from its wait between two
drains: whatever the flush interval, the exit does not wait for it (a minute's interval
lost every batch at a 3 s exit, the journal its 8-byte header).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import logging
import multiprocessing
import pathlib
import threading
import time
from collections.abc import Callable
from typing import Any

from broker.config import CoreConfig, core_to_json
from broker.journal import file_path, open_journal
from broker.journal.records import JournalError, JournalRecord, RecordKind
from broker.journal.trailer import Trailer
from broker.model.apply import BatchOutcome, apply_batch
from broker.model.core import Core
from broker.model.wire import directive_to_pb, read_batch
from kvbroker.v1 import directive_pb2 as dpb
from vllm_integration.decisions_to_vllm import intent_bytes
from vllm_integration.decisions_to_vllm.settings import TIER, OffloadSettings, SettingsError

answer_native: Any
try:
    from broker.model import _answer as answer_native
except ImportError:  # the pure Python build
    answer_native = None

# Under vLLM's logger (this room runs inside vLLM): vLLM's logging configuration shows it.
log = logging.getLogger("vllm.kvbroker")

# The schema major version written in journal records (kvbroker.v1).
SCHEMA_MAJOR = 1

# A batch's directives, queued for the journal thread to encode: (client id, batch seq,
# outcome, config generation).
Directives = tuple[str, int, BatchOutcome, int]


def directives_payload(client_id: str, seq: int, outcome: BatchOutcome, generation: int = 1) -> bytes:
    """The DirectiveBatch of a batch's directives, as the broker journals it (replay
    ``--verify`` compares the directives)."""
    if answer_native is not None:
        return bytes(answer_native.encode_answer(client_id, seq, outcome.directives, outcome.accepted, False, generation))
    return dpb.DirectiveBatch(
        client_id=client_id,
        batch_seq=seq,
        directives=[directive_to_pb(d) for d in outcome.directives],
        accepted_events=outcome.accepted,
        config_generation=generation,
    ).SerializeToString()


def start_journal(url: str, stream: str, settings: OffloadSettings, client_id: str) -> JournalThread:
    """The journal thread of ``kvbroker_journal``; a journal that cannot be opened stops
    vLLM's start with one line naming the key (a SettingsError), not a lock file's error."""
    if url.startswith("file://"):
        folder = pathlib.Path(file_path(url)).parent
        if not folder.is_dir():
            raise SettingsError(f"kvbroker_journal: the folder {folder} does not exist ({url}); create it, or name another")
    try:
        return JournalThread(url, stream, settings.journal_flush_ms / 1000.0, exit_s=settings.journal_exit_s, client_id=client_id)
    except (JournalError, OSError) as exc:
        raise SettingsError(f"kvbroker_journal: cannot open {url}: {exc}") from None


class JournalThread:
    """A journal (file, Redis, none) written from a background thread.

    ``append`` never blocks and does no I/O; the thread writes what was appended every
    ``flush_s`` seconds, in order. Opening the journal happens in ``__init__`` and its error
    (a bad URL, a file another process holds) is raised there, to the caller.

    Closing writes what is queued and then a trailer (broker.journal.trailer: the batches
    appended), waiting at most ``exit_s`` for the backend; past that (disk full, Redis down)
    the rest is given up and one ERROR line says how many records were lost and from which
    batch on. The process's exit closes it (see ``close_at_exit``)."""

    def __init__(self, url: str, stream: str, flush_s: float, *, exit_s: float = 3.0, client_id: str = "") -> None:
        self.url = url
        # Records, directives to encode as one (client id, batch seq, outcome, config
        # generation), flush marks.
        self._queue: collections.deque[JournalRecord | Directives | threading.Event] = collections.deque()
        self._flush_s = flush_s
        self._exit_s = exit_s
        self._client_id = client_id
        self._stop = False
        self._closing = False
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        # Set (on the thread's loop) to end the wait between two drains early: close, flush.
        self._wake: asyncio.Event | None = None
        self._journal: Any = None
        self.written = 0
        # The batches appended (the trailer's count), and the first and last batch seq.
        self.batches = 0
        self._first_seq = 0
        self._last_seq = 0
        # Records given up at close (the backend took nothing within exit_s).
        self.lost = 0
        self._thread = threading.Thread(target=self._run, args=(url, stream), name="kvbroker-journal", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        close_at_exit(self.close)

    @property
    def pending(self) -> int:
        """Records appended and not yet written (the journal's lag; read from any thread)."""
        journal = self._journal
        queued = sum(1 for item in list(self._queue) if not isinstance(item, threading.Event))
        return queued + (int(journal.pending) if journal is not None else 0)

    def append(self, record: JournalRecord | Directives) -> None:
        """Queue a record, or a batch's directives as (client id, batch seq, outcome, generation)."""
        self._queue.append(record)

    def append_batch(self, raw: bytes, seq: int, generation: int = 1) -> None:
        """Queue a batch (its IntentBatch bytes, numbered ``seq``, applied under config
        ``generation``), counted for the trailer."""
        if not self.batches:
            self._first_seq = seq
        self._last_seq = seq
        self.batches += 1
        self._queue.append(JournalRecord(RecordKind.BATCH, SCHEMA_MAJOR, generation, raw))

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until everything appended so far is written."""
        if not self._thread.is_alive():
            return
        done = threading.Event()
        self._queue.append(done)
        self._wake_up()
        if not done.wait(timeout):
            raise JournalError(f"journal {self.url}: not written within {timeout} s")

    def close(self) -> None:
        """Write what is queued and the trailer, close the journal, stop the thread, waiting
        at most ``exit_s`` for the backend (idempotent)."""
        if self._closing:
            return
        self._closing = True
        self._stop = True
        self._wake_up()
        self._thread.join(self._exit_s)
        if not self._thread.is_alive():
            return
        # The backend took nothing more within exit_s: the thread gives up what is queued
        # (cancelling a write in flight) and logs what was lost.
        loop, task = self._loop, self._task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                loop.call_soon_threadsafe(task.cancel)
        self._thread.join(ABORT_S)
        if self._thread.is_alive():  # a write blocked in the kernel (a hung disk)
            log.error(
                "kvbroker journal %s: not written within %.1f s at exit (kvbroker_journal_exit_s) and a write is stuck; "
                "about %d queued records are lost",
                self.url,
                self._exit_s,
                len(self._queue) + (self._journal.pending if self._journal is not None else 0),
            )

    def _wake_up(self) -> None:
        """End the journal thread's wait between two drains now (from any thread)."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                loop.call_soon_threadsafe(wake.set)

    def _run(self, url: str, stream: str) -> None:
        try:
            asyncio.run(self._main(url, stream))
        except BaseException as exc:  # reported to __init__ if it happens while opening
            if not self._ready.is_set():
                self._error = exc
                self._ready.set()
            else:
                log.error("kvbroker journal %s stopped: %s", url, exc)

    async def _main(self, url: str, stream: str) -> None:
        # inline_file: the file is written from this thread, not an executor, which refuses
        # new work once the interpreter is exiting (when the last records are written).
        journal = open_journal(url, stream=stream, maxlen=10_000_000, fsync=False, max_group=512, spool_dir="", inline_file=True)
        await journal.start()
        self._journal = journal
        wake = self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._ready.set()
        try:
            while True:
                stopping = self._stop
                await self._drain(journal)
                if stopping:
                    break
                if not self._stop:  # a close since the drain: drain again at once
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), self._flush_s)
                    wake.clear()
            if self.batches:
                journal.append(Trailer(self._client_id, self._first_seq, self._last_seq, self.batches).record(SCHEMA_MAJOR, 1))
            await journal.close()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # the cancel was close() giving up; what follows must run
            self._give_up(journal, await journal.abort())
        except BaseException:
            await journal.abort()
            raise
        finally:
            self.written = journal.written
            for item in self._queue:  # nobody waits forever on a journal that stopped
                if isinstance(item, threading.Event):
                    item.set()

    def _give_up(self, journal: Any, unwritten: list[JournalRecord]) -> None:
        """Count what was not written at exit and say so, in one ERROR line."""
        left = [item for item in self._queue if not isinstance(item, threading.Event)]
        lost = [*unwritten, *left]
        self.lost = len(lost)
        first = next((seq for seq in map(_batch_seq, lost) if seq is not None), None)
        log.error(
            "kvbroker journal %s: not written within %.1f s at exit (kvbroker_journal_exit_s; last error: %s): "
            "lost %d records (%d batches) from batch %s of client %s on; no trailer written",
            self.url,
            self._exit_s,
            journal.last_error or "none",
            len(lost),
            sum(1 for r in lost if isinstance(r, JournalRecord) and r.kind == RecordKind.BATCH),
            first,
            self._client_id,
        )

    async def _drain(self, journal: Any) -> None:
        queue = self._queue
        waiting: list[threading.Event] = []
        while queue:
            item = queue.popleft()
            if isinstance(item, threading.Event):
                waiting.append(item)
            elif isinstance(item, tuple):
                journal.append(JournalRecord(RecordKind.DIRECTIVES, SCHEMA_MAJOR, item[3], directives_payload(*item)))
            else:
                journal.append(item)
        if waiting or journal.pending:
            await journal.flush()
        self.written = journal.written
        for done in waiting:
            done.set()


# How long a close that gave up waits for the journal thread to cancel its write and count
# what was lost (a cancelled write ends at once unless it is blocked in the kernel).
ABORT_S = 1.0


def _batch_seq(item: JournalRecord | Directives) -> int | None:
    """The batch seq a queued journal item belongs to (None: a config or trailer)."""
    if isinstance(item, tuple):
        return item[1]
    if item.kind == RecordKind.BATCH:
        return read_batch(item.payload).batch_seq
    if item.kind == RecordKind.DIRECTIVES:
        return int(dpb.DirectiveBatch.FromString(item.payload).batch_seq)
    return None


def close_at_exit(close: Callable[[], None]) -> None:
    """Run ``close`` when the process exits normally.

    ``atexit`` covers the main process and spawned children; it runs after the threads
    that are not daemons have ended, so their last batches are journaled too. A child made
    by multiprocessing's fork (vLLM's engine core by default: VLLM_WORKER_MULTIPROC_METHOD)
    leaves with ``os._exit``, which runs no atexit handler, after ``threading._shutdown``,
    which runs the hooks of ``threading._register_atexit`` (private, but what
    concurrent.futures relies on too): a child registers there as well. ``close`` is
    idempotent."""
    atexit.register(close)
    if multiprocessing.parent_process() is not None:
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            with contextlib.suppress(RuntimeError):  # already shutting down: atexit remains
                register(close)


class EmbeddedCore:
    """One kvbroker core with one tier (vLLM's CPU tier, ``capacity`` one-byte chunks), the
    client's batch numbering, and the journal.

    ``listeners`` are called with each applied batch's bytes (the sidecar mode forwards them)."""

    def __init__(self, settings: OffloadSettings, capacity: int, *, policy: str | None = None, journal: bool = True) -> None:
        self.config = settings.core_config(capacity, policy)
        self.core = Core(self.config)
        self.tier = TIER
        self.client_id = settings.resolved_client_id()
        self._head = intent_bytes.batch_head(self.client_id)
        # batch_seq starts at the wall clock in microseconds: an engine restarted on the same
        # journal (same client id) goes on numbering above its last run, so replay takes its
        # batches as new ones, not as duplicates.
        self.seq = time.time_ns() // 1000
        self.rejected = 0
        self.listeners: list[Callable[[bytes], None]] = []
        url = settings.resolved_journal() if journal else "none"
        self.journal: JournalThread | None = None
        if url != "none":
            stream = settings.journal_stream.replace("{client}", self.client_id)
            self.journal = start_journal(url, stream, settings, self.client_id)
            # A start is an empty CPU tier: on a journal an earlier run of this engine wrote,
            # that run's chunks go (before the config, which may size the tier anew).
            self.apply([intent_bytes.cleared(intent_bytes.timestamp(time.time_ns() // 1000))])
            self.journal.append(JournalRecord(RecordKind.CONFIG, SCHEMA_MAJOR, self.generation, core_to_json(self.config).encode()))

    @property
    def generation(self) -> int:
        """The config generation in force (1 at start; each live switch adds one)."""
        return self.core.generation

    def reconfigure(self, config: CoreConfig) -> int:
        """Switch the core to ``config`` between two batches, as ``kvbroker serve``'s reload
        does: the next generation, journaled as a CONFIG record at this point of the record
        order, so that replay follows the switch where it happened. Returns the generation;
        raises ConfigError and changes nothing when the core refuses the config."""
        generation = self.core.generation + 1
        self.core.reconfigure(config, generation)
        self.config = config
        if self.journal is not None:
            self.journal.append(JournalRecord(RecordKind.CONFIG, SCHEMA_MAJOR, generation, core_to_json(config).encode()))
        return generation

    def apply(self, evs: list[bytes]) -> BatchOutcome:
        """Apply one batch of encoded events (vllm_integration.decisions_to_vllm.intent_bytes) and journal it."""
        self.seq += 1
        raw = intent_bytes.batch(self._head, self.seq, evs)
        outcome = apply_batch(self.core, raw)
        if outcome.rejections:
            self.rejected += len(outcome.rejections)
            first = outcome.rejections[0]
            log.debug("kvbroker: batch %d: event %d rejected: %s: %s", self.seq, first.index, first.field, first.reason)
        journal = self.journal
        if journal is not None:
            generation = self.core.generation
            journal.append_batch(raw, self.seq, generation)
            if outcome.directives:
                # Encoded by the journal thread, off vLLM's path.
                journal.append((self.client_id, self.seq, outcome, generation))
        for listener in self.listeners:
            listener(raw)
        return outcome

    def flush(self) -> None:
        if self.journal is not None:
            self.journal.flush()

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
