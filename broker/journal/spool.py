"""The bounded local spool of a journal whose backend (Redis) is unreachable.

While the backend cannot be written, records go to an append-only file on local disk, in
order, framed like the file journal (length, CRC32, body: broker.journal.records); a
record in the spool counts as written (fsynced first when ``journal.fsync``). When the
backend answers again the spool drains to it, oldest first, before any newer record; once
empty the file is removed. A leftover spool (the broker stopped or crashed mid-outage) is
drained first on the next start.

Spool file, little-endian: ``SPOOL_MAGIC | epoch (16 bytes) | base_seq u64``, then the
framed records. The file never grows past ``max_bytes``; a torn tail (a crash mid-append)
is cut when the file is opened again, damage before the tail refuses to open.

Exactly once, in order. Every backend write is atomic (Redis MULTI/EXEC) and tags the last
entry it adds to each key with ``epoch:seq``, the position of that record in the writer's
numbering (an epoch is a random id per writer or per spool, seq counts its records). A
failed write is ambiguous (it may have been applied before the connection broke), so after
any failure the writer first reads the newest tag back (``SpooledJournal._applied``) and
skips what the backend already holds: nothing is written twice and nothing is skipped. A
spool keeps the epoch and the seq before its first record in its header, so this holds
across restarts too.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import struct
import time
from abc import abstractmethod

from broker.journal.base import Journal
from broker.journal.records import JournalError, JournalRecord, encode, framed_size, scan_frames

log = logging.getLogger("kvbroker.journal")

SPOOL_MAGIC = b"KVBSPOL1"
HEADER = struct.Struct("<8s16sQ")
POLICIES = ("refuse", "drop")
BACKOFF_MIN = 0.05
BACKOFF_MAX = 2.0
# Repeated warnings (a drain that keeps failing, records dropped) at most this often.
LOG_EVERY_S = 10.0
READ_BLOCK = 1 << 20


def spool_file_name(key: str) -> str:
    """A file name for the spool of one journal (its stream key), safe on any filesystem."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", key)[:200] + ".spool"


class Spool:
    """One append-only spool file: bounded, CRC-framed, read back in order from a cursor.

    Synchronous; the journal calls it from a worker thread (``asyncio.to_thread``), one
    call at a time. The file exists only while it holds records not yet in the backend.
    """

    def __init__(self, directory: str, name: str, max_bytes: int, *, fsync: bool = False) -> None:
        self.directory = directory
        self.path = os.path.join(directory, name)
        self.max_bytes = max_bytes
        self.fsync = fsync
        self._fd = -1
        self.epoch = b""
        self.base_seq = 0
        self.records = 0  # records in the file
        self.size = 0  # bytes of the file
        self.drained = 0  # records at the front already in the backend
        self._read_pos = 0  # file offset of record number ``drained``
        # Set when the spool could not take a record (no room, or the disk failed: then
        # ``problem`` says how); cleared when the file is removed.
        self.full = False
        self.problem = ""

    @property
    def active(self) -> bool:
        """The file exists: it holds records the backend does not have yet."""
        return self._fd >= 0

    @property
    def undrained(self) -> int:
        return self.records - self.drained if self.active else 0

    def fits(self, nbytes: int) -> bool:
        return self.size + nbytes <= self.max_bytes

    def open_existing(self) -> int:
        """Open a spool left by an earlier run, cut a torn tail; returns its records (0 and
        no file when there is none). Raises JournalError if it is damaged before its tail
        or another process holds it."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise JournalError(f"cannot open spool {self.path}: {exc.strerror}") from exc
        try:
            self._lock(fd)
            with open(fd, "rb", closefd=False) as f:
                data = f.read()
            if len(data) < HEADER.size:
                # Torn before its header was complete: no record was ever appended.
                os.close(fd)
                fd = -1
                self._unlink()
                return 0
            magic, epoch, base = HEADER.unpack_from(data)
            if magic != SPOOL_MAGIC:
                raise JournalError(f"{self.path}: not a kvbroker spool (bad magic)")
            records, good = scan_frames(data, HEADER.size, self.path)
            if good < len(data):
                log.warning("spool %s: cut a torn tail of %d bytes", self.path, len(data) - good)
                os.ftruncate(fd, good)
                os.fsync(fd)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        self._fd = fd
        self.epoch, self.base_seq = epoch, base
        self.records, self.size = len(records), good
        self.drained, self._read_pos = 0, HEADER.size
        if not records:
            self.remove()
        return len(records)

    def create(self, epoch: bytes, base_seq: int) -> None:
        """A new, empty spool whose first record is number ``base_seq + 1`` of ``epoch``."""
        assert not self.active and len(epoch) == 16
        if HEADER.size > self.max_bytes:
            raise JournalError(f"spool {self.path}: max_bytes {self.max_bytes} is smaller than its header")
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            self._lock(fd)
            self._write_all(fd, HEADER.pack(SPOOL_MAGIC, epoch, base_seq))
            os.fsync(fd)
            self._fsync_dir()
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise
        self._fd = fd
        self.epoch, self.base_seq = epoch, base_seq
        self.records, self.size, self.drained, self._read_pos = 0, HEADER.size, 0, HEADER.size
        self.full, self.problem = False, ""

    def append(self, records: list[JournalRecord]) -> None:
        """Append in order (the caller checked ``fits``); all or nothing: a failed write is
        cut off again so the file never holds a torn record before good ones."""
        assert self.active
        data = b"".join(encode(r) for r in records)
        if not self.fits(len(data)):
            raise JournalError(f"spool {self.path}: {len(data)} more bytes exceed max_bytes {self.max_bytes}")
        try:
            self._write_all(self._fd, data, self.size)
            if self.fsync:
                os.fsync(self._fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self.size)
            raise
        self.records += len(records)
        self.size += len(data)

    def read(self, count: int) -> tuple[list[JournalRecord], int]:
        """Up to ``count`` records from the cursor, and the offset after them (for
        ``advance``); the cursor does not move."""
        assert self.active
        out: list[JournalRecord] = []
        pos = self._read_pos
        while len(out) < count and pos < self.size:
            want = min(self.size - pos, READ_BLOCK)
            data = os.pread(self._fd, want, pos)
            got, used = scan_frames(data, 0, self.path, limit=count - len(out))
            if not got:
                # A record larger than the block: read exactly that one.
                if len(data) < 4:
                    raise JournalError(f"{self.path}: short read at offset {pos}")
                length = int.from_bytes(data[:4], "little")
                data = os.pread(self._fd, 8 + length, pos)
                got, used = scan_frames(data, 0, self.path, limit=1)
                if not got:
                    raise JournalError(f"{self.path}: unreadable record at offset {pos}")
            out.extend(got)
            pos += used
        return out, pos

    def advance(self, count: int, pos: int) -> None:
        """``count`` records from the cursor (ending at offset ``pos``) are in the backend."""
        self.drained += count
        self._read_pos = pos

    def skip(self, count: int) -> None:
        """Move the cursor over ``count`` records the backend turned out to hold already."""
        while count > 0:
            got, pos = self.read(min(count, 4096))
            if not got:
                return
            self.advance(len(got), pos)
            count -= len(got)

    def remove(self) -> None:
        """Every record is in the backend: delete the file (a new outage starts a new one)."""
        if self._fd >= 0:
            self._unlink()
            os.close(self._fd)  # closing releases the lock, after the name is gone
            self._fd = -1
        self.records = self.size = self.drained = self._read_pos = 0
        self.full = False
        self.problem = ""

    def close(self) -> None:
        """Keep the file (records still to drain, next start) and release it."""
        if self._fd >= 0:
            if self.fsync:
                with contextlib.suppress(OSError):
                    os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1

    def _lock(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JournalError(f"spool {self.path} is in use by another process (two brokers with the same stream?)") from None

    def _unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        with contextlib.suppress(OSError):
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    @staticmethod
    def _write_all(fd: int, data: bytes, offset: int = 0) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, offset)
            view = view[n:]
            offset += n


class SpooledJournal(Journal):
    """A journal over a remote backend, with a bounded local spool for its outages.

    Subclasses implement ``_write_tagged`` (one atomic write that tags its last entry per
    key with ``epoch:seq``) and ``_applied`` (the newest seq of an epoch the backend holds).
    Without a spool directory, records wait in memory while the backend is down (and the
    answers wait with them under ``ack_after = "journal"``), as a plain Journal does.
    """

    def __init__(
        self,
        max_group: int = 512,
        *,
        spool_dir: str = "",
        spool_name: str = "journal.spool",
        spool_max_bytes: int = 1 << 30,
        spool_full: str = "refuse",
        fsync: bool = False,
    ) -> None:
        super().__init__(max_group)
        if spool_full not in POLICIES:
            raise JournalError(f'spool_full: must be "refuse" or "drop", got {spool_full!r}')
        self.spool = Spool(spool_dir, spool_name, spool_max_bytes, fsync=fsync) if spool_dir else None
        self.spool_full = spool_full
        self.spooled = 0  # records put in the spool
        self.drained = 0  # records that left the spool for the backend (written, or found there already)
        self.unreachable = False  # the last backend write failed
        self._epoch = os.urandom(16)
        self._seq = 0  # records of this epoch the backend holds
        self._synced = True  # False after a failure: read back what the backend holds first
        self._queued_bytes = 0
        self._retry_at = 0.0
        self._backoff = BACKOFF_MIN
        self._last_warning = 0.0
        self._last_drop_log = -LOG_EVERY_S
        self._dropped_unlogged = 0

    # -- backend hooks -------------------------------------------------------------------

    @abstractmethod
    async def _write_tagged(self, group: list[JournalRecord], epoch: bytes, last_seq: int) -> None:
        """Write ``group`` atomically, in order; tag it so that ``_applied(epoch)`` then
        returns ``last_seq``. Raise if it may not have been applied."""

    @abstractmethod
    async def _applied(self, epoch: bytes) -> int | None:
        """The seq of the newest record of ``epoch`` the backend holds (None: none)."""

    # -- state for health, telemetry, refusal ---------------------------------------------

    @property
    def spool_bytes(self) -> int:
        return self.spool.size if self.spool is not None and self.spool.active else 0

    @property
    def spool_records(self) -> int:
        return self.spool.undrained if self.spool is not None else 0

    @property
    def saturated(self) -> bool | None:
        """The backend is unreachable and the spool cannot take more (None without a
        spool: the health watch then goes by the counters)."""
        if self.spool is None:
            return None
        return self.unreachable and self.spool.full

    def append(self, record: JournalRecord) -> int:
        self._queued_bytes += framed_size(len(record.payload))
        return super().append(record)

    def refusal(self, nbytes: int) -> str | None:
        spool = self.spool
        if spool is None or self.spool_full != "refuse" or not self.unreachable:
            return None
        if not spool.full and (not spool.active or spool.fits(self._queued_bytes + framed_size(nbytes))):
            return None
        spool.full = True
        state = (
            f"cannot be written ({spool.problem})"
            if spool.problem
            else f"is full ({spool.size} of {spool.max_bytes} bytes, journal.spool_max_bytes)"
        )
        return (
            f"journal unavailable: {self.description} is unreachable ({self.last_error or 'no answer'}) and the local "
            f"spool {spool.path} {state}; batch not applied, retry it later"
        )

    # -- the writer -----------------------------------------------------------------------

    async def _open(self) -> None:
        await self._open_backend()
        spool = self.spool
        if spool is None:
            return
        leftover = await asyncio.to_thread(spool.open_existing)
        if not leftover:
            return
        log.warning("spool %s holds %d records from an earlier run; draining them to %s first", spool.path, leftover, self.description)
        self._synced = False
        started = time.monotonic()
        try:
            while spool.active:
                await self._drain_step()
        except Exception as exc:  # the writer retries; recovery refuses to read a partial journal
            self._failed(exc, "draining the leftover spool")
        else:
            log.info("drained %d leftover spooled records to %s in %.2fs", leftover, self.description, time.monotonic() - started)

    async def _open_backend(self) -> None:
        """Prepare the backend client (no I/O needed)."""

    async def _close(self) -> None:
        if self.spool is not None and self.spool.active:
            log.warning(
                "stopping with %d spooled records not yet in %s (drained on the next start)", self.spool.undrained, self.description
            )
            await asyncio.to_thread(self.spool.close)
        await self._close_backend()

    async def _close_backend(self) -> None:
        """Release the backend client."""

    async def _write(self, group: list[JournalRecord]) -> None:  # pragma: no cover - _run is overridden
        await self._write_tagged(group, self._epoch, self._seq + len(group))

    def _take(self, n: int) -> list[JournalRecord]:
        taken = self._queue[:n]
        del self._queue[:n]
        self._queued_bytes -= sum(framed_size(len(r.payload)) for r in taken)
        return taken

    def _failed(self, exc: Exception, doing: str) -> None:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        self._synced = False
        now = time.monotonic()
        if not self.unreachable or now - self._last_warning >= LOG_EVERY_S:
            self._last_warning = now
            spooling = f"; spooling to {self.spool.path}" if self.spool is not None else "; records wait in memory"
            log.warning("journal %s unreachable while %s (%s)%s", self.description, doing, self.last_error, spooling)
        self.unreachable = True
        self._retry_at = asyncio.get_running_loop().time() + self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_MAX)

    def _reached(self, to_drain: int) -> None:
        if self.unreachable:
            log.info("journal %s reachable again (%d spooled records to drain)", self.description, to_drain)
            if self._dropped_unlogged:
                self._log_dropped()
        self.unreachable = False
        self._backoff = BACKOFF_MIN

    async def _drain_step(self) -> None:
        """Move the oldest group of spooled records to the backend (raises if it fails)."""
        spool = self.spool
        assert spool is not None and spool.active
        if not self._synced:
            applied = await self._applied(spool.epoch)
            if applied is not None and applied - spool.base_seq > spool.drained:
                # Records whose write reached the backend though its reply was lost: in the
                # backend already, so drained without being written again.
                skipped = min(applied - spool.base_seq, spool.records) - spool.drained
                await asyncio.to_thread(spool.skip, skipped)
                self.drained += skipped
            self._synced = True
        group, pos = await asyncio.to_thread(spool.read, self.max_group)
        if group:
            await self._write_tagged(group, spool.epoch, spool.base_seq + spool.drained + len(group))
            spool.advance(len(group), pos)
            self.drained += len(group)
        if spool.drained >= spool.records:
            if spool.epoch == self._epoch:
                self._seq = spool.base_seq + spool.records
                # The backend may hold more than the spool did: a write that failed
                # ambiguously whose records could not be spooled (the spool's disk refused
                # them) stayed queued. Read back before the next direct write, which then
                # skips what is already there (it wrote them twice).
                self._synced = False
            total = spool.records
            await asyncio.to_thread(spool.remove)
            log.info("spool drained: %d records now in %s; writing directly again", total, self.description)

    async def _spool_queued(self) -> None:
        """Move queued records into the spool while they fit; past that, apply the policy."""
        spool = self.spool
        assert spool is not None and spool.active
        n = nbytes = 0
        for record in self._queue:
            size = framed_size(len(record.payload))
            if not spool.fits(nbytes + size):
                break
            n += 1
            nbytes += size
        if n:
            group = self._queue[:n]
            try:
                await asyncio.to_thread(spool.append, group)
            except OSError as exc:
                spool.full = True
                spool.problem = f"{type(exc).__name__}: {exc.strerror or exc}"
                self.errors += 1
                log.error("cannot append to the spool %s (%s): treating it as full", spool.path, spool.problem)
                n = 0
            else:
                self._take(n)
                self.spooled += n
                self._settle(n)
        if self._queue and not spool.fits(framed_size(len(self._queue[0].payload))):
            spool.full = True
        if self._queue and spool.full and self.unreachable and self.spool_full == "drop":
            self._drop(len(self._queue))

    def _drop(self, n: int) -> None:
        """Give up the next ``n`` queued records (spool full, ``spool_full = "drop"``):
        counted in ``dropped`` and logged, the first at once, then at most every
        LOG_EVERY_S seconds (and when the backend is back)."""
        self._take(n)
        self.dropped += n
        self._dropped_unlogged += n
        self._settle(n)
        if time.monotonic() - self._last_drop_log >= LOG_EVERY_S:
            self._log_dropped()

    def _log_dropped(self) -> None:
        self._last_drop_log = time.monotonic()
        spool = self.spool
        assert spool is not None
        log.warning(
            "journal %s unreachable and spool %s full (%d of %d bytes): dropped %d journal records (%d in all, journal_dropped)",
            self.description,
            spool.path,
            spool.size,
            spool.max_bytes,
            self._dropped_unlogged,
            self.dropped,
            extra={"journal_dropped": self.dropped},
        )
        self._dropped_unlogged = 0

    async def _write_direct(self, group: list[JournalRecord]) -> None:
        """The group straight to the backend; after a failure, first skip what it holds."""
        if not self._synced:
            applied = await self._applied(self._epoch)
            self._synced = True
            if applied is not None and applied > self._seq:
                held = min(applied - self._seq, len(group))
                self._seq += held
                self._take(held)
                self._settle(held)
                group = group[held:]
                if not group:
                    return
        await self._write_tagged(group, self._epoch, self._seq + len(group))
        self._seq += len(group)
        self._take(len(group))
        self._settle(len(group))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            spool = self.spool
            if spool is not None and spool.active:
                if self._queue:
                    await self._spool_queued()
                if loop.time() >= self._retry_at:
                    to_drain = spool.undrained
                    try:
                        await self._drain_step()
                    except Exception as exc:
                        self._failed(exc, f"draining the spool ({spool.undrained} records)")
                        if self._closing and not self._queue:
                            self._idle.set()
                            return  # stopping while unreachable: the spool waits for the next start
                    else:
                        self._reached(to_drain)
                    continue
                if not self._queue:
                    self._idle.set()
                elif not spool.full:
                    continue
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(0.0, self._retry_at - loop.time()))
                continue
            if not self._queue:
                self._idle.set()
                if self._closing:
                    return
                self._wake.clear()
                if not self.unreachable:
                    await self._wake.wait()
                    continue
                # Unreachable with nothing to write (all dropped): probe, so that health
                # does not wait for traffic that a NOT_SERVING broker may never get.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(0.0, self._retry_at - loop.time()))
                if not self._queue:
                    try:
                        applied = await self._applied(self._epoch)
                    except Exception as exc:
                        self._failed(exc, "probing")
                    else:
                        self._seq = max(self._seq, applied or 0)
                        self._synced = True
                        self._back_to_direct(spool)
                continue
            group = self._queue[: self.max_group]
            try:
                await self._write_direct(group)
            except Exception as exc:
                self._failed(exc, "writing")
                if spool is not None:
                    try:
                        await asyncio.to_thread(spool.create, self._epoch, self._seq)
                    except (OSError, JournalError) as create_exc:
                        problem = f"{type(create_exc).__name__}: {create_exc}"
                        if problem != spool.problem:
                            log.error("cannot create the spool %s (%s): treating it as full", spool.path, problem)
                        spool.full, spool.problem = True, problem
                        if self.spool_full == "drop":
                            self._drop(len(self._queue))
                            # The failed write may or may not have been applied; its seqs
                            # are given up with it, so later writes number in a new epoch.
                            self._epoch, self._seq, self._synced = os.urandom(16), 0, True
                    else:
                        log.warning("journal %s: spooling to %s (at most %d bytes)", self.description, spool.path, spool.max_bytes)
                        continue
                await asyncio.sleep(max(0.0, self._retry_at - loop.time()))
                continue
            self._back_to_direct(spool)

    def _back_to_direct(self, spool: Spool | None) -> None:
        """The backend answers while there is no spool file: the outage is over."""
        if spool is not None and spool.full:  # a spool that could not be created
            spool.full, spool.problem = False, ""
        self._reached(0)
