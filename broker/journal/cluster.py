"""The Redis journal on a Redis Cluster (``redis+cluster://HOST:PORT``).

The same records, entries, tags and spool as ``RedisJournal`` (one packed MULTI, XADD...,
EXEC per group over a connection of the writer's own, exactly once through the spool's
read-back); what the cluster changes:

- Routing. redis-py's cluster client keeps the slot map; the writer's connection goes to
  the master of the stream's slot. Any failed exchange (a lost node, MOVED after a
  failover or a resharding, CLUSTERDOWN) drops the connection and reloads the slot map
  before the next attempt, so writes follow a failover once the cluster has promoted a
  replica; meanwhile records go to the spool, as in any outage.
- One slot. A MULTI/EXEC spans one slot, so the stream and its directives stream must hash
  to the same one: the key needs a hash tag (``kvbroker:{pod-7}:journal``; the directives
  go to ``KEY:directives``, the same tag). A key without one is refused with the reason.
- Replication. Replicas copy a master asynchronously, so a master that dies right after a
  write can take the write with it when its replica is promoted. A write therefore counts
  (the batch is answered, under ack_after = "journal") only once ``wait_replicas`` replicas
  hold it (WAIT after EXEC). The spool's read-back trusts what a master holds only the same
  way: after reading the tags it writes ``KEY:sync`` (a small string that expires) and
  WAITs, since WAIT covers the writes of its own connection, and a master replicates its
  writes in order. With ``wait_replicas = 0`` a failover may lose the newest writes.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

from broker.journal.records import JournalError
from broker.journal.redis_stream import SOCKET_TIMEOUT_S, RedisJournal, _command, _xadd_head, directives_key
from broker.journal.redis_urls import cluster_nodes, redact_url

# How long WAIT waits for the replicas (milliseconds); within the exchange's deadline.
WAIT_MS = 2000
# How long the read-back's marker key lives (milliseconds): it is rewritten at every read-back.
SYNC_TTL_MS = 3_600_000


def sync_key(stream: str) -> str:
    """The read-back's marker key: a write in the stream's slot for WAIT to cover."""
    return f"{stream}:sync"


def check_one_slot(stream: str) -> None:
    """Refuse a stream key whose directives stream would land in another slot."""
    if key_slot(stream.encode()) != key_slot(directives_key(stream).encode()):
        raise JournalError(
            f"journal.stream {stream!r}: on a Redis Cluster the stream and its directives stream ({directives_key(stream)!r}) "
            "must share a hash slot, and this key has no hash tag: put the part that names the broker in braces, "
            'e.g. stream = "kvbroker:{{id}}:journal" (the broker id becomes the tag)'
        )


class RedisClusterJournal(RedisJournal):
    def __init__(self, url: str, stream: str, *, wait_replicas: int = 1, **options: Any) -> None:
        check_one_slot(stream)
        if wait_replicas < 0:
            raise JournalError(f"journal.wait_replicas: must be >= 0, got {wait_replicas}")
        super().__init__(url, stream, **options)
        self.wait_replicas = wait_replicas
        if self.lease is not None:
            # A cluster write may take this long (WAIT included): the lease must outlast it.
            self.lease.timeout_s = SOCKET_TIMEOUT_S + WAIT_MS / 1000
        self._cluster: RedisCluster | None = None
        self._topology_loaded = False
        self._stale = True  # reload the slot map before the next connection

    @property
    def description(self) -> str:
        return f"{redact_url(self.url)} (cluster) stream {self.stream}"

    async def _open_backend(self) -> None:
        first, nodes = cluster_nodes(self.url)
        self._cluster = RedisCluster.from_url(
            first,
            startup_nodes=[ClusterNode(host, port) for host, port in nodes[1:]],
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=SOCKET_TIMEOUT_S,
        )
        self._keys = (self.stream.encode(), directives_key(self.stream).encode())
        self._heads = {
            (directives, tagged): _xadd_head(self._keys[directives], self.maxlen, tagged=tagged)
            for directives in (False, True)
            for tagged in (False, True)
        }
        if self.lease is not None:
            await self.lease.acquire(self._cluster)  # KEY:lease shares the stream's hash tag

    async def _connect(self) -> None:
        """The writer's connection to the master of the stream's slot, after reloading the
        slot map if the last exchange failed."""
        if self._conn is not None:
            return
        cluster = self._cluster
        assert cluster is not None
        if not self._topology_loaded:
            await cluster.initialize()
            self._topology_loaded = True
        elif self._stale:
            await cluster.nodes_manager.initialize()
        self._stale = False
        node = cluster.get_node_from_key(self.stream)
        if node is None:
            raise redis.exceptions.SlotNotCoveredError(f"no master holds the slot of {self.stream!r}")
        conn = node.connection_class(**node.connection_kwargs)
        conn.socket_timeout = None  # _exchange bounds the whole exchange instead
        self._conn = conn

    def _writer_connection(self) -> Any:
        assert self._conn is not None, "_connect first"
        return self._conn

    async def _discard_writer_connection(self) -> None:
        self._stale = True
        await super()._discard_writer_connection()

    async def _write_tagged(self, group: list[Any], epoch: bytes, last_seq: int) -> None:
        await self._connect()
        await super()._write_tagged(group, epoch, last_seq)

    async def _transact(self, buffer: bytes, commands: int) -> list[Any]:
        """MULTI ... EXEC as ``RedisJournal._transact``, then WAIT for the replicas: the
        replies of EXEC, or raise (also when fewer replicas than ``wait_replicas`` confirm:
        the write is then in doubt, and the spool's read-back decides)."""
        replies = await self._exchange(buffer, commands + 2)  # +OK, QUEUED per command, EXEC's
        exec_replies = replies[commands + 1]
        if not isinstance(exec_replies, list) or len(exec_replies) != commands:
            await self._discard_writer_connection()
            raise redis.ResponseError(f"EXEC answered {exec_replies!r:.100}, expected {commands} replies")
        return exec_replies

    async def _exchange(self, buffer: bytes, replies: int) -> list[Any]:
        """Send ``buffer`` (plus WAIT when replicas are awaited) and read ``replies`` replies
        (plus WAIT's, checked); one deadline for all. A failure drops the connection."""
        conn = self._writer_connection()
        if self.wait_replicas:
            buffer += _command(b"WAIT", b"%d" % self.wait_replicas, b"%d" % WAIT_MS)
        out: list[Any] = []
        try:
            async with asyncio.timeout(SOCKET_TIMEOUT_S + WAIT_MS / 1000):
                await conn.send_packed_command(buffer)
                for _ in range(replies + (1 if self.wait_replicas else 0)):
                    out.append(await conn.read_response())
        except TimeoutError as exc:
            await self._discard_writer_connection()
            raise redis.TimeoutError(f"no complete answer from the cluster within {SOCKET_TIMEOUT_S + WAIT_MS / 1000}s") from exc
        except BaseException:
            await self._discard_writer_connection()
            raise
        if self.wait_replicas:
            acked = out[-1]
            if not isinstance(acked, int) or acked < self.wait_replicas:
                await self._discard_writer_connection()
                raise redis.ResponseError(
                    f"WAIT: {acked} of {self.wait_replicas} replica(s) of the shard of {self.stream!r} confirmed the write "
                    f"within {WAIT_MS} ms (journal.wait_replicas; 0 for a cluster without replicas)"
                )
        return out

    async def _applied(self, epoch: bytes) -> int | None:
        await self._connect()
        await self._finish_undo()
        reads = b"".join(_command(b"XREVRANGE", key, b"+", b"-", b"COUNT", b"1") for key in self._keys)
        wait, self.wait_replicas = self.wait_replicas, 0  # reads: nothing to wait for yet
        try:
            rows = await self._exchange(reads, 2)
        finally:
            self.wait_replicas = wait
        prefix = epoch.hex().encode() + b":"
        newest: int | None = None
        for entries in rows:
            for _, fields in entries:
                tag = _fields(fields).get(b"s", b"")
                if tag.startswith(prefix):
                    seq = int(tag[len(prefix) :])
                    newest = seq if newest is None else max(newest, seq)
        if newest is not None and self.wait_replicas:
            # Trust what this master holds only once its replicas hold it too.
            marker = _command(b"SET", sync_key(self.stream).encode(), b"%b%d" % (prefix, newest), b"PX", b"%d" % SYNC_TTL_MS)
            await self._exchange(marker, 1)
        return newest

    async def _close_backend(self) -> None:
        await self._release_lease()
        await self._discard_writer_connection()
        if self._cluster is not None:
            with contextlib.suppress(Exception):  # closing: a node already gone changes nothing
                await self._cluster.aclose()
            self._cluster = None


def _fields(raw: Any) -> dict[bytes, bytes]:
    """An entry's fields as XREVRANGE returns them (a flat list over RESP2, a map over RESP3)."""
    if isinstance(raw, dict):
        return raw
    return dict(zip(raw[::2], raw[1::2], strict=True))
