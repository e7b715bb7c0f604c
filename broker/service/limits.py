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

A limit of 0 means unlimited (``max_message_bytes`` excepted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker.config.limits import LimitsConfig

if TYPE_CHECKING:
    pass


def events_refusal(events: int, limits: LimitsConfig) -> str | None:
    """Why a batch of ``events`` events is refused, or None."""
    limit = limits.max_events_per_batch
    if limit and events > limit:
        return f"{events} events, over limits.max_events_per_batch = {limit}; send them in smaller batches"
    return None


class StreamCounts:
    """Open streams per client (keyed by tenant and client id)."""

    def __init__(self) -> None:
        self.open: dict[tuple[str, str], int] = {}

    def enter(self, key: tuple[str, str], limits: LimitsConfig) -> str | None:
        """Count one more stream of ``key``; or, over the limit, count nothing and say why."""
        n = self.open.get(key, 0)
        limit = limits.max_streams_per_client
        if limit and n >= limit:
            return f"client {key[1]!r} already has {n} open streams, limits.max_streams_per_client = {limit}"
        self.open[key] = n + 1
        return None

    def leave(self, key: tuple[str, str]) -> None:
        n = self.open.get(key, 0) - 1
        if n > 0:
            self.open[key] = n
        else:
            self.open.pop(key, None)
