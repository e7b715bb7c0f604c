"""The kvds compatibility replay: kvbroker's ports reproduce the original simulator's figures.

Golden figures: decode-critical misses per decode-critical access on the original's own
deadline_pressure trace, as its simulator reports them (tests/data/kvds/README.md).
"""

from __future__ import annotations

import json
import pathlib

import pytest

from broker.replay.kvds_compat import MIB, KvdsCompat, read_events, replay_compat
from tests.golden import KVDS_DEADLINE_PRESSURE

# (policy, HBM MiB) -> decode-critical misses of 96 (the original: LRU, HotCold,
# PredictiveHotness, IntentAware, DeadlineAware at 128 and 512 MiB, DRAM 4096 MiB).
ORIGINAL = {
    ("lru", 128): 96,
    ("hotcold", 128): 96,
    ("predictive_hotness", 128): 96,
    ("intent_aware", 128): 6,
    ("deadline_aware", 128): 6,
    ("lru", 512): 96,
    ("hotcold", 512): 96,
    ("predictive_hotness", 512): 0,
    ("intent_aware", 512): 0,
    ("deadline_aware", 512): 0,
}


@pytest.mark.parametrize(("policy", "hbm_mib"), sorted(ORIGINAL))
def test_ports_reproduce_the_original_decode_critical_misses(policy: str, hbm_mib: int) -> None:
    got = replay_compat(str(KVDS_DEADLINE_PRESSURE), policy, hbm_mib * MIB)
    assert (got.dc_misses, got.dc_accesses) == (ORIGINAL[(policy, hbm_mib)], 96)
    # Every read of this trace is of a block marked DECODE_CRITICAL the step before.
    assert got.accesses == 96


def test_only_deadline_aware_replays_the_seed_prefetches() -> None:
    # The trace's 7 PREFETCHED lines: DeadlineAware's prefetch rule takes the HOT ones with
    # a 4 ms deadline (6 of 7 are still outside HBM at 128 MiB); IntentAware never prefetches.
    assert replay_compat(str(KVDS_DEADLINE_PRESSURE), "deadline_aware", 128 * MIB).prefetches == 6
    assert replay_compat(str(KVDS_DEADLINE_PRESSURE), "intent_aware", 128 * MIB).prefetches == 0


def snap(object_id: str, **over: object) -> dict[str, object]:
    intent: dict[str, object] = {
        "object_id": object_id,
        "request_id": "r",
        "block_id": 0,
        "object_type": "KV_CACHE",
        "phase": "PREFILL",
        "priority": "WARM",
        "allowed_tiers": ["HBM", "DRAM"],
        "current_tier": "HBM",
        "size_bytes": MIB,
        "request_priority": 50,
        "recency_score": 0.15,
        "deadline_us": None,
        "slack_us": None,
        "arrival_step": 0,
        "target_decode_step": None,
        "expected_reuse_window_tokens": None,
        "recompute_cost_us": None,
        "spill_cost_us": None,
        "compression_ok": False,
        "recompute_ok": False,
        "prefetch_ok": True,
        "pin_requested": False,
        "is_draft": False,
        "is_committed": False,
        "created_step": 0,
        "last_access_step": 0,
    }
    intent.update(over)
    return intent


def write(tmp_path: pathlib.Path, lines: list[tuple[int, str, dict[str, object]]]) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"step": s, "event_type": k, "intent": i}) + "\n" for s, k, i in lines))
    return str(path)


def test_labels_decay_and_stay_static(tmp_path: pathlib.Path) -> None:
    path = write(
        tmp_path,
        [
            (0, "ALLOCATED", snap("a", recency_score=0.7, deadline_us=700, target_decode_step=10)),
            (1, "MARKED_COLD", snap("a", priority="COLD", recency_score=0.1)),
            (1, "ALLOCATED", snap("b", current_tier="DRAM")),
            (5, "ALLOCATED", snap("c", current_tier="DRAM")),
        ],
    )
    sim = KvdsCompat("intent_aware", 4 * MIB)
    sim.run(read_events(path))
    # "a": 0.1 set at step 1, then one decay after each distinct step's first event (steps
    # 1 and 5): 0.1 - 0.03 - 0.03. "b", set after step 1's decay, has only step 5's.
    recency, age, deadline, steps = sim.terms("a")
    assert recency == pytest.approx(0.04) and recency == max(max(0.1 - 0.03, 0.0) - 0.03, 0.0)
    # MARKED_COLD wrote its (null) deadline but not the target step, which stays a label:
    # steps to it and the age are counted in steps from the current one (5).
    assert (age, deadline, steps) == (5.0, None, 5.0)
    assert sim.terms("b")[0] == max(0.15 - 0.03, 0.0)


def test_the_seed_cost_model_places_first_then_evicts(tmp_path: pathlib.Path) -> None:
    # HBM of 2 blocks. LRU's seed ignores pins: the pinned, least recently read block goes.
    lines = [
        (0, "ALLOCATED", snap("a", pin_requested=True)),
        (1, "ALLOCATED", snap("b", last_access_step=1)),
        (2, "ALLOCATED", snap("c", last_access_step=2)),
        (3, "ACCESSED", snap("a", phase="DECODE")),
    ]
    sim = KvdsCompat("lru", 2 * MIB)
    got = sim.run(read_events(write(tmp_path, lines)))
    assert [s.tier for s in sim.live.values()] == ["hbm", "dram", "hbm"]
    # "a" was spilled when "c" came, read back (a DECODE miss) and "b" left for it.
    assert (got.misses, got.dc_misses, got.dc_accesses, got.spills) == (1, 1, 1, 2)
    assert got.latency_us == 4 * 50 + 5000 + 2 * 200
    # IntentAware's seed takes pinned blocks only when all are pinned: "a" stays.
    sim = KvdsCompat("intent_aware", 2 * MIB)
    got = sim.run(read_events(write(tmp_path, lines)))
    assert sim.live["a"].tier == "hbm" and got.misses == 0


def test_the_replay_command_runs_the_compatibility_mode(capsys: pytest.CaptureFixture[str]) -> None:
    from broker.cli.main import main

    trace = str(KVDS_DEADLINE_PRESSURE)
    assert (
        main(["replay", "--trace", trace, "--format", "kvds-events", "--kvds-compat", "--policies", "lru", "--hbm", "512MiB", "--json"])
        == 0
    )
    [record] = json.loads(capsys.readouterr().out)
    assert (record["policy"], record["hbm_bytes"], record["dc_misses"], record["dc_accesses"]) == ("lru", 512 * MIB, 96, 96)
    # Wrong format, an offline policy: one line naming the problem, exit 2.
    assert main(["replay", "--trace", trace, "--format", "mooncake", "--kvds-compat"]) == 2
    assert "--kvds-compat needs --trace PATH --format kvds-events" in capsys.readouterr().err
    assert main(["replay", "--trace", trace, "--format", "kvds-events", "--kvds-compat", "--policies", "belady"]) == 2
    assert "belady needs the future" in capsys.readouterr().err


def test_in_kvbrokers_own_replay_deadline_edf_misses_fewer_than_deadline_aware_and_priority_lru() -> None:
    """kvbroker's importer and cost model (``--format kvds-events`` on KVDS_TIERS_TOML),
    128 MiB of HBM: the original's DeadlineAware misses 6 of 96 (ORIGINAL); deadline_edf,
    earliest pending deadline first within a class, keeps every hot tail the decode reads,
    at the price of more prefetch traffic (golden figures)."""
    from broker.config import parse_config
    from broker.replay.replay import replay
    from broker.replay.traces import TraceOptions, read_trace
    from broker.replay.traces.kvds import KVDS_TIERS_TOML

    batches = list(read_trace(str(KVDS_DEADLINE_PRESSURE), "kvds-events", TraceOptions()))
    config = parse_config(KVDS_TIERS_TOML).core
    got = {p: replay(lambda: ((1, b) for b in batches), config, p).metrics for p in ("priority_lru", "deadline_aware", "deadline_edf")}
    figures = {p: (m["dc_misses"], m["dc_accesses"], m["prefetches"]) for p, m in got.items()}
    assert figures == {"priority_lru": (6, 96, 583), "deadline_aware": (6, 96, 0), "deadline_edf": (0, 96, 1800)}
    assert got["deadline_edf"]["dc_misses"] < ORIGINAL[("deadline_aware", 128)]
