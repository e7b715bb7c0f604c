"""The ``[limits]`` table (broker.service.limits and the core enforce what it sets)."""

from __future__ import annotations

import dataclasses
from typing import Any

from broker.config.errors import ConfigError, parse_size

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


def limits_config_from_dict(table: dict[str, Any]) -> LimitsConfig:
    """Validate the ``[limits]`` table of a parsed TOML document; unknown keys are errors."""
    if not isinstance(table, dict):
        raise ConfigError(f"limits: expected a table, got {table!r}")
    t = dict(table)
    d = LimitsConfig()
    message = parse_size(t.pop("max_message_bytes"), "limits.max_message_bytes") if "max_message_bytes" in t else d.max_message_bytes
    counts: dict[str, int] = {}
    for key in ("max_events_per_batch", "max_streams_per_client", "max_blocks_per_tenant"):
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
    return LimitsConfig(max_message_bytes=message, **counts)
