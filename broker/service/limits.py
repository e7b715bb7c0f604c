"""Limits of what one client or tenant may ask of the broker, and their checks.

The ``[limits]`` table, each breach refused with the limit named:

- ``max_message_bytes``: gRPC's receive limit. A larger message ends its stream with
  RESOURCE_EXHAUSTED ("Received message larger than max (N vs. LIMIT)", from gRPC itself:
  the message is never read into memory); other streams go on.
- ``max_events_per_batch``: a larger batch is refused as a whole (INVALID_ARGUMENT, event
  index -1, field ``events``): not applied, not journaled; the stream goes on and the client
  may send it again split, with the same ``batch_seq``.
- ``max_streams_per_client``: the streams one client id (of one tenant) may hold open at
  once; one more is refused with RESOURCE_EXHAUSTED.
- ``max_blocks_per_tenant``: the blocks a tenant may hold; an allocation beyond it is
  rejected (RESOURCE_EXHAUSTED) as one event. It is decided by the core (``broker.model.apply``)
  from the core's own state, and the limit is part of ``CoreConfig`` (journaled in CONFIG
  records), so replay and crash recovery refuse exactly the allocations the live broker did.

- ``max_streams``: open streams of the whole broker; ``max_rss_bytes``: new streams are
  refused while the broker's resident memory is above it. Both RESOURCE_EXHAUSTED at open.
- ``max_batch_seq_gap``: a batch_seq more than this past the client's last applied one is
  refused whole (INVALID_ARGUMENT, field ``batch_seq``); the client resends with the next one.
- ``max_batch_work``: a batch asking more block operations than this (``batch_work``) is
  refused whole (RESOURCE_EXHAUSTED, field ``events``), so that no stream waits long for
  another's batch: apply runs on the one event loop that serves every stream.
- ``max_tenants_per_client``: the tenants (``IntentBatch.tenant``) one client id may act
  for; ``max_tenants``: the tenants the broker keeps state for, as far as batches whose
  tenant no token fixes (no authentication, or an admin token) may add them. A batch that
  would pass either is refused whole (RESOURCE_EXHAUSTED, field ``tenant``): each tenant
  costs state kept for good (its batch_seq, its clock anchor). Counted by the core
  (``Core.client_tenants``, ``Core.tenant_clients``), so a restart counts the same.
- ``max_unread_answer_bytes``: the answers of one stream applied and not yet taken by its
  client; past it the broker stops reading that stream (``UnreadAnswers``) until the
  client reads, so gRPC's flow control holds the client back. A client that never reads
  costs that much memory and the work of the batches it got in, and no other stream waits.
- ``max_clock_skew_us`` and ``max_outstanding_directives`` are the core's (CoreConfig).

A limit of 0 means unlimited (``max_message_bytes`` excepted). docs/failure-semantics.md
lists them with their defaults.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from broker.config.limits import LimitsConfig
from broker.model.wire import CLEARED, EVICTION

if TYPE_CHECKING:
    from broker.model.core import Core

_PAGE = os.sysconf("SC_PAGE_SIZE")
# An event: its own cost, plus one per block id it names.
_IDS_AT = {3: 4, 5: 3, 6: 3}  # accessed: ev[4] ids / ev[3] blocks; released, freed: ev[3] / ev[2]


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def batch_work(events: Iterable[tuple[Any, ...]], owned: int) -> int:
    """Block operations a batch asks for: one per event, one per block id it names, and
    for its first ``cleared`` the ``owned`` blocks the client holds (plus what the batch
    allocated before it; a later ``cleared`` frees only what came since)."""
    work = 0
    held = owned
    for ev in events:
        kind = ev[0]
        work += 1
        if kind == CLEARED:
            work += held
            held = 0
        elif kind == 2:  # allocated
            held += 1
        elif kind == EVICTION:  # the victims it asks for, and the protected ids it names
            work += ev[3] + len(ev[4])
        else:
            at = _IDS_AT.get(kind)
            if at is not None:
                named = ev[at - 1] if ev[at - 1] is not None else ev[at]
                work += len(named) if named is not None else 0
    return work


def work_refusal(work: int, limits: LimitsConfig) -> str | None:
    limit = limits.max_batch_work
    if limit and work > limit:
        return (
            f"the batch asks {work} block operations, over limits.max_batch_work = {limit} "
            "(one per event, one per block id named, one per block a cleared frees); send it in smaller batches"
        )
    return None


def tenant_refusal(core: Core, tenant: str, client_id: str, limits: LimitsConfig, from_token: bool) -> str | None:
    """Why a batch of ``client_id`` acting for ``tenant`` for the first time is refused, or
    None. ``from_token``: the stream's token fixes the tenant (max_tenants does not apply).
    O(1)."""
    limit = limits.max_tenants_per_client
    held = core.client_tenants.get(client_id, 0)
    if limit and held >= limit:
        return (
            f"client {client_id!r} already acts for {held} tenants, limits.max_tenants_per_client = {limit}; use one client id per tenant"
        )
    limit = limits.max_tenants
    known = len(core.tenant_clients)
    if limit and not from_token and known >= limit and tenant not in core.tenant_clients:
        return (
            f"the broker keeps {known} tenants, limits.max_tenants = {limit}: a tenant no token names cannot be added; "
            "use bearer tokens (security.tokens_file) for more tenants"
        )
    return None


def seq_refusal(batch_seq: int, last: int, limits: LimitsConfig) -> str | None:
    """Why a batch_seq is refused (a jump past the gap), or None."""
    gap = limits.max_batch_seq_gap
    if gap and batch_seq > last + gap:
        return (
            f"{batch_seq} jumps past the last applied batch_seq {last} by more than limits.max_batch_seq_gap = {gap}; "
            f"number batches from the hello's last_batch_seq + 1 (next: {last + 1})"
        )
    return None


def events_refusal(events: int, limits: LimitsConfig) -> str | None:
    """Why a batch of ``events`` events is refused, or None."""
    limit = limits.max_events_per_batch
    if limit and events > limit:
        return f"{events} events, over limits.max_events_per_batch = {limit}; send them in smaller batches"
    return None


class UnreadAnswers:
    """The bytes of one stream's answers applied and not yet taken by gRPC: the client
    read them, or its flow-control window had room (a response generator resumes only
    then). The stream's reader waits (``room``) while they are at least ``limit`` (0: no
    bound), before it reads the next batch, so what a stream that does not read holds is
    ``limit`` plus one answer, and its batches stop costing the event loop anything."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self._room = asyncio.Event()
        self._room.set()

    def add(self, n: int) -> None:
        self.bytes += n
        if self.limit and self.bytes >= self.limit:
            self._room.clear()

    def taken(self, n: int) -> None:
        self.bytes -= n
        if self.bytes < self.limit or not self.limit:
            self._room.set()

    async def room(self) -> None:
        await self._room.wait()


class StreamCounts:
    """Open streams per client (keyed by tenant and client id)."""

    def __init__(self) -> None:
        self.open: dict[tuple[str, str], int] = {}
        self.total = 0
        # Streams refused at open, by the limit that refused them (GetStats refused_streams).
        self.refused: dict[str, int] = {}

    def enter(self, key: tuple[str, str], limits: LimitsConfig) -> str | None:
        """Count one more stream of ``key``; or, over a limit, count nothing and say why."""
        why, reason = self._refusal(key, limits)
        if why is not None:
            self.refused[reason] = self.refused.get(reason, 0) + 1
            return why
        self.open[key] = self.open.get(key, 0) + 1
        self.total += 1
        return None

    def _refusal(self, key: tuple[str, str], limits: LimitsConfig) -> tuple[str | None, str]:
        n = self.open.get(key, 0)
        limit = limits.max_streams_per_client
        if limit and n >= limit:
            return f"client {key[1]!r} already has {n} open streams, limits.max_streams_per_client = {limit}", "max_streams_per_client"
        if limits.max_streams and self.total >= limits.max_streams:
            return f"the broker has {self.total} open streams, limits.max_streams = {limits.max_streams}", "max_streams"
        if limits.max_rss_bytes:
            rss = rss_bytes()
            if rss > limits.max_rss_bytes:
                return f"the broker holds {rss} bytes of memory, over limits.max_rss_bytes = {limits.max_rss_bytes}", "max_rss_bytes"
        return None, ""

    def leave(self, key: tuple[str, str]) -> None:
        self.total -= 1
        n = self.open.get(key, 0) - 1
        if n > 0:
            self.open[key] = n
        else:
            self.open.pop(key, None)
