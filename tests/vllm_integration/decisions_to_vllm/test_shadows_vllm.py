"""Shadows and what-if sizes inside vLLM 0.33's real CPUOffloadingManager (issue 31): a
shadow of policy P at the decider's capacity reports exactly the hits P realizes deciding,
on the same stream; the decider's own figure is its lookup hits; a sampled what-if size is
within 0.02 of the exact hit ratio at 10,000 chunks or more, at two sampling rates.

The stream is the Mooncake synthetic trace, requests one after another, with the adapter
reading the trace's time (manager_driver.mooncake_at_trace_time). Marker ``vllm``."""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm_integration.decisions_to_vllm.test_replay_predicts_vllm import in_vllm, trace

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SHADOWED = ("history_arc", "arc", "s3fifo", "lru")


@pytest.fixture(scope="module")
def whole() -> list[tuple[int, list[int]]]:
    return trace(None)


def run(policy: str, size: int, requests: list[tuple[int, list[int]]], **extra: Any) -> tuple[int, int, list[dict[str, Any]]]:
    """The stream through the real manager with ``policy`` deciding: (hits, asked, the
    policy's reported rows)."""
    from tests.vllm_integration.decisions_to_vllm import manager_driver as d

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


def test_a_live_switch_rebuilds_the_shadows_it_changes_and_keeps_the_others(tmp_path: Any, whole: list[tuple[int, list[int]]]) -> None:
    """kvbroker_settings_file names new shadows and a new decider mid-stream: the kept shadow
    goes on counting, the new one starts, the decider's figure starts over for the new policy."""
    import json

    from tests.vllm_integration.decisions_to_vllm import manager_driver as d

    settings_file = tmp_path / "kvbroker.json"
    settings_file.write_text(json.dumps({"kvbroker_shadows": "arc,s3fifo"}))
    manager = d.kvbroker_manager("lru", 1953, settings_file=str(settings_file), settings_poll_s=3600)
    policy = manager._policy
    half = len(whole) // 2
    d.mooncake_at_trace_time(manager, whole[:half])
    before = {(r["role"], r["policy"]): r for r in policy.snapshot()["rows"]}
    assert set(before) == {("decider", "lru"), ("shadow", "arc"), ("shadow", "s3fifo")}
    settings_file.write_text(json.dumps({"kvbroker_policy": "history_arc", "kvbroker_shadows": "arc,lru"}))
    assert policy.live.check()
    policy.translator.reload_now()  # what vLLM's thread does at its next call
    d.mooncake_at_trace_time(manager, whole[half:])
    after = {(r["role"], r["policy"]): r for r in policy.snapshot()["rows"]}
    assert set(after) == {("decider", "history_arc"), ("shadow", "arc"), ("shadow", "lru")}
    assert after[("shadow", "arc")]["asked"] > before[("shadow", "arc")]["asked"]  # kept, still counting
    second = sum(len(ids) for _, ids in whole[half:])
    assert after[("decider", "history_arc")]["asked"] == second == after[("shadow", "lru")]["asked"]


def test_the_shadows_and_sizes_reach_the_metrics_and_the_status_file(tmp_path: Any, whole: list[tuple[int, list[int]]]) -> None:
    """Every row snapshot() reports is a Prometheus series (labels role, policy, capacity,
    sample_rate) and a row of the status file, with the same figures."""
    import json
    import urllib.request

    from tests.vllm_integration.decisions_to_vllm import manager_driver as d

    status = tmp_path / "status.json"
    manager = d.kvbroker_manager(
        "history_arc", 19531, shadows="arc", whatif="0.5,2", metrics_port=0, status_file=str(status), status_s=3600
    )
    policy = manager._policy
    d.mooncake_at_trace_time(manager, whole[:1500])
    rows = policy.snapshot()["rows"]
    assert [(r["role"], r["policy"], r["capacity"], r["sample_rate"]) for r in rows] == [
        ("decider", "history_arc", 19531, 1.0),
        ("shadow", "arc", 19531, 1.0),
        ("whatif", "history_arc", 9766, 0.1),
        ("whatif", "history_arc", 39062, 0.1),
    ]
    with urllib.request.urlopen(policy.reporter.metrics_url, timeout=10) as answer:
        text = answer.read().decode()
    for row in rows:
        labels = f'capacity="{row["capacity"]}",policy="{row["policy"]}",role="{row["role"]}",sample_rate="{row["sample_rate"]:g}"'
        assert f"kvbroker_vllm_hits_total{{{labels}}} {float(row['hits'])}" in text, (labels, text[:2000])
        assert f"kvbroker_vllm_lookups_total{{{labels}}} {float(row['asked'])}" in text
    policy.close()
    assert json.loads(status.read_text())["rows"] == rows


def test_a_shadow_that_fails_is_logged_and_counted_and_vllm_goes_on(whole: list[tuple[int, list[int]]], caplog: Any) -> None:
    """A shadow decides nothing: its exception must not reach vLLM's scheduler, the decider
    decides as without it, and the figures go on without the failed requests."""
    import logging

    from tests.vllm_integration.decisions_to_vllm import manager_driver as d

    caplog.set_level(logging.ERROR, logger="vllm.kvbroker")
    manager = d.kvbroker_manager("lru", 1953, shadows="arc")
    policy = manager._policy
    (shadow,) = policy.shadows.full
    real = shadow.request
    calls = [0]

    def flaky(*args: Any) -> None:
        calls[0] += 1
        if calls[0] % 2:
            raise RuntimeError("a broken shadow")
        real(*args)

    shadow.request = flaky  # type: ignore[method-assign]
    requests = whole[:400]
    hits, asked = d.mooncake_at_trace_time(manager, requests)
    alone, _ = d.mooncake_at_trace_time(d.kvbroker_manager("lru", 1953), requests)
    assert hits == alone  # the decider decided as it does alone
    assert policy.shadow_errors == 200
    assert len([r for r in caplog.records if "a shadow failed" in r.getMessage()]) == 3  # the first few only
    rows = {(r["role"], r["policy"]): r for r in policy.snapshot()["rows"]}
    assert rows[("decider", "lru")]["asked"] == asked
    assert 0 < rows[("shadow", "arc")]["asked"] < asked
