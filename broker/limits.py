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
  rejected (RESOURCE_EXHAUSTED) as one event. It is decided by the core (``broker.apply``)
  from the core's own state, and the limit is part of ``CoreConfig`` (journaled in CONFIG
  records), so replay and crash recovery refuse exactly the allocations the live broker did.

A limit of 0 means unlimited (``max_message_bytes`` excepted).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broker.core import Core

DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class LimitsConfig:
    """The ``[limits]`` table; every key optional. 0 = unlimited (except max_message_bytes)."""

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_events_per_batch: int = 10_000
    max_streams_per_client: int = 4
    # Enforced by the core: config_from_dict copies it into CoreConfig, which replay sees.
    max_blocks_per_tenant: int = 0

    def toml_lines(self) -> list[str]:
        """The ``[limits]`` table as TOML that ``limits_config_from_dict`` reads back."""
        return ["[limits]", *(f"{f.name} = {getattr(self, f.name)}" for f in dataclasses.fields(self))]


def _error(message: str) -> Exception:
    # Imported here: broker.config imports this module (for LimitsConfig) at its top.
    from broker.config import ConfigError

    return ConfigError(message)


def limits_config_from_dict(table: dict[str, Any]) -> LimitsConfig:
    """Validate the ``[limits]`` table of a parsed TOML document; unknown keys are errors."""
    from broker.config import parse_size

    if not isinstance(table, dict):
        raise _error(f"limits: expected a table, got {table!r}")
    t = dict(table)
    d = LimitsConfig()
    message = parse_size(t.pop("max_message_bytes"), "limits.max_message_bytes") if "max_message_bytes" in t else d.max_message_bytes
    counts: dict[str, int] = {}
    for key in ("max_events_per_batch", "max_streams_per_client", "max_blocks_per_tenant"):
        value = t.pop(key, getattr(d, key))
        if isinstance(value, bool) or not isinstance(value, int):
            raise _error(f"limits.{key}: expected int, got {value!r}")
        if value < 0:
            raise _error(f"limits.{key}: must be >= 0 (0 = unlimited), got {value}")
        counts[key] = value
    if t:
        raise _error(f"unknown key(s) {', '.join('limits.' + k for k in sorted(t))}")
    if not 1024 <= message <= 2**31 - 1:
        raise _error(f"limits.max_message_bytes: must be in 1KiB..2GiB-1 (gRPC's range), got {message}")
    return LimitsConfig(max_message_bytes=message, **counts)


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


# ---- blocks per tenant ---------------------------------------------------------------------------


def tenant_counts(core: Core) -> dict[str, int] | None:
    """Blocks per tenant of ``core`` (``core.tenant_blocks``), or None when its config sets
    no limit (then nothing is counted, and the count is rebuilt when a limit comes back).

    Built by one pass over the core's blocks when first needed (a fresh core, a limit turned
    on by a reload), then kept by broker.apply on every allocation and free: a pure function
    of the core's state, so the live broker, recovery and replay count alike."""
    if not core.config.max_blocks_per_tenant:
        core.tenant_blocks = None
        return None
    counts = core.tenant_blocks
    if counts is None:
        counts = {}
        for block in core.blocks.values():
            if block.tenant:
                counts[block.tenant] = counts.get(block.tenant, 0) + 1
        core.tenant_blocks = counts
    return counts


def tenant_full(counts: dict[str, int], tenant: str, limit: int) -> str | None:
    """Why one more block of ``tenant`` is refused, or None. Names no other tenant."""
    held = counts.get(tenant, 0)
    if held >= limit:
        return f"tenant {tenant!r} holds {held} blocks, limits.max_blocks_per_tenant = {limit}; free some first"
    return None


def count_block(counts: dict[str, int], tenant: str, delta: int) -> None:
    if not tenant:
        return
    n = counts.get(tenant, 0) + delta
    if n > 0:
        counts[tenant] = n
    else:
        counts.pop(tenant, None)
