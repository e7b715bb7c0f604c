"""The ``[health]`` table (broker.service.health serves what it configures)."""

from __future__ import annotations

import dataclasses
from typing import Any

from broker.config.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class HealthConfig:
    """The ``[health]`` table; every key optional."""

    # How often the journal is checked to set the serving status.
    poll_ms: int = 500
    # Serve grpc.reflection.v1alpha.ServerReflection (grpcurl without proto files).
    reflection: bool = True

    def toml_lines(self) -> list[str]:
        """The ``[health]`` table as TOML that ``health_config_from_dict`` reads back."""
        return ["[health]", f"poll_ms = {self.poll_ms}", f"reflection = {'true' if self.reflection else 'false'}"]


def health_config_from_dict(table: dict[str, Any]) -> HealthConfig:
    """Validate the ``[health]`` table of a parsed TOML document; unknown keys are errors."""
    if not isinstance(table, dict):
        raise ConfigError(f"health: expected a table, got {table!r}")
    t = dict(table)
    poll_ms = t.pop("poll_ms", HealthConfig.poll_ms)
    if isinstance(poll_ms, bool) or not isinstance(poll_ms, int):
        raise ConfigError(f"health.poll_ms: expected int, got {poll_ms!r}")
    if not 10 <= poll_ms <= 60_000:
        raise ConfigError(f"health.poll_ms: must be in 10..60000, got {poll_ms}")
    reflection = t.pop("reflection", HealthConfig.reflection)
    if not isinstance(reflection, bool):
        raise ConfigError(f"health.reflection: expected bool, got {reflection!r}")
    if t:
        raise ConfigError(f"unknown key(s) {', '.join('health.' + k for k in sorted(t))}")
    return HealthConfig(poll_ms=poll_ms, reflection=reflection)
