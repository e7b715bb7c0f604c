"""Replay predicts vLLM (issue 30): the hit count ``kvbroker replay --engine vllm`` reports
for a policy on a Mooncake trace is the one that policy realizes inside vLLM 0.33's real
CPUOffloadingManager at the same capacity; and a chunk vLLM evicts keeps its history (a
ghost in the core), so a chunk stored again is a re-reference.

Marker ``vllm`` (the [vllm] venv). The matrix here is every online policy at the three
sizes of issue 30 (1,953 / 5,859 / 19,531 chunks: 1M, 3M and 10M tokens) on the first
``REQUESTS`` requests of the synthetic trace, plus lru and arc on the whole trace;
``KVBROKER_VLLM_FULL=1`` runs every policy on the whole trace (about 20 minutes on 2
cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from policies import registry
from vllm_integration.manager_replay.engine import replay_requests

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[3]
SIZES = (1953, 5859, 19531)
FULL = os.environ.get("KVBROKER_VLLM_FULL", "") not in ("", "0")
REQUESTS = None if FULL else 800
ONLINE = [name for name in registry.names() if not registry.policy_class(name).offline]


MOONCAKE = ROOT / "tests" / "data" / "mooncake" / "synthetic_trace.jsonl"


def driver():  # type: ignore[no-untyped-def]
    """tests/vllm_integration/decisions_to_vllm/manager_driver.py, imported when a test runs (it imports vLLM,
    which only the [vllm] venv has; the main venv collects this file and deselects it)."""
    from tests.vllm_integration.decisions_to_vllm import manager_driver

    return manager_driver


def trace(limit: int | None) -> list[tuple[int, list[int]]]:
    with MOONCAKE.open() as f:
        rows = [json.loads(line) for line in f]
    return [(row["timestamp"], row["hash_ids"]) for row in rows[:limit]]


@pytest.fixture(scope="module")
def head() -> list[tuple[int, list[int]]]:
    return trace(REQUESTS)


@pytest.fixture(scope="module")
def whole() -> list[tuple[int, list[int]]]:
    return trace(None)


def in_vllm(policy: str, size: int, requests: list[tuple[int, list[int]]]) -> int:
    """The hits inside vLLM's manager, with the adapter's event time the trace's (replay's
    event time: ``manager_driver.mooncake_at_trace_time``)."""
    d = driver()
    hits, _ = d.mooncake_at_trace_time(d.kvbroker_manager(policy, size), requests)
    return hits


def check(policy: str, size: int, requests: list[tuple[int, list[int]]]) -> None:
    realized = in_vllm(policy, size, requests)
    predicted = replay_requests(requests, size, policy).hits
    assert realized > 0
    assert abs(predicted - realized) <= 0.03 * realized, f"{policy} at {size} chunks: replay {predicted}, inside vLLM {realized}"


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("policy", ONLINE)
def test_replay_predicts_every_online_policy_inside_vllm(policy: str, size: int, head: list[tuple[int, list[int]]]) -> None:
    check(policy, size, head)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_replay_predicts_vllm_on_the_whole_trace(policy: str, size: int, whole: list[tuple[int, list[int]]]) -> None:
    check(policy, size, whole)


def test_a_chunk_vllm_evicted_comes_back_with_its_history() -> None:
    """History outlives residency: through the real manager, a chunk evicted and stored
    again is a re-reference (its reuses and reads come back) while the core holds a ghost
    of it; with no ghosts (history_ghosts 0) it comes back as new."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    key = driver().key

    def run(ghosts: float) -> int:
        manager = driver().kvbroker_manager("lru", 2, history_ghosts=ghosts)
        for n, chunk in enumerate((1, 1, 2, 3, 1)):  # 1 read once, evicted by 2 and 3, stored again
            ctx = ReqContext(req_id=f"r{n}")
            manager.on_new_request(ctx)
            k = key(chunk)
            if manager.lookup(k, ctx) == LookupResult.HIT:
                manager.prepare_load([k], ctx)
                manager.complete_load([k], ctx)
            else:
                out = manager.prepare_store([k], ctx)
                assert out is not None
                manager.complete_store(out.keys_to_store, ctx)
            manager.on_request_finished(ctx)
        policy = manager._policy
        policy.flush()
        block = policy.local.core.blocks[key(1).hex()]
        return block.reuses

    assert run(8.0) == 1
    assert run(0.0) == 0


def test_replay_engine_vllm_on_the_command_line_matches_vllm(tmp_path: Path, head: list[tuple[int, list[int]]]) -> None:
    """`kvbroker replay --engine vllm` reports, for lru at 1M tokens, the hits vLLM's own
    LRU realizes (kvbroker's lru evicts exactly as vLLM's)."""
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join(json.dumps({"timestamp": t, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}) + "\n" for t, ids in head)
    )
    out = subprocess.run(
        [sys.executable, "-m", "broker.cli.main", "replay", "--trace", str(path), "--format", "mooncake", "--engine", "vllm",
         "--hbm", "1000000tok", "--policies", "lru", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    record = json.loads(out.stdout)[0]
    d = driver()
    hits, asked = d.mooncake(d.vllm_manager("lru", 1953), [ids for _, ids in head])
    assert (record["prefix_hits"], record["prompt_blocks"]) == (hits, asked)
    assert record["engine"] == "vllm"
