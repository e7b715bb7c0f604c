"""Issue 25: parameter sweeps (--param), fleet replay (several journals, or a pattern) with
a fleet total row, and what --ray says where Ray is not installed."""

from __future__ import annotations

import csv
import io
import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from broker.cli.main import main
from broker.model.stats import CoreStats
from broker.replay.fleet import expand_journals, fleet_total
from broker.replay.grid import parse_params
from broker.replay.replay import ReplayResult
from policies.base import PolicyError
from tests.broker.replay.fleet_journals import copy_to_redis, file_journals
from tests.conftest import REDIS_URL


def replay(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["replay", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- --param ----------------------------------------------------------------------------------


def test_params_make_the_cartesian_product_in_the_parameters_types() -> None:
    grid = parse_params(
        ["deadline_edf.guard_us=250,500", "deadline_edf.stale_after_us=1000,5000", "bayesian_reuse.prior_alpha=2"],
        ["lru", "deadline_edf", "bayesian_reuse"],
    )
    assert grid["deadline_edf"] == [
        {"guard_us": 250, "stale_after_us": 1000},
        {"guard_us": 250, "stale_after_us": 5000},
        {"guard_us": 500, "stale_after_us": 1000},
        {"guard_us": 500, "stale_after_us": 5000},
    ]
    assert grid["bayesian_reuse"] == [{"prior_alpha": 2.0}] and isinstance(grid["bayesian_reuse"][0]["prior_alpha"], float)
    assert "lru" not in grid


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (
            "deadline_edf.guard=1",
            "--param deadline_edf.guard=1: policy deadline_edf has no parameter guard "
            "(its parameters: stale_after_us, guard_us, default_recompute_us)",
        ),
        ("lru.x=1", "policy lru has no parameter x (its parameters: none)"),
        ("deadline_edf.guard_us=fast", "deadline_edf.guard_us: expected an integer, got 'fast'"),
        ("deadline_edf.guard_us=-5", "policy deadline_edf: guard_us must be an integer >= 0, got -5 (in deadline_edf(guard_us=-5))"),
        ("bayesian_reuse.prior_beta=0", "prior_beta must be a number > 0, got 0.0"),
        ("deadline_edf=1", "expected POLICY.KEY=V1,V2,..."),
        ("deadline_edf.guard_us=", "no values for deadline_edf.guard_us"),
        ("nope.k=1", "unknown policy 'nope'"),
        ("fifo.k=1", "policy fifo is not in this sweep (policies: lru, deadline_edf, bayesian_reuse)"),
    ],
)
def test_a_bad_param_is_refused_naming_the_policy_and_the_key(flag: str, message: str) -> None:
    with pytest.raises(PolicyError) as refused:
        parse_params([flag], ["lru", "deadline_edf", "bayesian_reuse"])
    assert message in str(refused.value)


def test_the_cli_refuses_a_bad_param_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    journal = file_journals(tmp_path)[0]
    code, out, err = replay(["--journal", f"file://{journal}", "--policy", "deadline_edf", "--param", "deadline_edf.guard=1"], capsys)
    assert code == 2 and out == ""
    assert "kvbroker replay: --param deadline_edf.guard=1: policy deadline_edf has no parameter guard" in err


def test_swept_params_are_in_each_record_and_change_the_outcome(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    journal = file_journals(tmp_path)[0]
    argv = ["--journal", f"file://{journal}", "--policy", "lru,deadline_edf", "--param", "deadline_edf.stale_after_us=0,1000000"]
    code, out, err = replay([*argv, "--json", "--jobs", "1"], capsys)
    assert code == 0, err
    records = json.loads(out)
    assert [(r["policy"], r["params"]) for r in records] == [
        ("lru", {}),
        ("deadline_edf", {"stale_after_us": 0, "guard_us": 500, "default_recompute_us": 4000}),
        ("deadline_edf", {"stale_after_us": 1000000, "guard_us": 500, "default_recompute_us": 4000}),
    ]
    code, table, err = replay([*argv, "--jobs", "1"], capsys)
    assert code == 0, err
    assert "params" in table.splitlines()[0] and "stale_after_us=1000000" in table


# ---- fleets ------------------------------------------------------------------------------------


@pytest.fixture
def redis_fleet(tmp_path: Path) -> Iterator[tuple[list[Path], str, list[str]]]:
    paths = file_journals(tmp_path)
    prefix = f"kvbroker-test:{uuid.uuid4().hex}"
    keys = copy_to_redis(paths, REDIS_URL, prefix)
    try:
        yield paths, prefix, keys
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        client.delete(*keys, *(f"{k}:directives" for k in keys))
        client.close()


@pytest.mark.redis
def test_a_stream_pattern_names_every_matching_journal_and_no_directives_stream(redis_fleet: tuple[list[Path], str, list[str]]) -> None:
    _, prefix, keys = redis_fleet
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.xadd(f"{prefix}:pod-a:journal:directives", {"k": "3"})  # a directives stream the pattern also matches
        client.set(f"{prefix}:pod-z:journal", "not a stream")
        assert expand_journals([f"{REDIS_URL}?stream={prefix}:*"]) == [(REDIS_URL, k) for k in sorted(keys)]
        assert expand_journals([REDIS_URL], stream=f"{prefix}:*:journal") == [(REDIS_URL, k) for k in sorted(keys)]
    finally:
        client.delete(f"{prefix}:pod-z:journal")
        client.close()
    with pytest.raises(Exception, match=r"no stream matches 'kvbroker-test:none-\*'"):
        expand_journals([f"{REDIS_URL}?stream=kvbroker-test:none-*"])


def test_a_file_pattern_names_every_matching_journal(tmp_path: Path) -> None:
    paths = file_journals(tmp_path)
    assert expand_journals([f"file://{tmp_path}/pod-*.journal"]) == [(f"file://{p}", None) for p in sorted(paths)]
    assert expand_journals([f"file://{paths[0]}", f"file://{paths[0]}"]) == [(f"file://{paths[0]}", None)], "named twice: one source"
    with pytest.raises(Exception, match="no journal file matches"):
        expand_journals([f"file://{tmp_path}/none-*.journal"])


@pytest.mark.redis
def test_a_fleet_replays_per_pod_with_a_total_row_in_table_json_and_csv(
    redis_fleet: tuple[list[Path], str, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, prefix, keys = redis_fleet
    argv = ["--journal", f"{REDIS_URL}?stream={prefix}:*:journal", "--policy", "lru,deadline_edf", "--hbm", "32MiB,96MiB", "--jobs", "1"]
    code, out, err = replay([*argv, "--json", "--csv", str(tmp_path / "fleet.csv")], capsys)
    assert code == 0, err
    records = json.loads(out)
    pods = [f"{REDIS_URL}?stream={k}" for k in sorted(keys)]
    assert [r["source"] for r in records] == [*pods, "fleet"] * 4
    for total_at in range(2, len(records), 3):
        a, b, total = records[total_at - 2 : total_at + 1]
        assert total["sources"] == 2 and total["policy"] == a["policy"] == b["policy"]
        for field in ("events", "accesses", "evictions", "demotions", "bytes_moved", "deadline_misses", "dc_misses"):
            assert total[field] == a[field] + b[field], field
        assert total["capacity_bytes"] == {t: a["capacity_bytes"][t] + b["capacity_bytes"][t] for t in a["capacity_bytes"]}
        top = next(iter(total["accesses_by_tier"]))
        assert total["hit_rate"] == pytest.approx(
            (a["accesses_by_tier"][top] + b["accesses_by_tier"][top]) / (a["accesses"] + b["accesses"])
        )
        assert total["mean_us"] == pytest.approx((a["mean_us"] * a["accesses"] + b["mean_us"] * b["accesses"]) / total["accesses"])
    rows = list(csv.DictReader(io.StringIO((tmp_path / "fleet.csv").read_text())))
    assert [row["source"] for row in rows] == [r["source"] for r in records] and rows[2]["sources"] == "2"
    code, table, err = replay(argv, capsys)
    assert code == 0, err
    lines = table.splitlines()
    assert lines[0].split()[0] == "source" and sum(line.startswith("fleet (2)") for line in lines) == 4
    assert any(line.startswith(keys[0]) for line in lines)


def test_fleet_percentiles_come_from_the_merged_histograms() -> None:
    """Two pods whose p99 alone would be 10 and 5000: the fleet's is read off the sum."""

    def pod(hist: dict[int, int], source: str) -> dict[str, Any]:
        stats = CoreStats(1)
        stats.latency_hist = dict(hist)
        accesses = sum(hist.values())
        stats.accesses_by_tier = [accesses, 0]
        record = ReplayResult("lru", 1, accesses, 0, 1.0, stats.as_dict(["hbm"])).as_record()
        record.update(
            source=source, params={}, intent="full", seconds=1.0, skipped_lines=0, capacity_bytes={"hbm": 10}, capacity_tokens=None
        )
        record["latency_hist"] = {str(k): v for k, v in hist.items()}
        return record

    a = pod({10: 990, 5000: 10}, "a")
    b = pod({10: 10, 5000: 990}, "b")
    total = fleet_total([a, b])
    assert total["p50_us"] == 10 and total["p99_us"] == 5000 and total["p95_us"] == 5000
    assert total["latency_hist"] == {"10": 1000, "5000": 1000} and total["source"] == "fleet" and total["sources"] == 2


def test_ray_flag_without_ray_says_how_to_install_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError, as where it is not installed
    journal = file_journals(tmp_path)[0]
    code, out, err = replay(["--journal", f"file://{journal}", "--policy", "lru", "--ray"], capsys)
    assert code == 2 and out == ""
    line = err.strip().splitlines()[-1]
    assert line.startswith("kvbroker replay: --ray needs Ray (the [ray] extra); install it in a venv of its own: ")
    assert "python3 -m venv .venv-ray && .venv-ray/bin/pip install -e '.[ray]'" in line
