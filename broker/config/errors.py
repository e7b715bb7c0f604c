"""The error every config check raises, and the size parser every section uses.

At the bottom of the config package: the sections (health, limits, security, telemetry) and
the settings that gather them import it, and it imports nothing of the project.
"""

from __future__ import annotations

import re
from typing import Any

SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# Sizes fit an int64 (and the uint64 fields that report them).
MAX_SIZE = 2**63
SIZE_RE = re.compile(r"^\s*(-?[0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and the reason."""


def format_size(size: int) -> str:
    """A capacity as a person reads it, in the largest binary unit it fills at least once
    ("878B", "512.00MiB", "4.00GiB"); ``parse_size`` reads it back (to the rounding)."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{size}B" if unit == "B" else f"{value:.2f}{unit}"
        value /= 1024
    return f"{value:.2f}TiB"


def parse_size(value: Any, key: str) -> int:
    """Bytes from an int or a string such as "16GiB", "512MB", "4096"."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size in bytes, got {value!r}")
    if isinstance(value, int):
        if value >= MAX_SIZE:  # float() of a huge int overflows
            raise ConfigError(f"{key}: too large, at most {MAX_SIZE - 1} bytes, got {value!r}")
        number, unit = float(value), ""
    elif isinstance(value, str) and (m := SIZE_RE.match(value)):
        number, unit = float(m.group(1)), m.group(2).lower()
    else:
        raise ConfigError(f"{key}: expected a size such as 16GiB or 4096, got {value!r}")
    if unit not in SIZE_UNITS:
        raise ConfigError(f"{key}: unknown size unit {unit!r} (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    scaled = number * SIZE_UNITS[unit]
    if not scaled < MAX_SIZE:  # past int64 (and past float range: inf)
        raise ConfigError(f"{key}: too large, at most {MAX_SIZE - 1} bytes, got {value!r}")
    size = int(scaled)
    if size < 0:
        raise ConfigError(f"{key}: must be >= 0, got {value!r}")
    return size
