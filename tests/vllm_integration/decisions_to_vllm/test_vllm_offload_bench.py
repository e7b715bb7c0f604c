"""bench/vllm_offload.py, the try-it without a GPU: on the first requests of the synthetic
trace it drives vLLM's real CPUOffloadingManager and prints vLLM's settings (lru and arc at
store_threshold 1-4) beside kvbroker's policies, each with its share of Belady's hits and
replay's prediction, and the default against vLLM's default and vLLM's best setting. The
table's figures are checked against direct runs of the manager, not against constants.
Marker ``vllm`` (the [vllm] venv; .ci/run's vllm step runs this)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from broker.replay.belady_prefix import belady_prefix_hits

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]
REQUESTS = 300


def test_the_try_it_prints_vllms_settings_kvbrokers_policies_belady_and_replay() -> None:
    from tests.vllm_integration.decisions_to_vllm import manager_driver as d

    argv = ["--requests", str(REQUESTS), "--sizes", "200,600", "--policies", "history_arc,lru", "--no-cost"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "vllm_offload.py"), *argv], capture_output=True, text=True, env=env, timeout=500
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    requests = list(d.mooncake_requests(REQUESTS))
    asked = sum(map(len, requests))
    for size in (200, 600):
        section = out.split(f"CPU tier of {size} chunks")[1].split("CPU tier of")[0]
        bound = belady_prefix_hits(requests, size)
        assert f"Belady: {bound} hits" in section
        rows = {m[0].strip(): int(m[1]) for m in re.findall(r"^  (\S.*?)\s{2,}(\d+)\s+0\.\d{4}", section, re.M)}
        for policy in ("lru", "arc"):
            for t in (1, 2, 3, 4):
                label = f"vLLM {policy}" + (f", store_threshold {t}" if t > 1 else "")
                hits, _ = d.mooncake(d.vllm_manager(policy, size, store_threshold=t), requests)
                assert rows[label] == hits, (label, section)
        assert rows["kvbroker lru"] == rows["vLLM lru"]
        mine = rows["kvbroker history_arc (default)"]
        best = max(v for k, v in rows.items() if k.startswith("vLLM"))
        assert f"{mine / rows['vLLM lru']:.3f}x vLLM's default (lru)" in section
        assert f"{mine / best:.3f}x vLLM's best setting here" in section
        assert f"{mine / bound:.1%} of Belady's hits" in section
        assert all(v <= bound for v in rows.values())
        # Replay's prediction beside each kvbroker row, within 3%.
        diffs = [float(x) for x in re.findall(r"^  kvbroker .* ([+-]\d+\.\d)%$", section, re.M)]
        assert len(diffs) == 2 and all(abs(x) <= 3.0 for x in diffs), section
    assert asked > 0 and "200: identical" in out and "600: identical" in out
