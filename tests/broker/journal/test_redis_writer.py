"""The Redis journal's writer: each group is one packed MULTI/XADD.../EXEC on a connection
of its own. What Redis holds afterwards must be what redis-py's pipeline wrote before; a
group is all or nothing, even when one XADD fails inside EXEC (Redis runs the others); a
lost or stuck connection raises and the next write starts on a new one; AUTH, ACL users, the
db number, TLS and unix sockets still come from the URL.

The backend hooks (``_write_tagged``, ``_applied``) are driven directly where the exact
state of Redis between two writes matters; the writer task where the spool logic does.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from broker.journal import JournalRecord, RecordKind
from broker.journal.redis_stream import RedisJournal, directives_key
from tests.certs import Authority
from tests.conftest import REDIS_URL
from tests.redis_server import RedisServer, free_port

EPOCH = bytes(range(16))
Rows = list[list[tuple[bytes, bytes]]]


def rec(i: int, kind: RecordKind = RecordKind.BATCH, size: int = 32, generation: int = 1) -> JournalRecord:
    return JournalRecord(kind, 1, generation, i.to_bytes(4, "big") + b"\r\n" + b"x" * max(0, size - 6))


def entries(client: redis.Redis, key: str) -> Rows:
    """Every entry's fields in order, as (name, value) pairs in the order Redis keeps them."""
    rows: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(key)  # type: ignore[assignment]
    return [list(fields.items()) for _, fields in rows]


def entry_ids(client: redis.Redis, key: str) -> list[bytes]:
    rows: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(key)  # type: ignore[assignment]
    return [entry_id for entry_id, _ in rows]


def key_of(stream: str, record: JournalRecord) -> str:
    return directives_key(stream) if record.kind == RecordKind.DIRECTIVES else stream


def pipeline_like_before(
    client: aioredis.Redis, stream: str, maxlen: int, group: list[JournalRecord], epoch: bytes, last_seq: int
) -> aioredis.client.Pipeline:
    """The group queued as the write path the packed writer replaced did it (redis-py's
    transaction pipeline), verbatim: the reference for what is sent and what Redis holds."""
    last_of_key = {key_of(stream, record): i for i, record in enumerate(group)}
    tagged = set(last_of_key.values())
    first_seq = last_seq - len(group) + 1
    pipe = client.pipeline(transaction=True)
    for i, record in enumerate(group):
        fields: dict[Any, Any] = {b"k": int(record.kind), b"v": record.schema_major, b"g": record.generation, b"d": record.payload}
        if i in tagged:
            fields[b"s"] = f"{epoch.hex()}:{first_seq + i}"
        pipe.xadd(key_of(stream, record), fields, maxlen=maxlen, approximate=True)
    return pipe


def mixed_groups(seed: int, count: int) -> list[list[JournalRecord]]:
    """Groups of 1 to 64 records of every kind, schema majors and generations up to 2^40,
    random payloads from empty to 70 kB (past redis-py's 6000-byte packing cutoff)."""
    rng = random.Random(seed)
    groups = []
    for _ in range(count):
        group = []
        for _ in range(rng.choice((1, 2, 5, 16, 64))):
            kind = rng.choice((RecordKind.BATCH, RecordKind.BATCH, RecordKind.DIRECTIVES, RecordKind.CONFIG))
            size = rng.choice((0, 1, 7, 40, 300, 4096)) if rng.random() < 0.97 else 70_000
            group.append(JournalRecord(kind, rng.choice((1, 2)), rng.randrange(0, 1 << 40), rng.randbytes(size)))
        groups.append(group)
    return groups


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(REDIS_URL)
    yield c
    c.close()


@pytest.fixture
def fresh_key(client: redis.Redis) -> Iterator[Callable[[], str]]:
    """Hands out fresh stream keys on the test Redis; deletes them (and their directives
    streams) afterwards."""
    made: list[str] = []

    def make() -> str:
        made.append(f"kvbroker-test:{uuid.uuid4().hex}")
        return made[-1]

    yield make
    for key in made:
        client.delete(key, directives_key(key))


@contextlib.asynccontextmanager
async def opened(journal: RedisJournal) -> AsyncIterator[RedisJournal]:
    """``journal`` with its backend open but no writer task (the test calls the hooks),
    closed afterwards."""
    await journal._open_backend()
    try:
        yield journal
    finally:
        await journal._close_backend()


@pytest.fixture
async def journal(fresh_key: Callable[[], str]) -> AsyncIterator[RedisJournal]:
    async with opened(RedisJournal(REDIS_URL, fresh_key(), maxlen=100_000)) as j:
        yield j


# ---- what goes to Redis -----------------------------------------------------------------------


async def test_the_packed_group_is_byte_for_byte_what_the_pipeline_sent(journal: RedisJournal) -> None:
    reference = aioredis.Redis.from_url(REDIS_URL)
    packer = aioredis.Connection()  # never connected: packs as the pipeline's connection did
    try:
        for group in mixed_groups(seed=3, count=12):
            pipe = pipeline_like_before(reference, journal.stream, journal.maxlen, group, EPOCH, 1000)
            commands = [("MULTI",), *(args for args, _ in pipe.command_stack), ("EXEC",)]
            buffer, keys = journal._pack_group(group, EPOCH, 1000)
            assert buffer == b"".join(bytes(part) for part in packer.pack_commands(commands))
            assert keys == [key_of(journal.stream, record).encode() for record in group]
    finally:
        await reference.aclose()


async def test_redis_holds_the_same_entries_as_after_the_pipeline_with_maxlen_trimming(
    client: redis.Redis, fresh_key: Callable[[], str]
) -> None:
    """Same fields, order, keys, tags; the same XLEN after every group, so the trimming is
    the same approximate MAXLEN (an exact one, or none, would differ somewhere)."""
    maxlen = 50
    new, old = fresh_key(), fresh_key()
    journal = RedisJournal(REDIS_URL, new, maxlen=maxlen)
    await journal._open_backend()
    reference = aioredis.Redis.from_url(REDIS_URL)
    written = longest = 0
    try:
        seq = 0
        for group in mixed_groups(seed=11, count=40):
            seq += len(group)
            await journal._write_tagged(group, EPOCH, seq)
            await pipeline_like_before(reference, old, maxlen, group, EPOCH, seq).execute()
            for suffix in ("", ":directives"):
                assert client.xlen(new + suffix) == client.xlen(old + suffix)
            written += sum(record.kind != RecordKind.DIRECTIVES for record in group)
            longest = max(longest, client.xlen(new))
        assert entries(client, new) == entries(client, old)
        assert entries(client, directives_key(new)) == entries(client, directives_key(old))
        assert longest > maxlen and client.xlen(new) < written  # trimmed, approximately
        assert await journal._applied(EPOCH) == seq
    finally:
        await reference.aclose()
        await journal._close_backend()


async def test_every_key_gets_its_tag_on_the_last_entry_the_write_adds_to_it(journal: RedisJournal, client: redis.Redis) -> None:
    group = [rec(0), rec(1, RecordKind.DIRECTIVES), rec(2), rec(3, RecordKind.DIRECTIVES), rec(4, RecordKind.CONFIG)]
    await journal._write_tagged(group, EPOCH, 25)
    tags = [dict(row).get(b"s") for row in entries(client, journal.stream)]
    assert tags == [None, None, f"{EPOCH.hex()}:25".encode()]
    tags = [dict(row).get(b"s") for row in entries(client, directives_key(journal.stream))]
    assert tags == [None, f"{EPOCH.hex()}:24".encode()]
    assert await journal._applied(EPOCH) == 25


# ---- a group is all or nothing ----------------------------------------------------------------


@pytest.mark.parametrize("wrong", ["directives", "stream"])
async def test_a_group_with_an_xadd_failing_in_exec_leaves_nothing_in_redis(journal: RedisJournal, client: redis.Redis, wrong: str) -> None:
    """Redis runs the other XADDs of the transaction: the writer deletes them again, or a
    tag among them would make the read-back skip the record that failed."""
    stream, directives = journal.stream, directives_key(journal.stream)
    good = stream if wrong == "directives" else directives
    bad = directives if wrong == "directives" else stream
    await journal._write_tagged([rec(0, RecordKind.DIRECTIVES if good == directives else RecordKind.BATCH)], EPOCH, 1)
    before = entry_ids(client, good)
    client.set(bad, b"not a stream")
    group = [rec(1), rec(2, RecordKind.DIRECTIVES), rec(3), rec(4, RecordKind.DIRECTIVES), rec(5)]
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        await journal._write_tagged(group, EPOCH, 6)
    assert entry_ids(client, good) == before
    assert client.get(bad) == b"not a stream"
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):  # the read-back fails too, until...
        await journal._applied(EPOCH)
    client.delete(bad)  # ...an operator repairs the key: then it finds only the group before
    assert await journal._applied(EPOCH) == 1


async def test_the_writer_retries_a_failing_group_whole_and_loses_none_of_it(fresh_key: Callable[[], str], client: redis.Redis) -> None:
    """Through the writer task: while the directives key holds a string every write of the
    group fails; once it is a stream again, every record is there once, in order."""
    stream = fresh_key()
    client.set(directives_key(stream), b"not a stream")
    journal = RedisJournal(REDIS_URL, stream, maxlen=100_000, max_group=64)
    await journal.start()
    try:
        records = [rec(i, RecordKind.DIRECTIVES if i % 3 == 1 else RecordKind.BATCH) for i in range(12)]
        for record in records:
            journal.append(record)
        deadline = time.monotonic() + 10
        while journal.errors < 2:
            assert time.monotonic() < deadline, "the writer did not retry"
            await asyncio.sleep(0.01)
        assert client.xlen(stream) == 0 and journal.written == 0
        client.delete(directives_key(stream))
        await asyncio.wait_for(journal.flush(), 15)
    finally:
        await asyncio.wait_for(journal.close(), 15)
    payloads = [dict(row)[b"d"] for row in entries(client, stream)]
    assert payloads == [r.payload for r in records if r.kind == RecordKind.BATCH]
    payloads = [dict(row)[b"d"] for row in entries(client, directives_key(stream))]
    assert payloads == [r.payload for r in records if r.kind == RecordKind.DIRECTIVES]


class UndoLostOnce(RedisJournal):
    """Loses the connection when it first tries to delete the entries of a failed group."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.undo_failures = 0

    async def _transact(self, buffer: bytes, commands: int) -> list[Any]:
        if b"XDEL" in buffer[:64] and not self.undo_failures:
            self.undo_failures += 1
            await self._discard_writer_connection()
            raise redis.ConnectionError("connection lost (test)")
        return await super()._transact(buffer, commands)


async def test_an_undo_that_failed_is_finished_before_the_read_back(fresh_key: Callable[[], str], client: redis.Redis) -> None:
    stream = fresh_key()
    async with opened(UndoLostOnce(REDIS_URL, stream, maxlen=100_000)) as journal:
        await journal._write_tagged([rec(0)], EPOCH, 1)
        client.set(directives_key(stream), b"not a stream")
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            await journal._write_tagged([rec(1), rec(2, RecordKind.DIRECTIVES), rec(3)], EPOCH, 4)
        assert journal.undo_failures == 1 and client.xlen(stream) == 3  # the undo is still due
        client.delete(directives_key(stream))
        assert await journal._applied(EPOCH) == 1
        assert client.xlen(stream) == 1


# ---- lost and stuck connections ---------------------------------------------------------------


@pytest.fixture
def admin(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client of the test's own redis-server, for CLIENT PAUSE/KILL and CONFIG."""
    c = redis_server.client()
    yield c
    c.close()


def writer_ids(admin: redis.Redis) -> set[str]:
    me = str(admin.client_id())
    return {str(c["id"]) for c in admin.client_list() if str(c["id"]) != me}


async def wait_blocked(admin: redis.Redis) -> None:
    deadline = time.monotonic() + 10
    while not int(admin.info("clients")["blocked_clients"]):
        assert time.monotonic() < deadline, "the write never reached Redis"
        await asyncio.sleep(0.01)


async def test_a_connection_killed_mid_write_raises_and_the_next_write_uses_a_new_one(
    redis_server: RedisServer, admin: redis.Redis
) -> None:
    async with opened(RedisJournal(redis_server.url, "s", maxlen=1000)) as journal:
        await journal._write_tagged([rec(0), rec(1)], EPOCH, 2)
        first = writer_ids(admin)
        admin.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")  # holds the group mid-transaction
        try:
            write = asyncio.create_task(journal._write_tagged([rec(2), rec(3)], EPOCH, 4))
            await wait_blocked(admin)
            admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")
        with pytest.raises(redis.ConnectionError):
            await asyncio.wait_for(write, 10)
        assert await journal._applied(EPOCH) == 2  # a killed client's transaction is discarded
        await journal._write_tagged([rec(2), rec(3)], EPOCH, 4)
        assert await journal._applied(EPOCH) == 4
        assert [dict(row)[b"d"] for row in entries(admin, "s")] == [rec(i).payload for i in range(4)]
        assert not writer_ids(admin) & first


async def test_a_write_without_an_answer_times_out_and_the_next_write_uses_a_new_connection(
    redis_server: RedisServer, admin: redis.Redis
) -> None:
    async with opened(RedisJournal(redis_server.url, "s", maxlen=1000, timeout_s=0.3)) as journal:
        await journal._write_tagged([rec(0)], EPOCH, 1)
        first = writer_ids(admin)
        admin.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
        try:
            started = time.monotonic()
            with pytest.raises(redis.TimeoutError):
                await asyncio.wait_for(journal._write_tagged([rec(1)], EPOCH, 2), 10)
            assert time.monotonic() - started < 3
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")
        await journal._write_tagged([rec(1)], EPOCH, 2)
        assert await journal._applied(EPOCH) == 2
        assert not writer_ids(admin) & first


async def test_a_command_refused_while_queued_fails_the_group_and_leaves_no_reply_behind(
    redis_server: RedisServer, admin: redis.Redis
) -> None:
    """An error reply to a queued XADD (OOM) aborts the transaction; the replies after it
    are never read, so the connection must not serve the next write."""
    async with opened(RedisJournal(redis_server.url, "s", maxlen=1000)) as journal:
        await journal._write_tagged([rec(0)], EPOCH, 1)
        first = writer_ids(admin)
        admin.config_set("maxmemory", 1)  # with noeviction, every XADD is refused while queued
        try:
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                await journal._write_tagged([rec(1), rec(2), rec(3)], EPOCH, 4)
        finally:
            admin.config_set("maxmemory", 0)
        assert await journal._applied(EPOCH) == 1
        await journal._write_tagged([rec(1), rec(2), rec(3)], EPOCH, 4)
        assert await journal._applied(EPOCH) == 4
        assert [dict(row)[b"d"] for row in entries(admin, "s")] == [rec(i).payload for i in range(4)]
        assert not writer_ids(admin) & first


async def test_a_write_while_redis_is_down_raises_and_writes_again_once_it_is_back(redis_server: RedisServer) -> None:
    async with opened(RedisJournal(redis_server.url, "s", maxlen=1000)) as journal:
        await journal._write_tagged([rec(0)], EPOCH, 1)
        redis_server.stop()
        with pytest.raises(redis.ConnectionError):
            await asyncio.wait_for(journal._write_tagged([rec(1)], EPOCH, 2), 10)
        with pytest.raises(redis.ConnectionError):  # refused: nothing listens
            await asyncio.wait_for(journal._write_tagged([rec(1)], EPOCH, 2), 10)
        redis_server.start()  # without persistence: it comes back empty
        await journal._write_tagged([rec(1)], EPOCH, 2)
        assert await journal._applied(EPOCH) == 2


# ---- what the URL says: AUTH, ACL user, db, TLS, unix socket ----------------------------------


class SecuredRedis(RedisServer):
    """A test-owned ``redis-server`` that wants a password (and has an ACL user ``writer``),
    on a plain port, a TLS port and a unix socket."""

    PASSWORD = "pw-secret"
    USER_PASSWORD = "pw-writer"

    def __init__(self, folder: Path) -> None:
        port = self.tls_port = free_port()
        while self.tls_port == port:
            self.tls_port = free_port()
        self.socket = str(folder / "redis.sock")
        ca = Authority(folder, "ca")
        server = ca.issue("redis", server=True)
        self.ca_path = ca.ca_path
        args = ("--unixsocket", self.socket, "--unixsocketperm", "700")
        args += ("--tls-port", str(self.tls_port), "--tls-cert-file", str(server.cert), "--tls-key-file", str(server.key))
        args += ("--tls-ca-cert-file", str(ca.ca_path), "--tls-auth-clients", "no")
        super().__init__(port, args=args, password=self.PASSWORD)
        self.start()
        with contextlib.closing(self.client()) as admin:
            admin.execute_command("ACL", "SETUSER", "writer", "on", f">{self.USER_PASSWORD}", "~*", "+@all")

    def holds(self, db: int, key: str) -> bool:
        with contextlib.closing(self.client(db)) as client:
            return bool(client.exists(key))


@pytest.fixture(scope="module")
def secured_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredRedis]:
    server = SecuredRedis(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


def secured_url(server: SecuredRedis, shape: str) -> tuple[str, int]:
    pw, user_pw = SecuredRedis.PASSWORD, SecuredRedis.USER_PASSWORD
    return {
        "password": (f"redis://:{pw}@127.0.0.1:{server.port}/0", 0),
        "acl-user-db-3": (f"redis://writer:{user_pw}@127.0.0.1:{server.port}/3", 3),
        "tls-db-2": (f"rediss://:{pw}@127.0.0.1:{server.tls_port}/2?ssl_ca_certs={server.ca_path}", 2),
        "unix-db-1": (f"unix://{server.socket}?db=1&password={pw}", 1),
    }[shape]


@pytest.mark.parametrize("shape", ["password", "acl-user-db-3", "tls-db-2", "unix-db-1"])
async def test_the_writer_connects_as_the_url_says(secured_redis: SecuredRedis, shape: str) -> None:
    url, db = secured_url(secured_redis, shape)
    stream = f"kvbroker-test:{shape}:{uuid.uuid4().hex}"
    async with opened(RedisJournal(url, stream, maxlen=1000)) as journal:
        await journal._write_tagged([rec(0), rec(1, RecordKind.DIRECTIVES), rec(2)], EPOCH, 3)
        assert await journal._applied(EPOCH) == 3
    reader = redis.Redis.from_url(url)
    try:
        assert [dict(row)[b"d"] for row in entries(reader, stream)] == [rec(0).payload, rec(2).payload]
    finally:
        reader.close()
    assert [secured_redis.holds(n, stream) for n in range(4)] == [n == db for n in range(4)]


async def test_a_wrong_password_fails_the_write_instead_of_hanging(secured_redis: SecuredRedis) -> None:
    async with opened(RedisJournal(f"redis://:wrong@127.0.0.1:{secured_redis.port}/0", "s", maxlen=1000)) as journal:
        with pytest.raises(redis.AuthenticationError):
            await asyncio.wait_for(journal._write_tagged([rec(0)], EPOCH, 1), 10)
