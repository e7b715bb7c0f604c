"""--plot draws what the table prints, and leaves out a chart with nothing to show."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from broker.cli.main import main
from broker.replay.plots import charts, write_plots
from broker.replay.replay import format_table

MOONCAKE = Path(__file__).parents[2] / "data" / "mooncake" / "synthetic_trace.jsonl"


def replay_records(tmp_path: Path, lines: int, *flags: str, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    trace = tmp_path / f"trace{lines}.jsonl"
    with MOONCAKE.open() as f:
        trace.write_text("".join(next(f) for _ in range(lines)))
    code = main(["replay", "--trace", str(trace), "--format", "mooncake", "--policies", "lru,fifo", "--jobs", "1", "--json", *flags])
    assert code == 0
    records: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return records


def table_hit_rates(records: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """(policy, capacity) -> the hit_rate column as the table prints it."""
    lines = format_table(records).splitlines()
    head = lines[0].split()
    rows = lines[2 : 2 + len(records)]  # a note may follow the rows (latencies that are copy queues)
    return {(row.split()[0], row.split()[1]): row.split()[head.index("hit_rate")] for row in rows}


def test_hit_rate_by_size_draws_the_tables_hit_rate_not_the_prefix_hit_rate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = replay_records(tmp_path, 40, "--hbm", "20000tok,60000tok", capsys=capsys)
    drawn = {c.name: c for c in charts(records)}
    hit = drawn["hit_rate.png"]
    table = table_hit_rates(records)
    assert len(table) == 4
    for policy, points in hit.series.items():
        for tokens, rate in points:
            assert f"{rate:.4f}" == table[(policy, f"hbm={int(tokens):,}tok")]
    # Decode accesses hit where prompt prefixes do not: the two differ, and the first is drawn.
    assert [r["prefix_hit_rate"] for r in records] != [r["hit_rate"] for r in records]
    assert any(rate > 0 for points in hit.series.values() for _, rate in points)
    assert "prefix_hit_rate.png" not in drawn  # no prompt block was a prefix hit: nothing to draw
    moved = drawn["bytes_moved.png"].series  # demotions moved bytes: drawn, at the largest size
    biggest = {r["policy"]: r for r in records if r["capacity_bytes"]["hbm"] == max(x["capacity_bytes"]["hbm"] for x in records)}
    assert moved == {p: [(r["bytes_up"] / 2**30, r["bytes_down"] / 2**30)] for p, r in biggest.items()}


def test_a_prompt_only_run_writes_no_bytes_moved_chart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = replay_records(tmp_path, 300, "--no-decode", "--hbm", "20000tok,60000tok", capsys=capsys)
    assert all(r["bytes_up"] == r["bytes_down"] == 0 for r in records)  # one tier: nothing moves
    written = {Path(p).name for p in write_plots(records, str(tmp_path / "plots"))}
    assert "bytes_moved.png" not in written and not (tmp_path / "plots" / "bytes_moved.png").exists()
    assert {"hit_rate.png", "prefix_hit_rate.png", "latency_cdf.png"} <= written
    prefix = {c.name: c for c in charts(records)}["prefix_hit_rate.png"].series
    assert prefix == {
        p: sorted((float(r["capacity_tokens"]["hbm"]), r["prefix_hit_rate"]) for r in records if r["policy"] == p) for p in ("lru", "fifo")
    }


def test_a_series_names_its_parameters_only_when_the_sweep_varies_them() -> None:
    def record(policy: str, params: dict[str, Any], hbm: int, hit: float) -> dict[str, Any]:
        return {
            "policy": policy,
            "params": params,
            "capacity_bytes": {"hbm": hbm},
            "capacity_tokens": None,
            "accesses": 10,
            "hit_rate": hit,
            "prompt_blocks": 0,
            "prefix_hits": 0,
            "bytes_up": 0,
            "bytes_down": 0,
        }

    records = [
        record("s3fifo", {"small_ratio": 0.1}, 2**30, 0.5),
        record("s3fifo", {"small_ratio": 0.2}, 2**30, 0.6),
        record("belady", {"size_window": 0}, 2**30, 0.9),
    ]
    (hit,) = charts(records)
    assert hit.series == {"belady": [(1.0, 0.9)], "s3fifo(small_ratio=0.1)": [(1.0, 0.5)], "s3fifo(small_ratio=0.2)": [(1.0, 0.6)]}
