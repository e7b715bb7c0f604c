"""One writer per Redis journal stream: a lease with a fencing token.

A file journal has its ``flock``; a Redis stream has nothing of the kind, and two brokers
with the same Redis URL and broker id would interleave their batches in one stream (replay
then reproduces neither). So a broker writing a stream holds ``KEY:lease``:

- **Taking it**: ``INCR KEY:lease:token`` gives a fencing token, a number that grows at
  every attempt by anyone; then ``SET KEY:lease "TOKEN HOLDER" NX PX lease_ms``. When the
  key is there, another broker holds the stream: the start is refused, naming the stream
  and the holder (broker id, pid, host) and how long the lease still runs. A lease whose
  holder died expires after ``journal.lease_s``: only then can another broker take over.
- **Keeping it**: renewed every ``lease_s / 3`` while serving (``PEXPIRE`` if the value is
  still ours). A write to the stream first checks that the lease was confirmed less than
  ``lease_s - redis_timeout_s`` ago by the writer's own clock (else it renews first), so a
  broker that was paused (SIGSTOP, swapping) or cut off longer than its lease confirms it
  before writing again, and never writes while another may hold it.
- **Lapsed, not taken**: a lease that expired while its holder could not reach Redis is
  taken back only if the fencing token is still the holder's (nobody took the stream in
  between, not even for a while); else the lease is lost.
- **Lost**: the writer writes nothing more to the stream; new batches are refused
  (``UNAVAILABLE``, field ``journal``) naming the stream and the new holder. Records not
  yet written stay in the spool for the next start, which refuses to start while the other
  broker holds the stream.
- **Let go** at a close (``DEL`` if still ours). A holder killed (SIGKILL) leaves it to
  expire, except for a restart on the same host: a holder that was a process of this host
  and boot that no longer runs is taken over at once (its pid, host and boot id are in the
  lease's value).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from typing import Any

from broker.journal.records import JournalError

log = logging.getLogger("kvbroker.journal")

# Renew ours; take it back if it lapsed and nobody took a token since ours; else say who has it.
_RENEW = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not v and redis.call('GET', KEYS[2]) == ARGV[3] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 2
end
return v or ''
"""
_TAKE_OVER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


# The lease values this process's leases hold now: one of this process's values not among
# them belongs to a journal of this process that closed without letting go (Redis was down).
_HELD: set[bytes] = set()


def lease_key(stream: str) -> str:
    return f"{stream}:lease"


def token_key(stream: str) -> str:
    return f"{stream}:lease:token"


def holder_name(broker_id: str) -> str:
    """Who holds a lease, as the refusal names it."""
    return f"broker {broker_id} (pid {os.getpid()} on {socket.gethostname()})"


def _boot_id() -> str:
    """This kernel's boot id: a pid names a process only on one host since one boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def lease_value(token: int, holder: str) -> bytes:
    """What KEY:lease holds: the fencing token, who holds it (as said), and the process
    (host, boot, pid) for a restart on the same host to tell a dead holder."""
    fields = {"token": token, "holder": holder, "host": socket.gethostname(), "boot": _boot_id(), "pid": os.getpid()}
    return json.dumps(fields, separators=(",", ":")).encode()


def _fields(value: Any) -> dict[str, Any]:
    try:
        fields = json.loads(value)
    except (ValueError, TypeError, RecursionError):
        return {}
    return fields if isinstance(fields, dict) else {}


def _dead_here(value: Any) -> bool:
    """Whether the holder of ``value`` was a process of this host, this boot, that no
    longer runs (a broker killed with SIGKILL, restarted at once): its lease need not run
    out. Another process, or a process elsewhere, is never taken for dead."""
    fields = _fields(value)
    pid = fields.get("pid")
    if type(pid) is not int or pid <= 0:
        return False
    if pid == os.getpid():  # this process: dead if no lease of its own holds that value now
        return fields.get("host") == socket.gethostname() and (value.encode() if isinstance(value, str) else value) not in _HELD
    if fields.get("host") != socket.gethostname() or not fields.get("boot") or fields.get("boot") != _boot_id():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it runs (as another user)
        return False
    return False


class LeaseLost(JournalError):
    """Another broker holds the stream (at start: refused; while serving: lost)."""


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def in_use(stream: str, held: Any, ttl: Any = None) -> str:
    """The one line a broker refused the stream says: the stream, the holder, the lease."""
    holder = str(_fields(held).get("holder") or _text(held)[:200]) if held else "unknown (the lease just ended)"
    left = f"; its lease runs {int(ttl) / 1000:.1f} s more unless renewed" if isinstance(ttl, int) and ttl > 0 else ""
    return (
        f"journal stream {stream!r} is in use by another broker: {holder} holds {lease_key(stream)}{left}; "
        "two brokers must not write one stream: stop that one, or give this one its own broker.id or journal.stream"
    )


def check_free(url: str, stream: str) -> None:
    """Raise LeaseLost when another broker holds the stream's lease now (what ``serve``
    says before it starts; the start takes the lease itself, so a race is refused there)."""
    import redis

    from broker.journal.redis_urls import sync_client

    try:
        client = sync_client(url, socket_timeout=10)
        try:
            held = client.get(lease_key(stream))
            ttl = client.pttl(lease_key(stream)) if held else None
        finally:
            client.close()
    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException):
        return  # said by the reachability check, or the start takes the lease later
    if held and not _dead_here(held):  # a dead holder's is taken over as the broker starts
        raise LeaseLost(in_use(stream, held, ttl))


class StreamLease:
    """The lease of one stream, on an asyncio Redis (or Redis Cluster) client of the
    journal's. ``timeout_s``: the journal's bound of one Redis call."""

    def __init__(self, stream: str, holder: str, lease_s: float, timeout_s: float) -> None:
        self.stream = stream
        self.holder = holder
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self.token = 0
        self.value = b""
        self.lost = ""  # why the lease is lost ("" while held)
        self._confirmed = -float("inf")  # monotonic time a renewal was sent and then confirmed
        self._client: Any = None
        self._task: asyncio.Task[None] | None = None

    @property
    def _ms(self) -> int:
        return max(1, int(self.lease_s * 1000))

    async def acquire(self, client: Any) -> None:
        """Take the lease at start, or raise LeaseLost naming the stream and its holder. A
        Redis that does not answer now (a start with journal.recover = false) leaves it to
        be taken before the first write (``ensure``)."""
        self._client = client
        try:
            await self._take()
        except LeaseLost:
            raise
        except Exception as exc:
            log.warning(
                "journal stream %s: cannot take the lease yet (%s: %s); taken before the first write",
                self.stream,
                type(exc).__name__,
                exc,
            )

    async def _take(self) -> None:
        client = self._client
        async with asyncio.timeout(max(self.timeout_s, 0.1) * 3):
            token = int(await client.incr(token_key(self.stream)))
            value = lease_value(token, self.holder)
            sent = time.monotonic()
            if not await client.set(lease_key(self.stream), value, nx=True, px=self._ms):
                held = await client.get(lease_key(self.stream))
                ttl = await client.pttl(lease_key(self.stream))
                # A holder killed on this host a moment ago: taken over at once (compare and set).
                if not (held and _dead_here(held) and await client.eval(_TAKE_OVER, 1, lease_key(self.stream), held, value, self._ms)):
                    raise LeaseLost(self._refusal(held, ttl))
                dead = _fields(held).get("holder")
                log.warning("journal stream %s: the lease's holder (%s) no longer runs on this host: taken over", self.stream, dead)
        self.token, self.value, self._confirmed = token, value, sent
        _HELD.add(value)
        log.info(
            "journal stream %s: lease taken (fencing token %d, %.0f s, renewed every %.1f s)",
            self.stream,
            token,
            self.lease_s,
            self.lease_s / 3,
        )
        self._task = asyncio.get_running_loop().create_task(self._keep(), name=f"journal-lease {self.stream}")

    def _refusal(self, held: Any, ttl: Any = None) -> str:
        return in_use(self.stream, held, ttl)

    async def ensure(self) -> None:
        """Before a write: raise LeaseLost if the lease is lost; renew first unless it was
        confirmed recently enough that it outlasts the write (a Redis error is raised: the
        writer takes it as an outage)."""
        if self.lost:
            raise LeaseLost(self.lost)
        if not self.value:  # not taken at start (Redis did not answer)
            try:
                await self._take()
            except LeaseLost as exc:
                self.lost = str(exc)
                log.error("%s", self.lost)
                raise
            return
        if time.monotonic() - self._confirmed < self.lease_s - self.timeout_s:
            return
        await self.renew()

    async def renew(self) -> None:
        sent = time.monotonic()
        keys_and_args = (lease_key(self.stream), token_key(self.stream), self.value, self._ms, self.token)
        async with asyncio.timeout(max(self.timeout_s, 0.1)):
            answer = await self._client.eval(_RENEW, 2, *keys_and_args)
        if answer in (1, 2):
            if answer == 2:
                log.warning(
                    "journal stream %s: lease had lapsed (Redis unreachable longer than %.0f s); taken back, nobody took it meanwhile",
                    self.stream,
                    self.lease_s,
                )
            self._confirmed = sent
            return
        self.lost = self._refusal(answer).replace("is in use by another broker", "was taken over by another broker") + (
            "; this broker no longer writes it"
        )
        log.error("%s", self.lost)
        raise LeaseLost(self.lost)

    async def _keep(self) -> None:
        """Renew every lease_s / 3 while serving; a failed renewal is retried at the next
        turn (the write path checks the lease before each write)."""
        while not self.lost:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self.renew()
            except LeaseLost:
                return
            except Exception as exc:  # Redis unreachable: the spool goes on; the write path checks
                log.debug("journal stream %s: lease renewal failed (%s: %s)", self.stream, type(exc).__name__, exc)

    async def release(self) -> None:
        """Stop renewing and let the lease go (if still ours)."""
        _HELD.discard(self.value)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.lost or self._client is None or not self.value:
            return
        with contextlib.suppress(Exception):  # unreachable: it expires within lease_s
            async with asyncio.timeout(max(self.timeout_s, 0.1)):
                await self._client.eval(_RELEASE, 1, lease_key(self.stream), self.value)
