"""The ``[limits]`` table (broker.service.limits and the core enforce what it sets)."""

from __future__ import annotations

import dataclasses
from typing import Any

from broker.config.errors import ConfigError, parse_size

DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class LimitsConfig:
    """The ``[limits]`` table; every key optional. 0 = unlimited (except max_message_bytes).

    docs/failure-semantics.md lists each key, its default and what a breach gets."""

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_events_per_batch: int = 10_000
    max_streams_per_client: int = 4
    # Enforced by the core: config_from_dict copies it into CoreConfig, which replay sees.
    max_blocks_per_tenant: int = 0
    # Open streams of the whole broker (each one that does not read its answers holds up
    # to max_unread_answer_bytes of them, plus one): one more is refused with RESOURCE_EXHAUSTED.
    max_streams: int = 256
    # New streams are refused while the broker's resident memory is above this (0: off).
    max_rss_bytes: int = 0
    # A batch may skip at most this many batch_seq numbers past the last one applied for its
    # client (1: every batch is the last + 1). A bigger jump would make every lower number
    # a "duplicate" that is never applied.
    max_batch_seq_gap: int = 1
    # Work one batch may ask of the broker, in block operations: one per event, one per
    # block id it names, and for a `cleared` one per block the client holds. The event loop
    # serves every stream; a bigger batch is refused whole (the client may split it).
    max_batch_work: int = 20_000
    # Enforced by the core (CoreConfig): an event whose ts_us runs more than this ahead of
    # the broker's clock (as the broker received it) is rejected, field ts_us (0: off).
    max_clock_skew_us: int = 60_000_000
    # Enforced by the core (CoreConfig): directives remembered for their acks; past it the
    # oldest unacknowledged is forgotten (its ack is then refused as unknown).
    max_outstanding_directives: int = 1_000_000
    # Tenants (IntentBatch.tenant) one client id may act for: a batch that would add one
    # more is refused whole (RESOURCE_EXHAUSTED, field tenant). Each costs state kept for
    # good (its batch_seq, its clock anchor).
    max_tenants_per_client: int = 16
    # Tenants the broker keeps state for, as far as batches whose tenant no token fixes
    # (no authentication, or an admin token) may add them: past it such a batch naming a new
    # tenant is refused whole (RESOURCE_EXHAUSTED, field tenant).
    max_tenants: int = 1_024
    # Answers of one stream applied and not yet taken by its client, in bytes: past it the
    # broker reads none of that stream's batches until the client reads (at least one
    # answer always goes). A client that never reads its answers costs this much and the
    # work of the batches it got in, no more (0: no bound but the count, 64 answers).
    max_unread_answer_bytes: int = 2**20

    def toml_lines(self) -> list[str]:
        """The ``[limits]`` table as TOML that ``limits_config_from_dict`` reads back."""
        return ["[limits]", *(f"{f.name} = {getattr(self, f.name)}" for f in dataclasses.fields(self))]


_COUNTS = (
    "max_events_per_batch",
    "max_streams_per_client",
    "max_blocks_per_tenant",
    "max_streams",
    "max_batch_seq_gap",
    "max_batch_work",
    "max_clock_skew_us",
    "max_outstanding_directives",
    "max_tenants_per_client",
    "max_tenants",
)


def limits_config_from_dict(table: dict[str, Any]) -> LimitsConfig:
    """Validate the ``[limits]`` table of a parsed TOML document; unknown keys are errors."""
    if not isinstance(table, dict):
        raise ConfigError(f"limits: expected a table, got {table!r}")
    t = dict(table)
    d = LimitsConfig()
    message = parse_size(t.pop("max_message_bytes"), "limits.max_message_bytes") if "max_message_bytes" in t else d.max_message_bytes
    rss = parse_size(t.pop("max_rss_bytes"), "limits.max_rss_bytes") if "max_rss_bytes" in t else d.max_rss_bytes
    unread = (
        parse_size(t.pop("max_unread_answer_bytes"), "limits.max_unread_answer_bytes")
        if "max_unread_answer_bytes" in t
        else d.max_unread_answer_bytes
    )
    counts: dict[str, int] = {}
    for key in _COUNTS:
        value = t.pop(key, getattr(d, key))
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"limits.{key}: expected int, got {value!r}")
        if value < 0:
            raise ConfigError(f"limits.{key}: must be >= 0 (0 = unlimited), got {value}")
        counts[key] = value
    if t:
        raise ConfigError(f"unknown key(s) {', '.join('limits.' + k for k in sorted(t))}")
    if not 1024 <= message <= 2**31 - 1:
        raise ConfigError(f"limits.max_message_bytes: must be in 1KiB..2GiB-1 (gRPC's range), got {message}")
    if counts["max_outstanding_directives"] == 0:
        raise ConfigError("limits.max_outstanding_directives: must be >= 1 (acks need their directives remembered)")
    return LimitsConfig(max_message_bytes=message, max_rss_bytes=rss, max_unread_answer_bytes=unread, **counts)
