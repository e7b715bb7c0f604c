"""bench/policy_matrix.py: its figures are those of a direct `kvbroker replay` of the same
trace at the same size, its table marks the best online policy, and its summary measures
the candidate against the best of each cell."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import policy_matrix as pm
from bench import synthetic_prefix_traces as gen
from broker.cli.main import main


@pytest.fixture(scope="module")
def tiny() -> dict[str, Any]:
    return pm.matrix(["synthetic"], [0.05], ["lru", "arc"], engines=["replay", "libcachesim"], algorithms=["LRU"], requests=200, jobs=1)


def test_replay_figures_are_kvbroker_replays(tiny: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = gen.SYNTHETIC_TRACE.read_text().splitlines()[:200]
    trace = tmp_path / "first200.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    distinct = len({h for line in lines for h in json.loads(line)["hash_ids"]})
    chunks = int(0.05 * distinct)
    assert tiny["traces"]["synthetic"] == {
        "requests": 200,
        "chunks_asked": sum(len(json.loads(line)["hash_ids"]) for line in lines),
        "distinct_chunks": distinct,
    }
    argv = ["replay", "--trace", str(trace), "--format", "mooncake", "--no-decode", "--hbm", f"{chunks * 512}tok"]
    assert main([*argv, "--policies", "lru,arc,belady", "--json"]) == 0
    direct = {r["policy"]: r for r in json.loads(capsys.readouterr().out)}
    rows = {r["policy"]: r for r in tiny["rows"] if r["engine"] == "replay"}
    assert set(rows) == {"lru", "arc", "belady"}
    for policy, row in rows.items():
        assert row["chunks"] == chunks
        assert row["hits"] == direct[policy]["prefix_hits"]
        assert row["asked"] == direct[policy]["prompt_blocks"]
        assert row["ratio"] == pytest.approx(direct[policy]["prefix_hit_rate"])
    assert not rows["belady"]["online"] and rows["lru"]["online"]
    assert rows["belady"]["hits"] > rows["arc"]["hits"] > rows["lru"]["hits"] > 0


def test_libcachesim_runs_the_same_sequence_at_the_same_size(tiny: dict[str, Any]) -> None:
    # LRU is LRU: on the same chunk sequence and capacity, libCacheSim's equals kvbroker's.
    (lcs,) = [r for r in tiny["rows"] if r["engine"] == "libcachesim"]
    (lru,) = [r for r in tiny["rows"] if r["engine"] == "replay" and r["policy"] == "lru"]
    assert (lcs["policy"], lcs["chunks"], lcs["asked"]) == ("LRU", lru["chunks"], lru["asked"])
    assert lcs["hits"] == lru["hits"]


def test_the_table_shows_each_figure_and_marks_the_best_online(tiny: dict[str, Any]) -> None:
    rows = tiny["rows"]
    text = pm.table(rows, "synthetic", 0.05)
    by = {r["policy"]: r for r in rows if r["engine"] == "replay"}
    arc_line = next(line for line in text.splitlines() if "kvbroker:arc" in line)
    assert f"{by['arc']['hits']:,}*" in arc_line  # arc beats lru here; belady is never "best online"
    belady_line = next(line for line in text.splitlines() if "kvbroker:belady" in line)
    assert f"{by['belady']['hits']:,} " in belady_line and "*" not in belady_line
    assert "best online in replay: kvbroker:arc" in text


def row(engine: str, source: str, policy: str, hits: int, fraction: float = 0.02, online: bool = True) -> dict[str, Any]:
    return {
        "trace": "t",
        "fraction": fraction,
        "chunks": 10,
        "engine": engine,
        "source": source,
        "policy": policy,
        "online": online,
        "hits": hits,
        "asked": 100,
        "ratio": hits / 100,
        "seconds": 0.0,
    }


def test_the_summary_measures_the_candidate_against_each_cells_best_and_names_the_worst() -> None:
    rows = [
        # Cell 0.02: libCacheSim's MQ is best in replay; vLLM's arc inside vLLM; belady is no rival.
        row("replay", "kvbroker", "adaptive", 90),
        row("replay", "kvbroker", "belady", 200, online=False),
        row("libcachesim", "libCacheSim", "MQ", 100),
        row("vllm", "vllm", "arc", 80),
        row("vllm", "kvbroker", "adaptive", 60),
        # Cell 0.05: the candidate is best in replay, nothing ran in vLLM.
        row("replay", "kvbroker", "adaptive", 50, 0.05),
        row("replay", "kvbroker", "lru", 40, 0.05),
    ]
    first, second = pm.summary(rows, "adaptive")
    assert (first["replay_best"], first["replay_share_of_best"]) == ("libCacheSim:MQ", pytest.approx(0.9))
    assert (first["vllm_best"], first["vllm_share_of_best"]) == ("vllm:arc", pytest.approx(0.75))
    assert (second["replay_share_of_best"], second["vllm_share_of_best"]) == (1.0, None)
    text = pm.summary_text([first, second], "adaptive")
    assert "worst cell in replay: t at 0.02 (10 chunks): 90.0% of libCacheSim:MQ" in text
    assert "worst cell in vllm: t at 0.02 (10 chunks): 75.0% of vllm:arc" in text
    # Beside the share of the best: the share of the offline bound (replay's belady here).
    assert first["replay_share_of_belady"] == pytest.approx(0.45) and first["vllm_share_of_belady"] is None
    assert "45.0%" in text.splitlines()[2]


def test_vllm_cells_run_vllms_admission_settings_and_belady_through_prefix_lookups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's baseline is its best setting (lru and arc at store_threshold 1-4), and each
    vLLM cell has the offline bound run through the same prefix lookups."""
    assert set(pm.VLLM_BUILTINS) == {"lru", "arc", *(f"{p}@{t}" for p in ("lru", "arc") for t in (2, 3, 4))}
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(gen.SYNTHETIC_TRACE.read_text().splitlines()[:300]) + "\n")
    (task,) = pm.plan({"t": str(trace)}, [0.05], ["vllm"], ["lru"], [], belady=True)
    assert task.policies[:8] == tuple(f"vllm:{p}" for p in pm.VLLM_BUILTINS)
    assert task.policies[-2:] == ("kvbroker:lru", "offline:belady")
    monkeypatch.setattr(pm, "vllm_available", lambda: False)  # the emulated manager's path
    rows = {f"{r['source']}:{r['policy']}": r for r in pm.run_task(task)}
    assert set(rows) == {"vllm:lru", "kvbroker:lru", "offline:belady"}  # without vLLM: no arc, no thresholds
    assert rows["vllm:lru"]["hits"] == rows["kvbroker:lru"]["hits"]
    assert rows["offline:belady"]["hits"] > rows["kvbroker:lru"]["hits"] > 0 and not rows["offline:belady"]["online"]
    text = pm.table(pm.run_task(task), "t", 0.05)
    lru = next(line for line in text.splitlines() if line.lstrip().startswith("kvbroker:lru"))
    share = rows["kvbroker:lru"]["hits"] / rows["offline:belady"]["hits"]
    assert f"{share:.1%}" in lru


def test_bad_flags_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert pm.main(["--policies", "lru,belady"]) == 2
    assert "--policies: belady is offline" in capsys.readouterr().err
    assert pm.main(["--traces", "nosuch"]) == 2
    assert "--traces: unknown trace 'nosuch'" in capsys.readouterr().err
    assert pm.main(["--sizes", "0,0.5"]) == 2
    assert "--sizes" in capsys.readouterr().err
