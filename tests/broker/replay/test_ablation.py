"""A kv_deadline_scheduler trace under lru and deadline_aware, and the intent ablation.

The trace is made here in the seed's own event format (64 requests x 24 blocks of 1 MiB
against 128 MiB of HBM, the seed's 12x pressure), decoding in round robin; one step ahead
the engine marks the next request's blocks DECODE_CRITICAL (which also pins them).
"""

from __future__ import annotations

import json

import pytest

from broker.config import parse_config
from broker.replay.replay import replay
from broker.replay.traces import TraceOptions, read_trace
from broker.replay.traces.kvds import KVDS_TIERS_TOML

REQUESTS, BLOCKS, ROUNDS = 64, 24, 3


def snapshot(req: int, block: int, step: int, **over: object) -> dict[str, object]:
    intent: dict[str, object] = {
        "object_id": f"req-{req:03d}:block:{block}",
        "request_id": f"req-{req:03d}",
        "block_id": block,
        "object_type": "KV_CACHE",
        "phase": "DECODE",
        "priority": "WARM",
        "allowed_tiers": ["HBM", "DRAM", "CXL", "NVME"],
        "current_tier": "HBM",
        "size_bytes": 1 << 20,
        "request_priority": 50,
        "recency_score": 1.0,
        "deadline_us": None,
        "slack_us": None,
        "arrival_step": 0,
        "target_decode_step": None,
        "expected_reuse_window_tokens": None,
        "recompute_cost_us": 4000,
        "spill_cost_us": 300,
        "compression_ok": False,
        "recompute_ok": True,
        "prefetch_ok": True,
        "pin_requested": False,
        "is_draft": False,
        "is_committed": False,
        "created_step": 0,
        "last_access_step": step,
    }
    intent.update(over)
    return intent


def line(step: int, kind: str, intent: dict[str, object]) -> str:
    return json.dumps({"step": step, "event_type": kind, "intent": intent, "reason": None, "latency_us": None})


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> str:
    lines = []
    for r in range(REQUESTS):
        for b in range(BLOCKS):
            lines.append(line(0, "ALLOCATED", snapshot(r, b, 0, phase="PREFILL", current_tier="DRAM")))
    step = 1
    for _ in range(ROUNDS):
        for r in range(REQUESTS):
            nxt = (r + 1) % REQUESTS
            critical = {"priority": "DECODE_CRITICAL", "pin_requested": True, "slack_us": 100}
            for b in range(BLOCKS):  # the scheduler knows the next step's request
                lines.append(line(step, "MARKED_DECODE_CRITICAL", snapshot(nxt, b, step, deadline_us=1000, **critical)))
            for b in range(BLOCKS):
                lines.append(line(step, "ACCESSED", snapshot(r, b, step, deadline_us=0, **critical)))
            for b in range(BLOCKS):
                lines.append(line(step, "MARKED_COLD", snapshot(r, b, step, priority="COLD")))
            step += 1
    path = tmp_path_factory.mktemp("kvds") / "pressure.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def run(trace: str, policy: str, ablate: bool) -> dict:
    batches = list(read_trace(trace, "kvds-events", TraceOptions()))
    # Prefetch early enough for a whole step's 24 blocks to arrive over two copy channels.
    config = parse_config(KVDS_TIERS_TOML + "\n[prefetch]\nmargin_us = 2000\n").core
    return replay(lambda: ((1, b) for b in batches), config, policy, ablate_intent=ablate).metrics


def test_kvds_trace_replays_with_per_access_decode_critical_miss_rates(trace: str) -> None:
    lru = run(trace, "lru", False)
    deadline = run(trace, "deadline_aware", False)
    for m in (lru, deadline):
        assert m["rejected_events"] == 0
        # Per access: every decode step reads 24 decode-critical blocks.
        assert m["dc_accesses"] == ROUNDS * REQUESTS * BLOCKS
        assert m["dc_miss_rate"] == m["dc_misses"] / m["dc_accesses"]
    # Announced one step ahead, the intent policy prefetches what LRU must fetch on demand.
    assert deadline["prefetches"] > 0 and lru["prefetches"] == 0
    assert deadline["dc_miss_rate"] < lru["dc_miss_rate"]


def test_stripping_intent_changes_the_intent_policy_and_not_lru(trace: str) -> None:
    lru_full, lru_bare = run(trace, "lru", False), run(trace, "lru", True)
    keys = ("accesses_by_tier", "dc_misses", "demotions", "evictions", "prefetches", "bytes_moved", "p99_us")
    assert {k: lru_full[k] for k in keys} == {k: lru_bare[k] for k in keys}
    deadline_full, deadline_bare = run(trace, "deadline_aware", False), run(trace, "deadline_aware", True)
    # Measured against what the engine said, with and without the policy seeing it.
    assert deadline_full["dc_accesses"] == deadline_bare["dc_accesses"]
    assert deadline_bare["prefetches"] == 0
    assert deadline_bare["dc_miss_rate"] > deadline_full["dc_miss_rate"]


# ---- what the ablation strips ---------------------------------------------------------------

STRIPPED = {
    "phase": 0,
    "priority": 0,
    "request_priority": 50,
    "deadline_us": None,
    "slack_us": None,
    "recompute_cost_us": None,
    "spill_cost_us": None,
    "reuse_window": None,
    "pin_requested": False,
    "pinned": False,
    "is_draft": False,
    "is_committed": False,
    "recompute_ok": False,
    "compression_ok": False,
    "prefetch_ok": False,
}


def test_an_ablated_block_carries_nothing_the_engine_said_about_its_future() -> None:
    from broker.model.apply import apply_batch
    from broker.model.core import Core
    from kvbroker.v1 import intent_pb2 as pb

    said = dict(
        block_id="b",
        request_id="r",
        phase=pb.PHASE_DECODE,
        priority=pb.PRIORITY_DECODE_CRITICAL,
        deadline_us=5_000,
        slack_us=300,
        recompute_cost_us=9_000,
        spill_cost_us=100,
        size_bytes=1 << 20,
        pin_requested=True,
        is_draft=True,
        is_committed=True,
        request_priority=95,
        expected_reuse_window_tokens=4,
        recompute_ok=True,
        compression_ok=True,
        prefetch_ok=True,
        parent_block_id="p",
        token_count=16,
    )
    config = parse_config(KVDS_TIERS_TOML).core
    for ablate in (False, True):
        core = Core(config, ablate_intent=ablate)
        batch = pb.IntentBatch(client_id="c", batch_seq=1)
        batch.events.add(ts_us=0, allocated=pb.BlockAllocated(intent=pb.MemoryIntent(**said), tier="dram"))  # type: ignore[arg-type]
        batch.events.add(ts_us=1, intent_updated=pb.IntentUpdated(block_id="b", slack_us=400, recompute_cost_us=8_000, pin_requested=True))
        assert not apply_batch(core, batch).rejections
        block = core.blocks["b"]
        fields = {name: getattr(block, name) for name in STRIPPED}
        if ablate:
            assert fields == STRIPPED
            # What reports measure against still follows the engine.
            assert (block.critical, block.due_us) == (True, 5_000)
            assert core.hidden["b"] == (400, 8_000)
        else:
            assert all(fields[name] != value for name, value in STRIPPED.items())
        # Identity, size and chain are kept either way.
        assert (block.request_id, block.size, block.parent_id, block.token_count) == ("r", 1 << 20, "p", 16)


@pytest.mark.parametrize("policy", ["intent_aware", "deadline_aware"])
def test_the_seed_ports_change_under_the_ablation_on_the_seed_trace(policy: str) -> None:
    from tests.golden import KVDS_DEADLINE_PRESSURE

    batches = list(read_trace(str(KVDS_DEADLINE_PRESSURE), "kvds-events", TraceOptions()))
    config = parse_config(KVDS_TIERS_TOML).core

    def run(ablate: bool) -> dict:
        return replay(lambda: ((1, b) for b in batches), config, policy, ablate_intent=ablate).metrics

    full, bare = run(False), run(True)
    assert full["dc_accesses"] == bare["dc_accesses"] == 96
    # With the labels (HOT, a 700 us deadline, 5 ms recompute, reuse in 2 tokens) the ports
    # keep most of the hot tails in HBM; without them they cannot tell them apart.
    assert full["dc_misses"] < bare["dc_misses"]
