"""The embedded default journal: an append-only local file, a length and CRC per record."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

from broker.journal.base import Journal
from broker.journal.records import MAGIC, JournalRecord, encode, scan


def open_for_append(path: str) -> tuple[int, int]:
    """Check the file, cut a torn tail, and return (fd, records found).

    Raises JournalError if the file is damaged before its tail.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with open(fd, "rb", closefd=False) as f:
            data = f.read()
        records, good = scan(data, path)
        if good < len(data) or not data:
            # Cut the torn tail (or write the header of a new file) before appending.
            os.ftruncate(fd, good)
            if good == 0:
                os.pwrite(fd, MAGIC, 0)
            os.fsync(fd)
        os.lseek(fd, 0, os.SEEK_END)
    except BaseException:
        os.close(fd)
        raise
    return fd, len(records)


def read_file_journal(path: str) -> Iterator[JournalRecord]:
    """All complete records of a file journal, in order (a torn tail is ignored)."""
    with open(path, "rb") as f:
        data = f.read()
    records, _ = scan(data, path)
    yield from records


class FileJournal(Journal):
    def __init__(self, path: str, *, fsync: bool = False, max_group: int = 512) -> None:
        super().__init__(max_group)
        self.path = path
        self.fsync = fsync
        self._fd = -1
        self.records_at_open = 0

    @property
    def description(self) -> str:
        return f"file://{self.path}"

    async def _open(self) -> None:
        self._fd, self.records_at_open = open_for_append(self.path)

    def _write_sync(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        if self.fsync:
            os.fsync(self._fd)

    async def _write(self, group: list[JournalRecord]) -> None:
        data = b"".join(encode(r) for r in group)
        # A slow disk must not stall the event loop that serves the streams.
        await asyncio.to_thread(self._write_sync, data)

    async def _close(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
