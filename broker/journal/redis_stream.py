"""Redis streams journal: one stream entry per record, XADD in MULTI/EXEC, MAXLEN retention.

Batches and config records go to the stream key; directives, when journaled, to
``KEY:directives``. Entry
fields: ``k`` record kind, ``v`` schema major, ``g`` config generation, ``d`` the payload
bytes exactly as received; the last entry each write adds to a key also carries ``s``,
``EPOCH:SEQ`` (hex epoch, decimal seq), so a writer can tell after a failure what Redis
holds (broker.journal.spool: exactly once, in order, spooled locally while Redis is down).
Readers ignore ``s``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from broker.journal.records import JournalError, JournalRecord, RecordKind
from broker.journal.spool import SpooledJournal, spool_file_name


def directives_key(stream: str) -> str:
    return f"{stream}:directives"


def _fields(record: JournalRecord) -> dict[Any, Any]:
    return {b"k": int(record.kind), b"v": record.schema_major, b"g": record.generation, b"d": record.payload}


def _record(fields: dict[bytes, bytes], where: str) -> JournalRecord:
    try:
        return JournalRecord(RecordKind(int(fields[b"k"])), int(fields[b"v"]), int(fields[b"g"]), bytes(fields[b"d"]))
    except (KeyError, ValueError) as exc:
        raise JournalError(f"{where}: malformed journal entry ({exc})") from exc


class RedisJournal(SpooledJournal):
    def __init__(
        self,
        url: str,
        stream: str,
        *,
        maxlen: int,
        max_group: int = 512,
        spool_dir: str = "",
        spool_max_bytes: int = 1 << 30,
        spool_full: str = "refuse",
        fsync: bool = False,
    ) -> None:
        super().__init__(
            max_group,
            spool_dir=spool_dir,
            spool_name=spool_file_name(stream),
            spool_max_bytes=spool_max_bytes,
            spool_full=spool_full,
            fsync=fsync,
        )
        self.url = url
        self.stream = stream
        self.maxlen = maxlen
        self._redis: aioredis.Redis | None = None

    @property
    def description(self) -> str:
        return f"{redact(self.url)} stream {self.stream}"

    async def _open_backend(self) -> None:
        # No retries inside redis-py: a write retried after a lost reply would be applied
        # twice. The writer retries, after reading back what Redis holds.
        self._redis = aioredis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=5, retry=Retry(NoBackoff(), 0))

    def _key(self, record: JournalRecord) -> str:
        return directives_key(self.stream) if record.kind == RecordKind.DIRECTIVES else self.stream

    async def _write_tagged(self, group: list[JournalRecord], epoch: bytes, last_seq: int) -> None:
        assert self._redis is not None
        last_of_key = {self._key(record): i for i, record in enumerate(group)}
        tagged = set(last_of_key.values())
        first_seq = last_seq - len(group) + 1
        pipe = self._redis.pipeline(transaction=True)
        for i, record in enumerate(group):
            fields = _fields(record)
            if i in tagged:
                fields[b"s"] = f"{epoch.hex()}:{first_seq + i}"
            pipe.xadd(self._key(record), fields, maxlen=self.maxlen, approximate=True)
        await pipe.execute()

    async def _applied(self, epoch: bytes) -> int | None:
        assert self._redis is not None
        pipe = self._redis.pipeline(transaction=False)
        for key in (self.stream, directives_key(self.stream)):
            pipe.xrevrange(key, max="+", min="-", count=1)
        prefix = epoch.hex().encode() + b":"
        newest: int | None = None
        for rows in await pipe.execute():
            for _, fields in rows:
                tag = fields.get(b"s", b"")
                if tag.startswith(prefix):
                    seq = int(tag[len(prefix) :])
                    newest = seq if newest is None else max(newest, seq)
        return newest

    async def _close_backend(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None


def redact(url: str) -> str:
    """The URL without its password, for logs and status."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"


def read_redis_records(url: str, key: str, *, chunk: int = 5000) -> Iterator[JournalRecord]:
    """The records of one journal stream (batches: the stream key; directives:
    ``directives_key(key)``), oldest first, read in chunks."""
    client = redis.Redis.from_url(url, socket_timeout=10)
    try:
        start: bytes = b"-"
        while True:
            rows = cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(key, min=start, max="+", count=chunk))
            for raw_id, fields in rows:
                yield _record(fields, f"{key}/{raw_id.decode()}")
            if len(rows) < chunk:
                return
            start = b"(" + rows[-1][0]
    finally:
        client.close()


def stream_exists(url: str, key: str) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=10)
    try:
        return bool(client.exists(key))
    finally:
        client.close()
