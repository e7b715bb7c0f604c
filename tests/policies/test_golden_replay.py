"""Golden replays: every registered policy on the bundled Mooncake trace at three sizes.

Exact prefix-hit counts; belady's is the most at every size. A policy missing from the
golden file fails: print it with tests/golden_mooncake.py and review the numbers.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from policies import registry
from tests.golden_mooncake import SIZES_TOKENS, hits, prompt_batches

GOLDEN = json.loads((pathlib.Path(__file__).parents[1] / "data" / "golden_mooncake.json").read_text())["policies"]


@pytest.fixture(scope="module")
def batches() -> list:
    return prompt_batches()


@pytest.mark.parametrize("policy", registry.names())
def test_policy_replays_the_mooncake_trace_to_its_golden_hit_counts(batches: list, policy: str) -> None:
    assert policy in GOLDEN, f"{policy} has no golden counts: run tests/golden_mooncake.py and review"
    for tokens in SIZES_TOKENS:
        got = hits(batches, policy, tokens)
        assert got == GOLDEN[policy][str(tokens)], (policy, tokens)
        assert got["prefix_hits"] <= GOLDEN["belady"][str(tokens)]["prefix_hits"], (policy, tokens)
