"""Ghosts are bounded in count, not only in bytes (issue 41 item 12): with 1-byte blocks
the bytes bound (history.ghosts x the tiers' capacity) meant ~8.6e9 ghosts at the README's
tiers, ~214 bytes each; `history.max_ghosts` (default 1,000,000) keeps the newest that many,
the oldest going first, live and in replay alike."""

from __future__ import annotations

import dataclasses

import pytest

from broker.config import ConfigError, core_from_json, core_to_json, parse_config
from broker.config.settings import DEFAULT_MAX_GHOSTS
from tests.builders import Driver, alloc, free

TIERS = """
[[tiers]]
name = "hbm"
capacity = "16GiB"
"""


def churn(driver: Driver, first: int, count: int, per_batch: int = 200) -> None:
    """One client allocates and frees ``count`` distinct 1-byte blocks, as the abuse did."""
    for start in range(first, first + count, per_batch):
        ids = [f"b{n}" for n in range(start, min(start + per_batch, first + count))]
        driver.send(*(alloc(i, size=1, ts=start) for i in ids), free(*ids, ts=start))


def test_one_client_freeing_1_byte_blocks_keeps_at_most_max_ghosts_the_newest() -> None:
    config = parse_config("[history]\nmax_ghosts = 500\n" + TIERS)
    assert config.core.history_max_ghosts == 500
    driver = Driver(config)
    churn(driver, 0, 5_000)
    ghosts = driver.core.ghosts
    # 16 GiB x 8 in bytes would keep all 5,000 (and billions more): the count bound holds.
    assert len(ghosts) == 500
    assert list(ghosts) == [f"b{n}" for n in range(4_500, 5_000)]
    # A kept ghost revives with its history; one evicted by the count comes back new.
    driver.send(alloc("b4999", size=1, ts=10_000), alloc("b0", size=1, ts=10_000))
    assert driver.core.blocks["b4999"].reuses == 1 and driver.core.blocks["b0"].reuses == 0


def test_the_count_bound_applies_on_reconfigure_and_0_leaves_the_bytes_bound_alone() -> None:
    config = parse_config("[history]\nmax_ghosts = 0\n" + TIERS)
    driver = Driver(config)
    churn(driver, 0, 3_000)
    assert len(driver.core.ghosts) == 3_000  # no count bound: the bytes bound holds them all
    driver.core.follow(dataclasses.replace(config.core, history_max_ghosts=1_000), 2)
    assert list(driver.core.ghosts) == [f"b{n}" for n in range(2_000, 3_000)]


def test_max_ghosts_defaults_to_a_million_and_is_journaled() -> None:
    core = parse_config("").core
    assert core.history_max_ghosts == DEFAULT_MAX_GHOSTS == 1_000_000
    assert core_from_json(core_to_json(core)) == core
    # A journal written before the key ran without a count bound: it replays so.
    old = core_to_json(core).replace('"history_max_ghosts": 1000000, ', "")
    assert "history_max_ghosts" not in old
    assert core_from_json(old).history_max_ghosts == 0


@pytest.mark.parametrize("value", ["-1", "1.5", "true", '"1"', str(2**41)])
def test_a_bad_max_ghosts_is_refused_naming_the_key(value: str) -> None:
    with pytest.raises(ConfigError, match=r"history\.max_ghosts"):
        parse_config(f"[history]\nmax_ghosts = {value}\n")
