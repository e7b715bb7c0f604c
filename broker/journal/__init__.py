"""Journals: where every accepted batch goes, in apply order.

URLs: ``file://PATH`` (the embedded default, no server needed), ``redis://HOST:PORT/DB``
(also ``rediss://`` and ``unix://``), ``redis+cluster://HOST:PORT[,HOST:PORT...]`` (a Redis
Cluster: broker.journal.cluster), or ``none``. For reading, a Redis URL may name the
stream with ``?stream=KEY``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from broker.journal.base import Journal, NullJournal
from broker.journal.cluster import RedisClusterJournal
from broker.journal.file import FileJournal, file_records, read_file_journal
from broker.journal.records import JournalError, JournalRecord, RecordKind
from broker.journal.redis_stream import DEFAULT_TIMEOUT_S, RedisJournal, directives_key, read_redis_records, redact, stream_exists
from broker.journal.redis_urls import is_cluster_url, is_redis_url
from broker.journal.stream import last_snapshot, stream_records
from clients.regular_file import open_regular

__all__ = [
    "Journal",
    "JournalError",
    "JournalRecord",
    "JournalSource",
    "RecordKind",
    "open_journal",
    "open_source",
]


def file_path(url: str) -> str:
    """``file://relative/path`` and ``file:///abs/path`` both name a path; so does a bare path."""
    return url[len("file://") :] if url.startswith("file://") else url


def split_redis_url(url: str) -> tuple[str, str | None]:
    """(connection URL, stream key or None) from a URL that may carry ``?stream=KEY``."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    stream = next((v for k, v in query if k == "stream"), None)
    rest = urlencode([(k, v) for k, v in query if k != "stream"])
    return urlunsplit((parts.scheme, parts.netloc, parts.path, rest, parts.fragment)), stream


def open_journal(
    url: str,
    *,
    stream: str,
    maxlen: int,
    fsync: bool,
    max_group: int,
    spool_dir: str = "",
    spool_max_bytes: int = 1 << 30,
    spool_full: str = "refuse",
    wait_replicas: int = 1,
    redis_timeout_s: float = DEFAULT_TIMEOUT_S,
    inline_file: bool = False,
    lease_s: float = 0.0,
    holder: str = "",
) -> Journal:
    """The journal a broker writes to, not yet started. ``spool_*``: the local spool of a
    Redis journal for Redis outages (broker.journal.spool; ``spool_dir`` "" = none).
    ``inline_file``: a file journal writes from the loop's thread (FileJournal ``inline``).
    ``wait_replicas``: a Redis Cluster journal's write counts once this many replicas hold it.
    ``lease_s``: a Redis journal holds its stream's lease as ``holder`` (broker.journal.lease;
    0: none)."""
    if url == "none":
        return NullJournal(max_group)
    if is_redis_url(url):
        conn, key = split_redis_url(url)
        if is_cluster_url(url):
            return RedisClusterJournal(
                conn,
                key or stream,
                wait_replicas=wait_replicas,
                maxlen=maxlen,
                max_group=max_group,
                spool_dir=spool_dir,
                spool_max_bytes=spool_max_bytes,
                spool_full=spool_full,
                fsync=fsync,
                lease_s=lease_s,
                holder=holder,
            )
        return RedisJournal(
            conn,
            key or stream,
            maxlen=maxlen,
            max_group=max_group,
            spool_dir=spool_dir,
            spool_max_bytes=spool_max_bytes,
            spool_full=spool_full,
            fsync=fsync,
            timeout_s=redis_timeout_s,
            lease_s=lease_s,
            holder=holder,
        )
    if is_file_url(url):
        return FileJournal(file_path(url), fsync=fsync, max_group=max_group, inline=inline_file)
    raise JournalError(unknown_scheme(url))


def is_file_url(url: str) -> bool:
    """``file://PATH``, or a bare path (no scheme): what replay, import and repair took, and
    so serve takes too."""
    return url.startswith("file://") or "://" not in url


def unknown_scheme(url: str) -> str:
    return f"journal URL {redact(url)!r}: expected file://PATH (or a path), redis://HOST:PORT/DB, redis+cluster://HOST:PORT or none"


@dataclasses.dataclass(frozen=True)
class JournalSource:
    """A journal to read back: its batches, and the directives the broker sent, if kept."""

    url: str
    stream: str | None = None

    def _redis(self) -> tuple[str, str]:
        conn, key = split_redis_url(self.url)
        key = key or self.stream
        if not key:
            raise JournalError(f"{redact(self.url)}: name the stream (?stream=KEY or --stream)")
        return conn, key

    def check(self) -> None:
        """Fail early, with the reason, if the journal is not there."""
        if is_redis_url(self.url):
            conn, key = self._redis()
            if not stream_exists(conn, key):
                raise JournalError(f"{redact(conn)}: stream {key!r} does not exist")
        else:
            path = file_path(self.url)
            try:
                with open_regular(path) as f:  # not a FIFO: replay would wait for a writer forever
                    empty = not f.read(1)
            except OSError as exc:
                raise JournalError(f"cannot open journal {path}: {exc.strerror}") from exc
            if empty:  # as `repair` says it: a replay of it would print a table of nothing
                raise JournalError(f"{path} is empty (0 bytes): no records")

    def _records(self, kind: RecordKind) -> Iterator[JournalRecord]:
        if is_redis_url(self.url):
            conn, key = self._redis()
            stream = directives_key(key) if kind == RecordKind.DIRECTIVES else key
            for record in read_redis_records(conn, stream):
                if record.kind == kind:
                    yield record
            return
        for record in read_file_journal(file_path(self.url)):
            if record.kind == kind:
                yield record

    def ordered(self) -> Iterator[JournalRecord]:
        """BATCH and CONFIG records in the order the broker wrote them (what replay and
        recovery follow: a config change applies between the batches around it)."""
        if is_redis_url(self.url):
            conn, key = self._redis()
            records = read_redis_records(conn, key)
        else:
            records = read_file_journal(file_path(self.url))
        for record in records:
            if record.kind == RecordKind.BATCH or record.kind == RecordKind.CONFIG:
                yield record

    def recovery(self) -> Iterator[JournalRecord]:
        """What a restart applies: ``ordered()``, or for a file journal with a complete
        snapshot (broker.journal.snapshots) its state record, then the BATCH and CONFIG
        records after its mark; the records before the mark are not read."""
        if is_redis_url(self.url):
            yield from self.ordered()
            return
        path = file_path(self.url)
        snapshot = last_snapshot(path)
        if snapshot is None:
            yield from self.ordered()
            return
        mark, state = snapshot
        for _, record in stream_records(path, start=state):
            yield record  # the state record
            break
        for offset, record in stream_records(path, start=mark):
            if offset != state and (record.kind == RecordKind.BATCH or record.kind == RecordKind.CONFIG):
                yield record

    def where(self, index: int, kind: RecordKind | None = None) -> str:
        """Where the ``index``-th (0-based) record of ``ordered()`` is, or of the records of
        ``kind`` (``batches()``, ``configs()``, ``directives()``): for a file, the record's
        number in the file and its byte offset, which ``kvbroker repair`` reports too. Reads
        the journal again: for an error message only."""
        if is_redis_url(self.url):
            conn, key = self._redis()
            stream = directives_key(key) if kind == RecordKind.DIRECTIVES else key
            return f"{redact(conn)} stream {stream!r}: entry {index + 1}"
        path = file_path(self.url)
        seen = -1
        for number, (offset, record) in enumerate(file_records(path), start=1):
            wanted = record.kind == kind if kind is not None else record.kind in (RecordKind.BATCH, RecordKind.CONFIG)
            seen += wanted
            if wanted and seen == index:
                return f"{path}: record {number} (a {record.kind.name} record at byte offset {offset})"
        return f"{path}: record {index + 1} of those read"

    def batches(self) -> Iterator[JournalRecord]:
        """Accepted batches, in the order the broker applied them."""
        return self._records(RecordKind.BATCH)

    def configs(self) -> Iterator[JournalRecord]:
        """CONFIG records (core config as JSON), in the order written."""
        return self._records(RecordKind.CONFIG)

    def trailers(self) -> Iterator[JournalRecord]:
        """TRAILER records (broker.journal.trailer): each writer's count, written as it closed."""
        return self._records(RecordKind.TRAILER)

    def directives(self) -> Iterator[JournalRecord]:
        """DirectiveBatch records, one per batch that produced directives, in apply order."""
        return self._records(RecordKind.DIRECTIVES)


def open_source(url: str, stream: str | None = None) -> JournalSource:
    if url == "none":
        raise JournalError("journal 'none' keeps nothing to replay")
    if not is_redis_url(url) and not is_file_url(url):
        raise JournalError(unknown_scheme(url))
    return JournalSource(url, stream)
