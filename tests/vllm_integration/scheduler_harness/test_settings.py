"""The harness's settings, cost model, trace expansion and figures (no vLLM needed)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

import pytest

from vllm_integration.scheduler_harness.figures import percentile
from vllm_integration.scheduler_harness.settings import CostModel, HarnessError, HarnessSettings
from vllm_integration.scheduler_harness.trace import mooncake


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"gpu_blocks": 1}, "gpu_blocks"),
        ({"cpu_bytes": -1}, "cpu_bytes"),
        ({"cpu_chunk_tokens": 100}, "cpu_chunk_tokens"),
        ({"policy": "vllm:lfu"}, "policy"),
        ({"policy": "lru"}, "policy"),
        ({"cpu_bytes": 1000}, "cpu_bytes"),
        ({"store_threshold": 0}, "store_threshold"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 8}, "max_num_batched_tokens"),
        ({"time_scale": 0.0}, "time_scale"),
        ({"cost": CostModel(host_link_bytes_per_s=0)}, "cost.host_link_bytes_per_s"),
    ],
)
def test_a_bad_setting_is_named(change: dict[str, object], field: str) -> None:
    with pytest.raises(HarnessError, match=f"^{field}:"):
        dataclasses.replace(HarnessSettings(), **change).check()  # type: ignore[arg-type]


def test_the_cpu_tier_counts_chunks_from_bytes_and_the_gpu_bounds_a_request() -> None:
    s = HarnessSettings(gpu_blocks=1025, cpu_bytes=(1 << 30) + 5)
    s.check()
    # 512 tokens x 128 KiB = 64 MiB a chunk.
    assert s.cpu_chunks == 16
    assert s.max_model_len == 1024 * 16


def test_the_cost_model_adds_its_parts() -> None:
    cost = CostModel(step_overhead_s=1.0, prefill_s_per_token=0.5, kv_bytes_per_token=2, hbm_bytes_per_s=4.0, host_link_bytes_per_s=8.0)
    assert cost.step_seconds(10, 6) == 1.0 + 5.0 + 3.0
    assert cost.transfer_seconds(4) == 1.0


def test_a_mooncake_prompt_is_its_blocks_tokens(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 5, "input_length": 700, "output_length": 3, "hash_ids": [0, 1]},
        {"timestamp": 1, "input_length": 600, "output_length": 2, "hash_ids": [0, 2]},
        {"timestamp": 9, "input_length": 10, "output_length": 0, "hash_ids": [0]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, second = mooncake(str(path))  # by arrival; no output: skipped
    assert (first.arrival_s, second.arrival_s) == (0.001, 0.005)
    a, b = first.prompt(), second.prompt()
    assert (len(a), len(b)) == (600, 700)
    # Shared block 0: the same 512 tokens; then each its own block.
    assert a[:512] == b[:512] == list(range(512))
    assert a[512:] == list(range(2 * 512, 2 * 512 + 88)) and b[512:] == list(range(512, 512 + 188))


def test_percentile_is_a_value_that_occurred() -> None:
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile(list(range(1, 101)), 0.99) == 99


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--policies", "nope"], "--policies"),
        (["--policies", "belady"], "--policies"),
        (["--gpu-blocks", "x"], "a size list"),
        (["--gpu-blocks", "1"], "gpu_blocks"),
    ],
)
def test_the_bench_refuses_bad_input_in_one_line(args: list[str], field: str) -> None:
    root = pathlib.Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, str(root / "bench" / "vllm_scheduler.py"), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], done.stderr
