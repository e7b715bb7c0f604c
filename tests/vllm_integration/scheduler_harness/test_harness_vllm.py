"""The harness runs vLLM's own Scheduler, KVCacheManager and CPU offload tier (issue 39), on
300 requests of the Mooncake synthetic trace: the same inputs give the same figures, every
request's prompt tokens add up, and kvbroker's lru evicts exactly what vLLM's lru evicts.
Marker ``vllm`` (the [vllm] venv)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

from vllm_integration.scheduler_harness.figures import summarize  # noqa: E402
from vllm_integration.scheduler_harness.settings import HarnessSettings  # noqa: E402
from vllm_integration.scheduler_harness.trace import TraceRequest, mooncake  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
MOONCAKE = ROOT / "tests" / "data" / "mooncake" / "synthetic_trace.jsonl"


def harness() -> Any:
    """The harness's engine, imported when a test runs: it imports vLLM, which only the
    vLLM venv has (the main suite collects this module and deselects its tests)."""
    from vllm_integration.scheduler_harness import engine

    return engine


# A small engine, so that the GPU cache fills and the CPU tier evicts within 300 requests.
SMALL = HarnessSettings(gpu_blocks=4096, cpu_bytes=24 << 30, time_scale=2.0)


@pytest.fixture(scope="module")
def trace() -> list[TraceRequest]:
    return mooncake(str(MOONCAKE), limit=300)


@pytest.fixture(scope="module")
def runs(trace: list[TraceRequest]) -> dict[str, Any]:
    policies = ("vllm:lru", "kvbroker:lru", "kvbroker:history_arc")
    found = {p: harness().run(dataclasses.replace(SMALL, policy=p), trace) for p in policies}
    found["none"] = harness().run(dataclasses.replace(SMALL, cpu_bytes=0), trace)
    return found


def test_the_harness_is_vllms_scheduler_gpu_cache_and_cpu_tier() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    scheduler = harness().build_scheduler(SMALL)
    assert type(scheduler) is Scheduler
    assert type(scheduler.kv_cache_manager) is KVCacheManager
    assert scheduler.kv_cache_manager.enable_caching
    manager = harness().offload_manager(scheduler)
    assert type(manager) is CPUOffloadingManager
    # vLLM's CPUOffloadingSpec counts the chunks from the bytes: 24 GiB of 512-token chunks
    # at 128 KiB a token.
    assert manager._num_chunks == SMALL.cpu_chunks == 384
    assert harness().offload_manager(harness().build_scheduler(dataclasses.replace(SMALL, cpu_bytes=0))) is None


def test_both_tiers_serve_and_the_cpu_tier_evicts(runs: dict[str, Any]) -> None:
    lru = runs["vllm:lru"]
    assert sum(r.gpu_hit_tokens for r in lru.requests) > 0
    assert sum(r.cpu_hit_tokens for r in lru.requests) > 0
    assert lru.evicted
    none = runs["none"]
    assert sum(r.cpu_hit_tokens for r in none.requests) == 0 and not none.evicted
    # The CPU tier saves compute the GPU cache alone does not.
    saved = summarize("lru", lru, none).compute_saved
    assert saved is not None and saved > 0


def test_prompt_tokens_add_up_per_request(runs: dict[str, Any], trace: list[TraceRequest]) -> None:
    for name, result in runs.items():
        assert len(result.requests) + result.refused == len(trace), name
        for r in result.requests:
            assert r.gpu_hit_tokens + r.cpu_hit_tokens + r.computed_tokens == r.prompt_tokens, (name, r)
            assert r.first_token_s is not None and r.finished_s is not None and r.ttft_s > 0, (name, r)
            if r.preempted:
                assert r.executed_prefill_tokens >= r.computed_tokens, (name, r)
            else:
                # What the executor ran is what vLLM's stats call computed.
                assert r.executed_prefill_tokens == r.computed_tokens, (name, r)


def test_the_same_inputs_give_the_same_figures(runs: dict[str, Any], trace: list[TraceRequest]) -> None:
    settings = dataclasses.replace(SMALL, policy="kvbroker:history_arc")
    again = harness().run(settings, trace)
    first = runs["kvbroker:history_arc"]
    assert again.requests == first.requests
    assert again.evicted == first.evicted
    assert again.makespan_s == first.makespan_s


def test_kvbroker_lru_evicts_exactly_what_vllms_lru_evicts(runs: dict[str, Any]) -> None:
    vllm, kvbroker = runs["vllm:lru"], runs["kvbroker:lru"]
    assert len(vllm.evicted) > 100
    assert kvbroker.evicted == vllm.evicted
    assert kvbroker.requests == vllm.requests


def test_a_policy_that_decides_otherwise_shows_in_the_harness(runs: dict[str, Any]) -> None:
    # The comparison above could not fail if the policy were not consulted.
    assert runs["kvbroker:history_arc"].evicted != runs["vllm:lru"].evicted


def test_replay_engine_vllm_scheduler_on_the_command_line(tmp_path: Path, trace: list[TraceRequest]) -> None:
    """`kvbroker replay --engine vllm-scheduler` runs the harness with the job's policy
    deciding the CPU tier (--hbm in tokens), and reports the harness's figures."""
    lines = [*MOONCAKE.read_text().splitlines()[:120], ""]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines))
    out = subprocess.run(
        [sys.executable, "-m", "broker.cli.main", "replay", "--trace", str(path), "--format", "mooncake",
         "--engine", "vllm-scheduler", "--hbm", "131072tok", "--policies", "lru", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    record = json.loads(out.stdout)[0]
    cpu_bytes = 131072 * HarnessSettings().cost.kv_bytes_per_token
    direct = harness().run(HarnessSettings(cpu_bytes=cpu_bytes, policy="kvbroker:lru"), trace[:120])
    f = summarize("lru", direct)
    assert record["engine"] == "vllm-scheduler"
    assert (record["prompt_blocks"], record["prefix_hits"]) == (f.prompt_tokens, f.cpu_hit_tokens)
    assert (record["gpu_hit_tokens"], record["computed_tokens"]) == (f.gpu_hit_tokens, f.computed_tokens)
    assert record["ttft_p50_s"] == f.ttft_p50_s and record["cpu_chunks"] == 256
    assert record["evictions"] == len(direct.evicted)


def test_the_bench_prints_a_row_per_policy_against_the_baseline() -> None:
    args = ["--requests", "60", "--gpu-blocks", "4096", "--cpu-gib", "24", "--policies", "lru", "--store-thresholds", "1,2", "--json"]
    bench = str(ROOT / "bench" / "vllm_scheduler.py")
    out = subprocess.run([sys.executable, bench, *args], cwd=ROOT, capture_output=True, text=True, timeout=600, check=True)
    (cell,) = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    rows = {r["label"]: r for r in cell["rows"]}
    assert list(rows) == ["no CPU tier", "vllm:lru st1", "vllm:lru st2", "vllm:arc st1", "vllm:arc st2", "kvbroker:lru"]
    assert rows["no CPU tier"]["compute_saved"] == 0.0 and rows["no CPU tier"]["cpu_hit_tokens"] == 0
    same = ("gpu_hit_tokens", "cpu_hit_tokens", "computed_tokens", "ttft_p50_s", "ttft_p99_s", "evictions")
    assert [rows["kvbroker:lru"][k] for k in same] == [rows["vllm:lru st1"][k] for k in same]
    for r in rows.values():
        assert r["gpu_hit_tokens"] + r["cpu_hit_tokens"] + r["computed_tokens"] == r["prompt_tokens"]
