"""Redis streams journal: one stream entry per record, XADD pipelined, MAXLEN retention.

Batches and config records go to the stream key; directives, when journaled, to
``KEY:directives``. Entry
fields: ``k`` record kind, ``v`` schema major, ``g`` config generation, ``d`` the payload
bytes exactly as received.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import redis
import redis.asyncio as aioredis

from broker.journal.base import Journal
from broker.journal.records import JournalError, JournalRecord, RecordKind


def directives_key(stream: str) -> str:
    return f"{stream}:directives"


def _fields(record: JournalRecord) -> dict[Any, Any]:
    return {b"k": int(record.kind), b"v": record.schema_major, b"g": record.generation, b"d": record.payload}


def _record(fields: dict[bytes, bytes], where: str) -> JournalRecord:
    try:
        return JournalRecord(RecordKind(int(fields[b"k"])), int(fields[b"v"]), int(fields[b"g"]), bytes(fields[b"d"]))
    except (KeyError, ValueError) as exc:
        raise JournalError(f"{where}: malformed journal entry ({exc})") from exc


class RedisJournal(Journal):
    def __init__(self, url: str, stream: str, *, maxlen: int, max_group: int = 512) -> None:
        super().__init__(max_group)
        self.url = url
        self.stream = stream
        self.maxlen = maxlen
        self._redis: aioredis.Redis | None = None

    @property
    def description(self) -> str:
        return f"{redact(self.url)} stream {self.stream}"

    async def _open(self) -> None:
        self._redis = aioredis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=5)

    async def _write(self, group: list[JournalRecord]) -> None:
        assert self._redis is not None
        pipe = self._redis.pipeline(transaction=False)
        for record in group:
            key = directives_key(self.stream) if record.kind == RecordKind.DIRECTIVES else self.stream
            pipe.xadd(key, _fields(record), maxlen=self.maxlen, approximate=True)
        await pipe.execute()

    async def _close(self) -> None:
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
