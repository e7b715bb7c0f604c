"""Redis streams journal: one stream entry per record, XADD in MULTI/EXEC, MAXLEN retention.

Batches and config records go to the stream key; directives, when journaled, to
``KEY:directives``. Entry
fields: ``k`` record kind, ``v`` schema major, ``g`` config generation, ``d`` the payload
bytes exactly as received; the last entry each write adds to a key also carries ``s``,
``EPOCH:SEQ`` (hex epoch, decimal seq), so a writer can tell after a failure what Redis
holds (broker.journal.spool: exactly once, in order, spooled locally while Redis is down).
Readers ignore ``s``.

The writer sends each group as one packed RESP buffer (MULTI, one XADD per record, EXEC) on
a connection of its own and reads the replies back itself: redis-py's pipeline (packing each
command, parsing each QUEUED reply, a timer per reply) was most of the writer's cost in the
broker's process, which also serves the requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Iterable, Iterator
from typing import Any, cast

import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from broker.journal.lease import StreamLease
from broker.journal.records import JournalError, JournalRecord, RecordKind
from broker.journal.redis_urls import redact_url as redact
from broker.journal.redis_urls import sync_client
from broker.journal.spool import SpooledJournal, spool_file_name

log = logging.getLogger("kvbroker.journal")

# Bounds every socket operation of the read-back client, and each whole group exchange
# (send, then every reply) of the writer.
# journal.redis_timeout_s: a hung Redis (up, not answering) stalls every answer this long
# before the spool takes over (ack_after = "journal"); it was a fixed 5 s.
DEFAULT_TIMEOUT_S = 0.5
# Connecting, and the read-back after a failure, get at least this long.
CONNECT_TIMEOUT_MIN_S = 2.0
# The Redis Cluster journal's bound (broker.journal.cluster): journal.redis_timeout_s is not
# applied there yet, nor the kill of a timed-out writer connection before its read-back.
SOCKET_TIMEOUT_S = 5.0
_MULTI = b"*1\r\n$5\r\nMULTI\r\n"
_EXEC = b"*1\r\n$4\r\nEXEC\r\n"
_CRLF = b"\r\n"


def directives_key(stream: str) -> str:
    return f"{stream}:directives"


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(arg), arg)


def _command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(_bulk(arg) for arg in args)


def _transaction(commands: Iterable[bytes]) -> bytes:
    return b"".join((_MULTI, *commands, _EXEC))


def _xadd_head(key: bytes, maxlen: int, *, tagged: bool) -> bytes:
    """``XADD KEY MAXLEN ~ N *``, the part every entry of a key shares; the argument count
    covers the fields that follow (k, v, g, d, and s when ``tagged``)."""
    args = (b"XADD", key, b"MAXLEN", b"~", b"%d" % maxlen, b"*")
    return b"*%d\r\n" % (len(args) + 2 * (5 if tagged else 4)) + b"".join(_bulk(arg) for arg in args)


@functools.lru_cache(maxsize=64)
def _record_head(kind: int, schema_major: int, generation: int) -> bytes:
    """Fields k, v, g and the name of d: the same for almost every record of a broker run."""
    return b"".join(_bulk(arg) for arg in (b"k", b"%d" % kind, b"v", b"%d" % schema_major, b"g", b"%d" % generation, b"d"))


def _tag(epoch_hex: bytes, seq: int) -> bytes:
    return _CRLF + _bulk(b"s") + _bulk(b"%b:%d" % (epoch_hex, seq))


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
        timeout_s: float = DEFAULT_TIMEOUT_S,
        lease_s: float = 0.0,
        holder: str = "",
    ) -> None:
        """``timeout_s`` (journal.redis_timeout_s): the longest a write (one MULTI/EXEC) or a
        connect may take before Redis counts as unreachable and records go to the spool.
        ``lease_s`` (journal.lease_s; 0: none): hold the stream's lease (broker.journal.lease)
        as ``holder``, so that no other writer with a lease writes the stream meanwhile."""
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
        self.timeout_s = timeout_s
        # Connecting (a TLS handshake, AUTH) may take longer than one write on a loaded host.
        self.connect_timeout_s = max(timeout_s, CONNECT_TIMEOUT_MIN_S)
        self._redis: aioredis.Redis | None = None
        self._conn: AbstractConnection | None = None  # the writer's own connection
        # Redis's id of that connection (CLIENT ID), and those of writer connections thrown
        # away after a failure: killed before the next read-back (see _applied).
        self._writer_id: int | None = None
        self._stale_writers: list[int] = []
        self._kill_refused = False
        self._heads: dict[tuple[bool, bool], bytes] = {}  # (directives?, tagged?) -> XADD head
        self._keys: tuple[bytes, bytes] = (b"", b"")  # stream, directives
        # Entries of a group that failed inside EXEC that are still to be deleted again (key ->
        # ids): the read-back must not see them (see _undo_partial).
        self._undo: dict[bytes, list[bytes]] = {}
        self.lease = StreamLease(stream, holder, lease_s, timeout_s) if lease_s > 0 else None

    @property
    def description(self) -> str:
        return f"{redact(self.url)} stream {self.stream}"

    def refusal(self, nbytes: int) -> str | None:
        if self.lease is not None and self.lease.lost:  # another broker writes the stream now
            return f"journal unavailable: {self.lease.lost}; batch not applied"
        return super().refusal(nbytes)

    async def _release_lease(self) -> None:
        if self.lease is not None:
            await self.lease.release()

    async def _open_backend(self) -> None:
        # No retries inside redis-py: a write retried after a lost reply would be applied
        # twice. The writer retries, after reading back what Redis holds.
        self._redis = aioredis.Redis.from_url(
            self.url, socket_timeout=self.timeout_s, socket_connect_timeout=self.connect_timeout_s, retry=Retry(NoBackoff(), 0)
        )
        encoder = self._redis.connection_pool.get_encoder()
        self._keys = (encoder.encode(self.stream), encoder.encode(directives_key(self.stream)))
        self._heads = {
            (directives, tagged): _xadd_head(self._keys[directives], self.maxlen, tagged=tagged)
            for directives in (False, True)
            for tagged in (False, True)
        }
        if self.lease is not None:
            await self.lease.acquire(self._redis)  # before a leftover spool drains into the stream

    async def _write_tagged(self, group: list[JournalRecord], epoch: bytes, last_seq: int) -> None:
        if not group:
            return
        if self.lease is not None:
            await self.lease.ensure()  # never a write while another broker may hold the stream
        if self._undo:  # normally finished by the read-back, unless a drop skipped it
            await self._finish_undo()
        buffer, keys = self._pack_group(group, epoch, last_seq)
        replies = await self._transact(buffer, len(group))
        for i, reply in enumerate(replies):
            if isinstance(reply, Exception):
                await self._undo_partial(keys, replies)
                await self._discard_writer_connection()  # any failed write starts over on a new connection
                raise type(reply)(f"XADD {keys[i].decode(errors='replace')} (record {i + 1} of {len(group)}) failed in EXEC: {reply}")

    def _pack_group(self, group: list[JournalRecord], epoch: bytes, last_seq: int) -> tuple[bytes, list[bytes]]:
        """The group as one MULTI, XADD..., EXEC buffer, byte for byte what redis-py's
        ``xadd(key, fields, maxlen=maxlen, approximate=True)`` sends; and each record's key."""
        directives = [record.kind == RecordKind.DIRECTIVES for record in group]
        last_of_key = {d: i for i, d in enumerate(directives)}
        tagged = set(last_of_key.values())
        epoch_hex = epoch.hex().encode()
        first_seq = last_seq - len(group) + 1
        parts = [_MULTI]
        for i, record in enumerate(group):
            is_tagged = i in tagged
            payload = record.payload
            parts += (
                self._heads[directives[i], is_tagged],
                _record_head(record.kind, record.schema_major, record.generation),
                b"$%d\r\n" % len(payload),
                payload,
                _tag(epoch_hex, first_seq + i) if is_tagged else _CRLF,
            )
        parts.append(_EXEC)
        return b"".join(parts), [self._keys[d] for d in directives]

    async def _transact(self, buffer: bytes, commands: int) -> list[Any]:
        """Send one packed MULTI ... EXEC of ``commands`` commands and return EXEC's replies
        (errors of single commands among them). Raises on anything else: a lost connection,
        the deadline, an error reply (a command refused while queued makes EXEC abort, so
        nothing was applied). A failed exchange discards the connection: its reply stream
        may be half read."""
        conn = self._writer_connection()
        try:
            # One deadline for the whole exchange, not a timer per reply: the writer's
            # connection has no socket timeout of its own.
            if self._writer_id is None:
                # A new connection: connect (TLS, AUTH, SELECT) within the connect bound, and
                # learn its id (for _applied).
                async with asyncio.timeout(self.connect_timeout_s):
                    await conn.connect()
                    await conn.send_command("CLIENT", "ID")
                    self._writer_id = int(await conn.read_response())
            async with asyncio.timeout(self.timeout_s):
                await conn.send_packed_command(buffer)
                for _ in range(commands + 1):
                    await conn.read_response()  # +OK to MULTI, then +QUEUED for each command
                replies = await conn.read_response()
            if not isinstance(replies, list) or len(replies) != commands:
                raise redis.ResponseError(f"EXEC answered {replies!r:.100}, expected {commands} replies")
        except TimeoutError as exc:
            await self._discard_writer_connection()
            raise redis.TimeoutError(
                f"no complete answer from Redis within {self.timeout_s}s (journal.redis_timeout_s) to a transaction of {commands} commands"
            ) from exc
        except BaseException:
            await self._discard_writer_connection()
            raise
        return replies

    def _writer_connection(self) -> AbstractConnection:
        """The writer's connection, made by the client's pool from the same URL (TLS, AUTH,
        db) but never shared; it connects on first use."""
        if self._conn is None:
            assert self._redis is not None
            conn = self._redis.connection_pool.make_connection()
            conn.socket_timeout = None  # _transact bounds the whole exchange instead
            self._conn = conn
        return self._conn

    async def _discard_writer_connection(self) -> None:
        conn, self._conn = self._conn, None
        if self._writer_id is not None:
            self._stale_writers.append(self._writer_id)
            self._writer_id = None
        if conn is not None:
            with contextlib.suppress(Exception):  # it is being thrown away: a close error changes nothing
                await conn.disconnect(nowait=True)

    async def _undo_partial(self, keys: list[bytes], replies: list[Any]) -> None:
        """Delete again the entries a failed group did add. Redis runs the other commands of
        a transaction when one fails inside EXEC (WRONGTYPE on one key): left there, a tagged
        entry could make the read-back skip the records that failed. Raises nothing; an undo
        that fails is retried before the next read-back (``_applied``)."""
        for key, reply in zip(keys, replies, strict=True):
            if not isinstance(reply, Exception):
                self._undo.setdefault(key, []).append(reply)
        try:
            await self._finish_undo()
        except Exception as exc:
            log.error(
                "journal %s: the entries of a failed write could not be deleted again yet (%s: %s); the next read-back does it first",
                self.description,
                type(exc).__name__,
                exc,
            )

    async def _finish_undo(self) -> None:
        if not self._undo:
            return
        replies = await self._transact(_transaction(_command(b"XDEL", key, *ids) for key, ids in self._undo.items()), len(self._undo))
        errors = [reply for reply in replies if isinstance(reply, Exception)]
        if errors:
            raise errors[0]
        self._undo = {}

    async def _applied(self, epoch: bytes) -> int | None:
        """The newest seq of ``epoch`` Redis holds.

        A transaction whose answer timed out may still be waiting, unread, in Redis's buffer
        of the connection that sent it (a Redis frozen by SIGSTOP or swapping): it would run
        whenever Redis reads that connection again, possibly after this read-back, and the
        records it holds would then be written twice. So first the writer connections thrown
        away are killed, in the same pipeline and before the read: Redis runs a connection's
        commands in order, so the read sees that transaction applied, or it never will be."""
        assert self._redis is not None
        await self._finish_undo()
        pipe = self._redis.pipeline(transaction=False)
        stale = list(self._stale_writers)
        for client_id in stale:
            pipe.execute_command("CLIENT", "KILL", "ID", client_id)
        for key in (self.stream, directives_key(self.stream)):
            pipe.xrevrange(key, max="+", min="-", count=1)
        replies = await pipe.execute(raise_on_error=False)
        for reply in replies[len(stale) :]:
            if isinstance(reply, Exception):
                raise reply
        kills = replies[: len(stale)]
        refused = [r for r in kills if isinstance(r, Exception)]
        if refused and not self._kill_refused:
            self._kill_refused = True  # (an ACL user without CLIENT KILL): said once
            log.warning(
                "journal %s: cannot kill a timed-out writer connection (%s); a write it still holds could be applied twice",
                self.description,
                refused[0],
            )
        self._stale_writers = []
        prefix = epoch.hex().encode() + b":"
        newest: int | None = None
        for rows in replies[len(stale) :]:
            for _, fields in rows:
                tag = fields.get(b"s", b"")
                if tag.startswith(prefix):
                    seq = int(tag[len(prefix) :])
                    newest = seq if newest is None else max(newest, seq)
        return newest

    async def _close_backend(self) -> None:
        await self._release_lease()
        await self._discard_writer_connection()
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None


def read_redis_records(url: str, key: str, *, chunk: int = 5000) -> Iterator[JournalRecord]:
    """The records of one journal stream (batches: the stream key; directives:
    ``directives_key(key)``), oldest first, read in chunks."""
    client = sync_client(url, socket_timeout=10)
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
    """Whether the stream is there; a Redis that does not answer is a JournalError that says
    so (replay and a broker's recovery cannot go on without it)."""
    try:
        client = sync_client(url, socket_timeout=10)
        try:
            return bool(client.exists(key))
        finally:
            client.close()
    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
        raise JournalError(f"cannot reach Redis at {redact(url)}: {exc}") from None
