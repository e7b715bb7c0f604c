"""Config: defaults, sizes, and errors that name the key and the reason."""

from __future__ import annotations

import pytest

from broker.config import BrokerConfig, ConfigError, core_from_json, core_to_json, format_size, load_config, parse_config, parse_size


def test_defaults_have_hbm_dram_nvme_and_history_arc_with_a_file_journal() -> None:
    config = load_config(None)
    assert [t.name for t in config.core.tiers] == ["hbm", "dram", "nvme"]
    # lru until issue 30: the default is the policy that measured best across traces.
    assert config.core.policy.name == "history_arc"
    assert config.journal.url.startswith("file://")
    assert parse_config("") == BrokerConfig()


@pytest.mark.parametrize(("text", "size"), [("4096", 4096), ("16GiB", 16 * 2**30), ("1.5 KB", 1500), ("512MiB", 512 * 2**20)])
def test_sizes_parse_with_units(text: str, size: int) -> None:
    assert parse_size(text, "k") == size


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('[[tiers]]\nname = "hbm"\ncapacity = -5', "tiers[0].capacity: must be >= 0"),
        ('[[tiers]]\nname = "hbm"\ncapacity = "12 parsecs"', "tiers[0].capacity"),
        ('[[tiers]]\nname = "hbm"', "tiers[0].capacity: required"),
        ('[[tiers]]\nname = "hbm"\ncapacity = 10\nhigh_watermark = 1.5', "tiers[0].high_watermark"),
        ('[[tiers]]\nname = "hbm"\ncapacity = 10\nlow_watermark = 0.99', "tiers[0].low_watermark"),
        ('[[tiers]]\nname = "a"\ncapacity = 1\n[[tiers]]\nname = "a"\ncapacity = 1', "names must be unique"),
        ('[[tiers]]\nname = "hbm"\ncapacity = 10\ncapcity = 3', "tiers[0].capcity"),
        ('[policy]\nname = "nope"', "policy.name: unknown policy 'nope'"),
        ('[policy]\nname = "lru"\nparams = { speed = 3 }', "policy.params"),
        ("[broker]\nlisten = 5", "broker.listen: expected str"),
        ("[prefetch]\nmargin_us = -1", "prefetch.margin_us"),
        ("[surprise]\nx = 1", "unknown key(s) surprise"),
        ('[journal]\nack_after = "sometimes"', "journal.ack_after"),
        ('[cost]\nquant = "int3"', "cost.quant"),
        ("[[tiers]]\nname = 'hbm'\ncapacity = 10\nchannels = 0", "tiers[0].channels"),
        ("[policy\nname = ", "malformed TOML"),
    ],
)
def test_invalid_configs_are_refused_naming_the_key(text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert needle in str(info.value)


def test_a_missing_file_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(str(tmp_path / "absent.toml"))


def test_core_config_round_trips_through_the_journal_json() -> None:
    core = parse_config('[policy]\nname = "priority_lru"\n[[tiers]]\nname = "x"\ncapacity = "1MiB"').core
    assert core_from_json(core_to_json(core)) == core


@pytest.mark.parametrize(
    ("size", "text"),
    [(878, "878B"), (1023, "1023B"), (1024, "1.00KiB"), (512 * 2**20, "512.00MiB"), (4 * 2**30, "4.00GiB"), (3 * 2**40, "3.00TiB")],
)
def test_a_size_is_shown_in_the_largest_unit_it_fills_and_reads_back(size: int, text: str) -> None:
    """A chunk-counted tier (vLLM's CPU tier: one byte a chunk) reads 878B, not 0.00GiB."""
    assert format_size(size) == text
    assert parse_size(text, "k") == size
