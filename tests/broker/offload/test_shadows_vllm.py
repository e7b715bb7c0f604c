"""Shadows and what-if sizes inside vLLM 0.33's real CPUOffloadingManager (issue 31): a
shadow of policy P at the decider's capacity reports exactly the hits P realizes deciding,
on the same stream; the decider's own figure is its lookup hits; a sampled what-if size is
within 0.02 of the exact hit ratio at 10,000 chunks or more, at two sampling rates.

The stream is the Mooncake synthetic trace, requests one after another, with the adapter
reading the trace's time (manager_driver.mooncake_at_trace_time). Marker ``vllm``."""

from __future__ import annotations

from typing import Any

import pytest

from tests.broker.offload.test_replay_predicts_vllm import in_vllm, trace

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SHADOWED = ("history_arc", "arc", "s3fifo", "lru")


@pytest.fixture(scope="module")
def whole() -> list[tuple[int, list[int]]]:
    return trace(None)


def run(policy: str, size: int, requests: list[tuple[int, list[int]]], **extra: Any) -> tuple[int, int, list[dict[str, Any]]]:
    """The stream through the real manager with ``policy`` deciding: (hits, asked, the
    policy's reported rows)."""
    from tests.broker.offload import manager_driver as d

    manager = d.kvbroker_manager(policy, size, **extra)
    hits, asked = d.mooncake_at_trace_time(manager, requests)
    snapshot = manager._policy.snapshot()
    assert snapshot["policy"] == policy and snapshot["capacity"] == size
    return hits, asked, snapshot["rows"]


@pytest.mark.parametrize("decider", ["lru", "history_arc"])
def test_each_shadow_reports_exactly_what_its_policy_realizes_deciding(decider: str, whole: list[tuple[int, list[int]]]) -> None:
    size = 1953
    shadows = [p for p in SHADOWED if p != decider]
    hits, asked, rows = run(decider, size, whole, shadows=",".join(shadows))
    by = {(r["role"], r["policy"]): r for r in rows}
    assert by[("decider", decider)]["hits"] == hits and by[("decider", decider)]["asked"] == asked
    realized = {}
    for policy in shadows:
        realized[policy] = in_vllm(policy, size, whole)
        row = by[("shadow", policy)]
        assert (row["hits"], row["asked"], row["capacity"]) == (realized[policy], asked, size), policy
    # The policies realize different figures here: a shadow that copied the decider fails.
    assert len(set(realized.values()) | {hits}) == len(shadows) + 1


@pytest.mark.parametrize("rate", [0.1, 0.05])
def test_a_sampled_whatif_size_is_within_two_points_of_the_exact_figure(rate: float, whole: list[tuple[int, list[int]]]) -> None:
    size = 19531  # 10M tokens; the sizes asked: 9,766 / 39,062 / 78,124 chunks
    _, asked, rows = run("history_arc", size, whole, whatif="0.5,2,4", whatif_sample=rate)
    sized = [r for r in rows if r["role"] == "whatif"]
    assert [r["capacity"] for r in sized] == [9766, 39062, 78124]
    for row in sized:
        assert row["sample_rate"] == rate and row["policy"] == "history_arc"
        exact = in_vllm("history_arc", row["capacity"], whole) / asked
        assert abs(row["hit_ratio"] - exact) <= 0.02, (row, exact)
