"""docs/configuration.md shows the whole configuration with its defaults: keep it true."""

from __future__ import annotations

import pathlib
import re
import tomllib

from broker.config.settings import config_to_toml, parse_config

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def documented_toml() -> str:
    match = re.search(r"```toml\n(.*?)```", DOC.read_text(), re.S)
    assert match is not None, "docs/configuration.md lost its TOML block"
    return match.group(1)


def test_the_documented_config_is_the_default_config() -> None:
    documented = parse_config(documented_toml())
    assert documented == parse_config("")


def test_every_key_of_the_config_is_documented() -> None:
    documented = tomllib.loads(documented_toml())
    defaults = tomllib.loads(config_to_toml(parse_config("")))
    for table, keys in defaults.items():
        if table == "tiers":
            assert [t["name"] for t in documented["tiers"]] == [t["name"] for t in keys]
            for tier in keys:
                assert set(tier) <= set(documented["tiers"][0]), f"tiers: {set(tier) - set(documented['tiers'][0])}"
            continue
        missing = set(keys) - set(documented.get(table, {}))
        assert not missing, f"[{table}] keys missing from docs/configuration.md: {sorted(missing)}"
