"""Replays of what vLLM's CPU tier holds count in its unit, the chunk: a journal that
kvbroker's policy wrote inside vLLM, and ``--engine vllm``. Before, 1,953 chunks read as
``cpu=1.91KiB`` (one byte a chunk), and the table's hit_rate was 1.0000 on every row (every
access there is to a chunk vLLM holds) beside prefix_hit, vLLM's figure."""

from __future__ import annotations

import json
import random
from pathlib import Path

from broker.journal import JournalSource
from broker.replay.plan import PlannedSource, SweepSpec, plan_jobs
from broker.replay.replay import format_table, journal_config
from broker.replay.sweep import Source, job_label, run_jobs, single_tier
from broker.replay.traces import TraceOptions
from tests.vllm_integration.decisions_to_vllm.test_policy_calls import drive, translator

MOONCAKE_BPT = TraceOptions.bytes_per_token


def vllm_journal(tmp_path: Path) -> str:
    url = f"file://{tmp_path}/vllm.journal"
    t = translator("lru", 64, url)
    drive(t, random.Random(3), 400, 64)
    t.flush()
    t.local.close()
    return url


def test_a_vllm_journal_counts_its_cpu_tier_in_chunks(tmp_path: Path) -> None:
    url = vllm_journal(tmp_path)
    base = journal_config(JournalSource(url))
    assert base is not None
    spec = SweepSpec(["lru", "s3fifo"], {}, [{0: 64}, {0: 1953}])
    jobs = plan_jobs([PlannedSource(Source(journal=url), base, "lru")], spec)
    assert {job_label(job).split(" on ")[0] for job in jobs} == {
        "lru cpu=64 chunks",
        "lru cpu=1,953 chunks",
        "s3fifo cpu=64 chunks",
        "s3fifo cpu=1,953 chunks",
    }
    records = run_jobs(jobs, 1, log=lambda _line: None, progress=False)
    assert sorted(r["capacity_chunks"]["cpu"] for r in records) == [64, 64, 1953, 1953]
    table = format_table(records)
    assert "cpu=1,953 chunks" in table and "KiB" not in table and "B " not in table.replace("MiB_moved", "")
    header = table.splitlines()[0].split()
    assert "hit_rate" not in header and "prefix_hit" in header


def test_engine_vllm_rows_say_chunks_and_drop_the_hit_rate_that_is_always_1(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": i, "input_length": 2048, "output_length": 8, "hash_ids": [0, 1, 10 + i % 7, 20 + i]} for i in range(30)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = Source(trace=str(trace), fmt="mooncake", engine="vllm")
    spec = SweepSpec(["lru"], {}, [{0: 4 * 512 * MOONCAKE_BPT}, {0: 8 * 512 * MOONCAKE_BPT}])
    jobs = plan_jobs([PlannedSource(source, single_tier(0))], spec)
    records = run_jobs(jobs, 1, log=lambda _line: None, progress=False)
    assert [r["capacity_chunks"] for r in records] == [{"hbm": 4}, {"hbm": 8}]
    # Why the column goes: every access there is a chunk a lookup found, so it is 1.0 throughout.
    assert all(r["accesses"] > 0 and r["hit_rate"] == 1.0 for r in records)
    assert records[0]["prefix_hit_rate"] < 1.0
    table = format_table(records)
    header = table.splitlines()[0].split()
    assert "hit_rate" not in header and "prefix_hit" in header
    assert "hbm=4 chunks" in table and "hbm=8 chunks" in table
    assert f" {records[0]['prefix_hit_rate']:.4f} " in table.splitlines()[2]


def test_other_replays_keep_the_hit_rate_column_and_their_units(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 2, "hash_ids": [1, 2]}) + "\n")
    spec = SweepSpec(["lru"], {}, [{0: 1000 * MOONCAKE_BPT}, {0: 2000 * MOONCAKE_BPT}])
    jobs = plan_jobs([PlannedSource(Source(trace=str(trace), fmt="mooncake"), single_tier(0))], spec)
    records = run_jobs(jobs, 1, log=lambda _line: None, progress=False)
    assert all(r.get("capacity_chunks") is None for r in records)
    table = format_table(records)
    assert "hit_rate" in table.splitlines()[0] and "hbm=1,000tok" in table
