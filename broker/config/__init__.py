"""Broker configuration: a TOML file, validated in full before anything uses it.

The bottom room of the broker: every other part imports its config from here, and nothing
here imports them. ``errors`` (ConfigError, sizes) is below the sections (``health``,
``limits``, ``security``, ``telemetry``: one ``[table]`` each), and ``settings`` gathers them
into ``BrokerConfig``. The names below are the package's interface.
"""

from broker.config.errors import SIZE_RE, SIZE_UNITS, ConfigError, format_size, parse_size
from broker.config.settings import (
    QUANT,
    BrokerConfig,
    CoreConfig,
    JournalConfig,
    PolicyConfig,
    TierConfig,
    config_from_dict,
    config_to_toml,
    core_from_json,
    core_to_json,
    load_config,
    parse_config,
    with_policy,
)

__all__ = [
    "QUANT",
    "SIZE_RE",
    "SIZE_UNITS",
    "BrokerConfig",
    "ConfigError",
    "CoreConfig",
    "JournalConfig",
    "PolicyConfig",
    "TierConfig",
    "config_from_dict",
    "config_to_toml",
    "core_from_json",
    "core_to_json",
    "format_size",
    "load_config",
    "parse_config",
    "parse_size",
    "with_policy",
]
