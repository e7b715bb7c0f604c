"""The embedded default journal: an append-only local file, a length and CRC per record.

One writer per file: the broker holds an exclusive ``flock`` on ``PATH.lock`` (a file of
its own, holding the pid of the broker that has it) for as long as the journal is open. A
second broker on the same journal refuses to start and names that pid; the kernel releases
the lock when the holder dies, so a crash never leaves the journal locked (the file stays,
unlocked: the next holder takes it); a clean close removes the file.

A write that fails half way (disk full, a file-size limit) is cut off again before it is
retried: every group is written with ``pwrite`` at the offset the file had after the last
good group, and a failure truncates the file back to that offset, so a retried group never
lands after torn bytes (the spool does the same: broker.journal.spool).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import fcntl
import mmap
import os
import stat
import zlib
from collections.abc import Iterator
from typing import Any

from broker.journal.base import Journal
from broker.journal.payloads import payload_problem
from broker.journal.records import FRAME, MAGIC, MAX_RECORD, JournalError, JournalRecord, encode, scan_frames
from broker.journal.stream import good_length, stream_records
from clients.regular_file import not_regular, open_regular


def lock_path(path: str) -> str:
    return path + ".lock"


def take_lock(path: str) -> int:
    """Hold the journal's lock file (``PATH.lock``) for this process; returns its fd.

    Raises JournalError naming the other holder's pid when another process has it.

    The holder removes the file as it lets go (``release_lock``), so a clean stop leaves
    none. A process that opened the file just before it was removed could lock that removed
    file and believe it holds the journal: so a lock counts only while ``PATH.lock`` still
    names the file locked, else the file is opened again."""
    where = lock_path(path)
    while True:
        try:
            fd = os.open(where, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise JournalError(f"cannot open the journal lock {where}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise JournalError(
                f"journal {path} is in use by another broker (pid {holder}, holding {where}); "
                "two brokers must not write one journal: stop that one or give this one its own journal.url"
            ) from None
        if _names(where, fd):
            break
        os.close(fd)  # removed by the holder that let go meanwhile: take the new one
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _names(where: str, fd: int) -> bool:
    """Whether the path ``where`` is the file open as ``fd``."""
    try:
        st = os.stat(where)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def release_lock(path: str, fd: int) -> None:
    """Let go of the lock ``take_lock`` gave: remove ``PATH.lock`` while still holding it
    (so no other process can have locked the file being removed), then close it."""
    with contextlib.suppress(OSError):
        if _names(lock_path(path), fd):
            os.unlink(lock_path(path))
    os.close(fd)  # closing releases the flock


def open_for_append(path: str) -> tuple[int, int, int]:
    """Check the file, cut a torn tail, and return (fd, records found, end offset).

    Raises JournalError if the file is damaged before its tail.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # a FIFO's read would wait for a writer forever
            raise JournalError(f"journal {path}: {not_regular(path, mode).strerror}")
        os.set_blocking(fd, True)
        with open(fd, "rb", closefd=False) as f:
            count, good, size = good_length(f, path)  # as a stream: the file is never held whole
        if good < size or not size:
            # Cut the torn tail (or write the header of a new file) before appending.
            os.ftruncate(fd, good)
            if good == 0:
                os.pwrite(fd, MAGIC, 0)
                good = len(MAGIC)
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd, count, good


def read_file_journal(path: str) -> Iterator[JournalRecord]:
    """All complete records of a file journal, in order (a torn tail is ignored), read as a
    stream (broker.journal.stream: one record in memory at a time)."""
    for _, record in stream_records(path):
        yield record


def file_records(path: str) -> Iterator[tuple[int, JournalRecord]]:
    """(byte offset, record) of every complete record of a file journal, in order."""
    return stream_records(path)


@dataclasses.dataclass(frozen=True)
class TornTail:
    """A file journal's tail that is no whole record (a write cut short): readers stop
    before it."""

    records_kept: int
    offset: int
    bytes_cut: int


def torn_tail(path: str) -> TornTail | None:
    """The torn tail of a file journal, or None when it ends with a whole record."""
    with open(path, "rb") as f:
        count, good, size = good_length(f, path)
    if good >= size or good == 0:  # whole, or no header yet (a read says what is wrong)
        return None
    return TornTail(count, good, size - good)


@dataclasses.dataclass(frozen=True)
class Repair:
    """What ``repair_file_journal`` found (and, when asked to write, did)."""

    records_kept: int
    # Records dropped because they repeat, byte for byte, the ones just before a tear (the
    # retried group of a journal written before torn writes were cut back).
    records_repeated: int
    # Torn bytes cut: (offset, length) of each damaged stretch, in file order (a bad
    # record's frame among them).
    cuts: tuple[tuple[int, int], ...]
    # Records with a sound frame and checksum whose payload is not what their kind says
    # (broker.journal.payloads): (offset, why), each cut whole.
    bad_records: tuple[tuple[int, str], ...] = ()

    @property
    def bytes_cut(self) -> int:
        return sum(n for _, n in self.cuts)


def _next_frame(data: Any, pos: int) -> int:
    """The first offset after ``pos`` where an intact frame starts, or len(data). A
    candidate's checksum is taken over a view of the file, not a copy: a torn stretch's
    bytes read as lengths of up to MAX_RECORD would otherwise copy that much per offset."""
    view = memoryview(data)
    try:
        for start in range(pos + 1, len(data) - FRAME.size + 1):
            length, crc = FRAME.unpack_from(data, start)
            body = start + FRAME.size
            if length > MAX_RECORD or body + length > len(data) or zlib.crc32(view[body : body + length]) != crc:
                continue
            try:
                if scan_frames(data, start, "", limit=1)[0]:
                    return start
            except JournalError:
                continue
        return len(data)
    finally:
        view.release()


def _frames(data: Any, pos: int, room: _Kept) -> tuple[int, tuple[int, str] | None]:
    """Intact frames from ``pos`` to the first damaged one, each given to ``room`` as its
    (start, end) offsets; the offset reached and, when the damaged one is a sound frame
    whose payload is bad, its end and why."""
    while pos < len(data):
        try:
            got, end = scan_frames(data, pos, "", limit=1)
        except JournalError:
            break
        if not got:
            break
        problem = payload_problem(got[0])
        if problem is not None:
            return pos, (end, problem)
        room.add(pos, end)
        pos = end
    return pos, None


# A group retried after a tear repeats at most this many records (a write group is at most
# FileJournal's max_group, 512): the records kept before a tear that a repeat is looked for in.
RETRY_WINDOW = 4096
# Pages of the file already read are let go every this many bytes (the file is mapped, not
# read into memory: repair --check of a 2 GiB journal held it whole, twice, at 6 GiB RSS).
RELEASE_BYTES = 64 << 20


class _Kept:
    """The records a repair keeps, as runs of offsets into the mapped file (no record's bytes
    are held), and the last RETRY_WINDOW of them, for the repeat after a tear."""

    def __init__(self, data: Any) -> None:
        self.data = data
        self.runs: list[list[int]] = []
        self.count = 0
        self.recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=RETRY_WINDOW)
        self.pending: list[tuple[int, int]] = []  # frames right after a tear, not yet checked
        self.after_tear = False
        self.repeated = 0
        self.released = 0

    def add(self, start: int, end: int) -> None:
        if self.after_tear and len(self.pending) < RETRY_WINDOW:
            self.pending.append((start, end))  # may be the retried group: decided at settle()
            return
        self.settle()
        self._keep(start, end)

    def settle(self) -> None:
        """Frames after a tear that repeat, byte for byte, the ones right before it are the
        retried group: kept once."""
        if not self.after_tear:
            return
        self.after_tear = False
        frames, self.pending = self.pending, []
        last = list(self.recent)[-len(frames) :] if frames else []
        view = memoryview(self.data)  # compared in place: no record's bytes copied
        try:
            same = next(
                (
                    n
                    for n in range(min(len(last), len(frames)), 0, -1)
                    if all(view[a:b] == view[c:d] for (a, b), (c, d) in zip(last[-n:], frames[:n], strict=True))
                ),
                0,
            )
        finally:
            view.release()
        self.repeated += same
        for start, end in frames[same:]:
            self._keep(start, end)

    def _keep(self, start: int, end: int) -> None:
        if self.runs and self.runs[-1][1] == start:
            self.runs[-1][1] = end
        else:
            self.runs.append([start, end])
        self.count += 1
        self.recent.append((start, end))
        if end - self.released >= RELEASE_BYTES:
            _release(self.data, self.released, end)
            self.released = end


def _release(data: Any, start: int, end: int) -> None:
    """Let the kernel drop the mapped pages of [start, end) (clean file pages: read again
    from the file if needed); page-aligned inward."""
    page = mmap.PAGESIZE
    first = -(-start // page) * page
    last = end // page * page
    if last > first and hasattr(data, "madvise"):
        data.madvise(mmap.MADV_DONTNEED, first, last - first)


def repair_file_journal(path: str, *, write: bool) -> Repair:
    """Keep every intact record of a damaged journal, in order; cut the torn bytes.

    A tear is a stretch that is no record (a write cut short and not cut back, as this
    journal did before it cut failed writes back). After it, scanning resumes at the next
    offset where an intact record starts. Records right after a tear that repeat the ones
    right before it byte for byte are the group that was retried after the failed write:
    they are kept once. A record whose checksum is right but whose payload is not what its
    kind says (broker.journal.payloads) is cut whole, and the records after it are kept.
    With ``write`` the file is replaced (a new file renamed over it,
    so a crash leaves the old or the new, never half of each).

    The file is mapped and read in order, its pages let go behind the scan: memory stays
    bounded whatever the journal's size (offsets of the kept runs, one per tear)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise JournalError(f"{path} is empty (0 bytes): no records; nothing to repair")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _repair(path, data, write)


def _repair(path: str, data: Any, write: bool) -> Repair:
    if data[: len(MAGIC)] != MAGIC:
        raise JournalError(f"{path}: not a kvbroker journal (bad magic); nothing to repair")
    room = _Kept(data)
    cuts: list[tuple[int, int]] = []
    bad: list[tuple[int, str]] = []
    pos = len(MAGIC)
    while True:
        pos, bad_frame = _frames(data, pos, room)
        room.settle()
        if bad_frame is not None:
            end, why = bad_frame
            cuts.append((pos, end - pos))
            bad.append((pos, why))
            pos = end
            continue
        if pos >= len(data):
            break
        resume = _next_frame(data, pos)
        cuts.append((pos, resume - pos))
        pos, room.after_tear = resume, True
    if write and cuts:
        tmp = path + ".repair"
        view = memoryview(data)  # written from the mapping, not copied
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC)
                for start, end in room.runs:
                    for at in range(start, end, RELEASE_BYTES):
                        stop = min(end, at + RELEASE_BYTES)
                        f.write(view[at:stop])
                        _release(data, at, stop)
                f.flush()
                os.fsync(f.fileno())
        finally:
            view.release()
        os.replace(tmp, path)
    return Repair(room.count, room.repeated, tuple(cuts), tuple(bad))


class FileJournal(Journal):
    def __init__(self, path: str, *, fsync: bool = False, max_group: int = 512, inline: bool = False) -> None:
        """``inline``: write from the event loop's own thread, for a loop that serves nothing
        else (the embedded journal thread): no executor is needed, so writes still work at
        interpreter exit, when concurrent.futures refuses new work."""
        super().__init__(max_group)
        self.path = path
        self.fsync = fsync
        self.inline = inline
        self._fd = -1
        self._lock_fd = -1
        # Where the next group goes: the end of the last good write.
        self._offset = 0
        self.records_at_open = 0
        # Bytes of failed writes cut off again (a disk that filled, a file-size limit).
        self.torn_bytes_cut = 0

    @property
    def description(self) -> str:
        return f"file://{self.path}"

    async def _open(self) -> None:
        self._lock_fd = take_lock(self.path)
        try:
            self._fd, self.records_at_open, self._offset = open_for_append(self.path)
        except BaseException:
            self._release_lock()
            raise

    def _write_sync(self, data: bytes) -> None:
        view = memoryview(data)
        offset = self._offset
        try:
            while view:
                n = os.pwrite(self._fd, view, offset)
                view = view[n:]
                offset += n
            if self.fsync:
                os.fsync(self._fd)
        except OSError:
            # Cut what this group wrote so far: the retry starts at the same good offset.
            if offset > self._offset:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, self._offset)
                    self.torn_bytes_cut += offset - self._offset
            raise
        self._offset = offset

    async def _write(self, group: list[JournalRecord]) -> None:
        data = b"".join(encode(r) for r in group)
        if self.inline:
            self._write_sync(data)
            return
        # A slow disk must not stall the event loop that serves the streams.
        await asyncio.to_thread(self._write_sync, data)

    async def _close(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
        self._release_lock()

    def _release_lock(self) -> None:
        if self._lock_fd >= 0:
            release_lock(self.path, self._lock_fd)  # a clean stop leaves no PATH.lock
            self._lock_fd = -1
