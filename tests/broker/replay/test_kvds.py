"""kv_deadline_scheduler importers: exact event sequences, validation, skip-bad, replays through the core."""

from __future__ import annotations

import copy
import json
import pathlib
from typing import Any

import pytest

from broker.config import parse_config
from broker.replay.replay import replay
from broker.replay.traces import FORMATS, SkipCounter, TraceError, TraceOptions, read_trace
from broker.replay.traces.kvds import KVDS_TIERS_TOML, KvdsOptions, KvdsStats, read_kvds_events, read_kvds_requests
from clients import kvsize
from kvbroker.v1 import intent_pb2 as pb
from policies import registry

DATA = pathlib.Path(__file__).parent / "data"
EVENTS = DATA / "kvds_events.jsonl"
REQUESTS = DATA / "kvds_requests.jsonl"
MIB = 1_048_576
A, B, C = "req-001:block:0", "req-001:block:1", "req-002:block:0"


def describe(event: pb.Event) -> tuple[Any, ...]:
    """A compact, comparable form of an event."""
    kind = event.WhichOneof("kind")
    if kind == "allocated":
        i = event.allocated.intent
        deadline = i.deadline_us if i.HasField("deadline_us") else None
        return (
            "alloc",
            event.ts_us,
            i.block_id,
            pb.Phase.Name(i.phase),
            pb.Priority.Name(i.priority),
            i.size_bytes,
            deadline,
            event.allocated.tier,
        )
    if kind == "accessed":
        nxt = event.accessed.next_use_us if event.accessed.HasField("next_use_us") else None
        return ("access", event.ts_us, list(event.accessed.block_ids), nxt)
    if kind == "intent_updated":
        u = event.intent_updated
        fields: dict[str, Any] = {}
        for desc, value in u.ListFields():
            if desc.name == "block_id":
                continue
            if desc.name == "phase":
                value = pb.Phase.Name(value)
            elif desc.name == "priority":
                value = pb.Priority.Name(value)
            fields[desc.name] = value
        return ("update", event.ts_us, u.block_id, fields)
    if kind == "freed":
        return ("free", event.ts_us, list(event.freed.block_ids))
    raise AssertionError(f"unexpected event kind {kind}")


def events_of(batches: Any) -> list[tuple[Any, ...]]:
    return [describe(e) for b in batches for e in b.events]


def write(tmp_path: pathlib.Path, lines: list[Any]) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return str(path)


def fixture_lines(path: pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def kvds_core() -> Any:
    return parse_config(KVDS_TIERS_TOML).core


# ---- events trace: mapping --------------------------------------------------------------------

EXPECTED_EVENTS = [
    ("alloc", 0, A, "PHASE_PREFILL", "PRIORITY_WARM", MIB, 5000, "hbm"),
    ("alloc", 0, B, "PHASE_PREFILL", "PRIORITY_WARM", MIB, 5000, "hbm"),
    ("alloc", 1000, C, "PHASE_PREFILL", "PRIORITY_COLD", MIB, None, "dram"),
    # Line 4: the snapshot's phase changed (PREFILL -> DECODE): sent before the access, whose
    # next use is the relative deadline made absolute (2000 + 5000).
    ("update", 2000, A, {"phase": "PHASE_DECODE"}),
    ("access", 2000, [A], 7000),
    # Line 5 (SPILLED) is the seed's own decision: skipped.
    (
        "update",
        3000,
        B,
        {"phase": "PHASE_DECODE", "priority": "PRIORITY_DECODE_CRITICAL", "deadline_us": 4000, "slack_us": 200, "pin_requested": True},
    ),
    ("access", 3000, [B], 4000),
    ("access", 4000, [C], None),  # MISS: a read like any other; no deadline in the snapshot
    # COMMITTED: the flag, and the deadline that moved with event time (4000 + 5000).
    ("update", 4000, A, {"deadline_us": 9000, "is_committed": True}),
    ("update", 5000, C, {"phase": "PHASE_IDLE", "priority": "PRIORITY_COLD"}),
    # Lines 11-12 (EVICTED, PREFETCHED) skipped.
    ("access", 6000, [B], 7000),
    ("free", 7000, [C]),
    ("free", 8000, [A]),
    ("free", 8000, [B]),
]


def test_events_trace_maps_to_the_exact_event_sequence() -> None:
    stats = KvdsStats()
    got = events_of(read_kvds_events(str(EVENTS), KvdsOptions(), SkipCounter(), stats))
    assert got == EXPECTED_EVENTS
    assert stats.lines == 16
    assert stats.seed_decisions == {"SPILLED": 1, "EVICTED": 1, "PREFETCHED": 1}
    assert (stats.implicit_allocations, stats.orphan_frees, stats.snapshot_updates) == (0, 0, 1)


def test_allocation_carries_the_whole_intent() -> None:
    batches = list(read_trace(str(EVENTS), "kvds-events", TraceOptions()))
    first = batches[0].events[0].allocated
    i = first.intent
    assert (first.tier, first.reuse) == ("hbm", False)
    assert (i.block_id, i.request_id, i.size_bytes, i.request_priority) == (A, "req-001", MIB, 90)
    assert (i.deadline_us, i.slack_us, i.recompute_cost_us, i.spill_cost_us, i.expected_reuse_window_tokens) == (5000, 2000, 4000, 300, 8)
    assert (i.recompute_ok, i.compression_ok, i.prefetch_ok, i.pin_requested, i.is_draft, i.is_committed) == (
        True,
        True,
        True,
        False,
        False,
        False,
    )
    assert list(i.allowed_tiers) == ["hbm", "dram"]
    cold = batches[0].events[2].allocated.intent
    assert list(cold.allowed_tiers) == ["hbm", "dram", "cxl", "nvme"]
    # Null in the seed is unset here (unknown), not zero.
    assert not cold.HasField("deadline_us") and not cold.HasField("slack_us")
    assert batches[0].client_id == "kvds" and batches[0].batch_seq == 1


def test_us_per_step_sets_event_time() -> None:
    got = events_of(read_trace(str(EVENTS), "kvds-events", TraceOptions(us_per_step=10)))
    assert [e[1] for e in got] == [0, 0, 10, 20, 20, 30, 30, 40, 40, 50, 60, 70, 80, 80]
    # Deadlines stay microseconds: step 2 x 10 us + 5000 us.
    assert got[4] == ("access", 20, [A], 5020)


def test_small_batches_keep_order_and_sequence() -> None:
    batches = list(read_trace(str(EVENTS), "kvds-events", TraceOptions(batch_events=4)))
    assert [b.batch_seq for b in batches] == [1, 2, 3, 4]
    assert events_of(batches) == EXPECTED_EVENTS


def base_line() -> dict[str, Any]:
    return copy.deepcopy(fixture_lines(EVENTS)[0])


def line(step: int, event_type: str, object_id: str = "x", **intent: Any) -> dict[str, Any]:
    obj = base_line()
    obj["step"], obj["event_type"] = step, event_type
    obj["intent"].update(object_id=object_id, **intent)
    return obj


def test_snapshot_changes_unknown_objects_and_clamps(tmp_path: pathlib.Path) -> None:
    path = write(
        tmp_path,
        [
            # An access to an object never allocated (a trace cut from a longer log): allocated
            # from its snapshot first, in the tier it says.
            line(3, "ACCESSED", "late", current_tier="DRAM", deadline_us=-500, slack_us=-20),
            # Snapshot changes ride on any event; a deadline gone null is cleared.
            line(
                4,
                "MARKED_COLD",
                "late",
                priority="COLD",
                deadline_us=None,
                slack_us=-20,
                request_priority=10,
                expected_reuse_window_tokens=None,
            ),
            line(4, "FREED", "never-seen"),
            line(5, "FREED", "late"),
            # Freed and allocated again: a new block.
            line(6, "ALLOCATED", "late"),
            line(7, "MARKED_DECODE_CRITICAL", "late", priority="DECODE_CRITICAL", pin_requested=True, deadline_us=None, slack_us=None),
        ],
    )
    stats = KvdsStats()
    got = events_of(read_kvds_events(path, KvdsOptions(), SkipCounter(), stats))
    assert got == [
        # Overdue (3000 - 500) stays a past time; negative slack (late) is 0 slack.
        ("alloc", 3000, "late", "PHASE_PREFILL", "PRIORITY_WARM", MIB, 2500, "dram"),
        ("access", 3000, ["late"], 2500),
        # The reuse window went null: the schema cannot unset it, so it is not sent.
        ("update", 4000, "late", {"priority": "PRIORITY_COLD", "clear_deadline": True, "request_priority": 10}),
        ("free", 5000, ["late"]),
        ("alloc", 6000, "late", "PHASE_PREFILL", "PRIORITY_WARM", MIB, 11000, "hbm"),
        ("update", 7000, "late", {"priority": "PRIORITY_DECODE_CRITICAL", "pin_requested": True, "clear_deadline": True}),
    ]
    assert (stats.implicit_allocations, stats.orphan_frees) == (1, 1)


# ---- events trace: validation -----------------------------------------------------------------

DELETE = object()


def mutated(path_in_obj: str, value: Any) -> dict[str, Any]:
    obj = base_line()
    keys = path_in_obj.split(".")
    target = obj
    for key in keys[:-1]:
        target = target[key]
    if value is DELETE:
        del target[keys[-1]]
    else:
        target[keys[-1]] = value
    return obj


BAD_EVENT_LINES: list[tuple[Any, str]] = [
    (mutated("step", -1), "step"),
    (mutated("step", "1"), "step"),
    (mutated("step", DELETE), "step"),
    (mutated("event_type", "RESIZED"), "event_type"),
    (mutated("event_type", DELETE), "event_type"),
    (mutated("intent", DELETE), "intent"),
    (mutated("intent", [1]), "intent"),
    (mutated("reason", 7), "reason"),
    (mutated("latency_us", -3), "latency_us"),
    (mutated("latency_us", 1.5), "latency_us"),
    (mutated("intent.object_id", ""), "intent.object_id"),
    (mutated("intent.object_id", DELETE), "intent.object_id"),
    (mutated("intent.request_id", ["req"]), "intent.request_id"),
    (mutated("intent.block_id", -1), "intent.block_id"),
    (mutated("intent.block_id", None), "intent.block_id"),
    (mutated("intent.object_type", "KV"), "intent.object_type"),
    (mutated("intent.phase", "decode"), "intent.phase"),
    (mutated("intent.priority", "URGENT"), "intent.priority"),
    (mutated("intent.priority", DELETE), "intent.priority"),
    (mutated("intent.allowed_tiers", []), "intent.allowed_tiers"),
    (mutated("intent.allowed_tiers", "HBM"), "intent.allowed_tiers"),
    (mutated("intent.allowed_tiers", ["HBM", "GPU"]), "intent.allowed_tiers[1]"),
    (mutated("intent.current_tier", "NVME"), "intent.current_tier"),
    (mutated("intent.current_tier", "SSD"), "intent.current_tier"),
    (mutated("intent.size_bytes", 0), "intent.size_bytes"),
    (mutated("intent.size_bytes", "1MB"), "intent.size_bytes"),
    (mutated("intent.request_priority", 101), "intent.request_priority"),
    (mutated("intent.request_priority", -1), "intent.request_priority"),
    (mutated("intent.recency_score", 1.5), "intent.recency_score"),
    (mutated("intent.recency_score", True), "intent.recency_score"),
    (mutated("intent.recency_score", DELETE), "intent.recency_score"),
    (mutated("intent.deadline_us", "soon"), "intent.deadline_us"),
    (mutated("intent.slack_us", 1.5), "intent.slack_us"),
    (mutated("intent.arrival_step", -1), "intent.arrival_step"),
    (mutated("intent.target_decode_step", "4"), "intent.target_decode_step"),
    (mutated("intent.expected_reuse_window_tokens", -8), "intent.expected_reuse_window_tokens"),
    (mutated("intent.expected_reuse_window_tokens", 2**32), "intent.expected_reuse_window_tokens"),
    (mutated("intent.recompute_cost_us", -1), "intent.recompute_cost_us"),
    (mutated("intent.spill_cost_us", False), "intent.spill_cost_us"),
    (mutated("intent.compression_ok", "yes"), "intent.compression_ok"),
    (mutated("intent.recompute_ok", 1), "intent.recompute_ok"),
    (mutated("intent.prefetch_ok", None), "intent.prefetch_ok"),
    (mutated("intent.pin_requested", DELETE), "intent.pin_requested"),
    (mutated("intent.is_draft", "false"), "intent.is_draft"),
    (mutated("intent.is_committed", 0), "intent.is_committed"),
    (mutated("intent.created_step", None), "intent.created_step"),
    (mutated("intent.last_access_step", -2), "intent.last_access_step"),
    ({**base_line(), "intent": {**base_line()["intent"], "priority": "DECODE_CRITICAL", "pin_requested": False}}, "intent.pin_requested"),
    ("[1, 2]", "line"),
    ("{not json", "line"),
]


@pytest.mark.parametrize(("bad", "field"), BAD_EVENT_LINES)
def test_a_bad_event_line_names_file_line_and_field(tmp_path: pathlib.Path, bad: Any, field: str) -> None:
    good = line(0, "ALLOCATED", "good-0")
    later = line(5, "ALLOCATED", "good-1")
    path = write(tmp_path, [good, bad, later])
    with pytest.raises(TraceError) as info:
        list(read_trace(path, "kvds-events", TraceOptions()))
    assert (info.value.path, info.value.line, info.value.field) == (path, 2, field)
    assert f"{path}:2: {field}:" in str(info.value)
    # With skip-bad the line is counted and the rest is read.
    skips = SkipCounter(skip_bad=True)
    got = events_of(read_trace(path, "kvds-events", TraceOptions(), skips))
    assert skips.skipped == 1 and len(skips.examples) == 1
    assert [e[2] for e in got] == ["good-0", "good-1"]


def test_sequence_errors_name_the_earlier_line(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, [line(5, "ALLOCATED", "a"), line(4, "ACCESSED", "a")])
    with pytest.raises(TraceError) as info:
        list(read_kvds_events(path))
    assert (info.value.line, info.value.field) == (2, "step")
    assert "goes back in time: 4 after step 5 at line 1" in str(info.value)
    path = write(tmp_path, [line(0, "ALLOCATED", "a"), line(1, "ACCESSED", "a"), line(2, "ALLOCATED", "a")])
    with pytest.raises(TraceError) as info:
        list(read_kvds_events(path))
    assert (info.value.line, info.value.field) == (3, "intent.object_id")
    assert "already allocated (line 1)" in str(info.value)


def test_skip_bad_counts_every_bad_line(tmp_path: pathlib.Path) -> None:
    lines: list[Any] = [json.dumps(x) for x in fixture_lines(EVENTS)]
    lines.insert(3, json.dumps(mutated("intent.priority", "URGENT")))
    lines.insert(7, "garbage")
    lines.append(json.dumps(line(0, "ACCESSED", A)))  # back in time
    path = write(tmp_path, lines)
    skips = SkipCounter(skip_bad=True)
    assert events_of(read_trace(path, "kvds-events", TraceOptions(), skips)) == EXPECTED_EVENTS
    assert skips.skipped == 3
    assert [e.split(": ")[1] for e in skips.examples] == ["intent.priority", "line", "step"]


# ---- events trace: replay ---------------------------------------------------------------------


def test_kvds_tiers_config() -> None:
    tiers = kvds_core().tiers
    assert [(t.name, t.capacity_bytes) for t in tiers] == [
        ("hbm", 128 * MIB),
        ("dram", 4096 * MIB),
        ("cxl", 8 * 2**30),
        ("nvme", 64 * 2**30),
    ]


def test_events_replay_is_accepted_and_counts_decode_critical_accesses() -> None:
    batches = list(read_trace(str(EVENTS), "kvds-events", TraceOptions()))
    result = replay(lambda: ((1, b) for b in batches), kvds_core(), "lru")
    m = result.metrics
    assert m["rejected_events"] == 0
    assert m["dc_accesses"] == 2  # lines 7 and 13 read the block marked DECODE_CRITICAL
    assert m["accesses"] == 4
    # The COLD block was allocated in DRAM; reading it brought it up to HBM.
    assert m["accesses_by_tier"]["dram"] == 1 and m["bytes_up"] == MIB


@pytest.mark.parametrize("policy", registry.names())
def test_every_policy_accepts_both_traces(policy: str) -> None:
    for path, fmt in ((EVENTS, "kvds-events"), (REQUESTS, "kvds-requests")):
        batches = list(read_trace(str(path), fmt, TraceOptions()))
        assert replay(lambda b=batches: ((1, x) for x in b), kvds_core(), policy).metrics["rejected_events"] == 0


def test_events_replay_under_pressure_has_no_rejections(tmp_path: pathlib.Path) -> None:
    # 300 one-MiB blocks through a 128 MiB HBM: demotions, and every event still applies.
    lines = [line(i, "ALLOCATED", f"blk-{i}") for i in range(300)]
    lines += [line(300 + i, "ACCESSED", f"blk-{i}", phase="DECODE") for i in range(0, 300, 7)]
    lines += [line(1000 + i, "FREED", f"blk-{i}") for i in range(300)]
    batches = list(read_kvds_events(write(tmp_path, lines)))
    m = replay(lambda: ((1, b) for b in batches), kvds_core(), "lru").metrics
    assert m["rejected_events"] == 0 and m["demotions"] > 0


# ---- request trace ----------------------------------------------------------------------------

L8 = 16 * 131_072  # llama-3-8b block of 16 tokens
Q7 = 16 * 57_344  # qwen2.5-7b

EXPECTED_REQUESTS = [
    # interactive-1: starts at 5 ms, 30 prompt tokens -> 2 blocks, HOT (priority 90), deadline 0 + 2500 ms.
    ("alloc", 5000, "interactive-1/b0", "PHASE_PREFILL", "PRIORITY_HOT", L8, 2_500_000, ""),
    ("alloc", 5000, "interactive-1/b1", "PHASE_PREFILL", "PRIORITY_HOT", L8, 2_500_000, ""),
    # batch-1: no start_ms (starts at arrival), default priority 50 -> WARM, qwen2.5-7b blocks.
    ("alloc", 10000, "batch-1/b0", "PHASE_PREFILL", "PRIORITY_WARM", Q7, None, ""),
    # interactive-1's 4 steps are spread over 5..45 ms: 15, 25, 35, 45.
    ("update", 15000, "interactive-1/b0", {"phase": "PHASE_DECODE"}),
    ("update", 15000, "interactive-1/b1", {"phase": "PHASE_DECODE"}),
    ("access", 15000, ["interactive-1/b0", "interactive-1/b1"], 25000),
    ("alloc", 20000, "empty-1/b0", "PHASE_PREFILL", "PRIORITY_WARM", L8, None, ""),
    ("alloc", 20000, "empty-1/b1", "PHASE_PREFILL", "PRIORITY_WARM", L8, None, ""),
    ("access", 25000, ["interactive-1/b0", "interactive-1/b1"], 35000),
    # batch-1 has no end_ms: one step per tpot (20 ms); its first token starts block 1.
    ("update", 30000, "batch-1/b0", {"phase": "PHASE_DECODE"}),
    ("alloc", 30000, "batch-1/b1", "PHASE_DECODE", "PRIORITY_WARM", Q7, None, ""),
    ("access", 30000, ["batch-1/b0", "batch-1/b1"], 50000),
    # empty-1 generated nothing: its blocks live until end_ms.
    ("free", 30000, ["empty-1/b0", "empty-1/b1"]),
    # Token 32 (30 prompt + step 2) starts interactive-1's third block.
    ("alloc", 35000, "interactive-1/b2", "PHASE_DECODE", "PRIORITY_HOT", L8, 2_500_000, ""),
    ("access", 35000, ["interactive-1/b0", "interactive-1/b1", "interactive-1/b2"], 45000),
    ("access", 45000, ["interactive-1/b0", "interactive-1/b1", "interactive-1/b2"], None),
    ("free", 45000, ["interactive-1/b0", "interactive-1/b1", "interactive-1/b2"]),
    ("access", 50000, ["batch-1/b0", "batch-1/b1"], None),
    ("free", 50000, ["batch-1/b0", "batch-1/b1"]),
]


def test_request_trace_maps_to_the_exact_event_sequence() -> None:
    assert events_of(read_trace(str(REQUESTS), "kvds-requests", TraceOptions())) == EXPECTED_REQUESTS


def test_request_blocks_are_chained_and_placed() -> None:
    events = [e for b in read_kvds_requests(str(REQUESTS)) for e in b.events if e.WhichOneof("kind") == "allocated"]
    by_id = {e.allocated.intent.block_id: e.allocated.intent for e in events}
    assert by_id["interactive-1/b0"].parent_block_id == ""
    assert by_id["interactive-1/b1"].parent_block_id == "interactive-1/b0"
    assert by_id["interactive-1/b2"].parent_block_id == "interactive-1/b1"
    assert (by_id["interactive-1/b2"].token_start, by_id["interactive-1/b2"].token_count) == (32, 16)
    assert by_id["interactive-1/b0"].request_priority == 90 and by_id["batch-1/b0"].request_priority == 50


def test_request_options_block_tokens_model_tpot_and_no_decode(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, [{"request_id": "r", "arrival_ms": 1, "prompt_tokens": 8, "generated_tokens": 3}])
    opts = TraceOptions(block_tokens=4, model="gemma-2-9b", tpot_us=1000)
    gemma_block = kvsize.bytes_per_block(kvsize.get_model("gemma-2-9b"), 4, context_tokens=11)
    assert events_of(read_trace(path, "kvds-requests", opts)) == [
        ("alloc", 1000, "r/b0", "PHASE_PREFILL", "PRIORITY_WARM", gemma_block, None, ""),
        ("alloc", 1000, "r/b1", "PHASE_PREFILL", "PRIORITY_WARM", gemma_block, None, ""),
        ("update", 2000, "r/b0", {"phase": "PHASE_DECODE"}),
        ("update", 2000, "r/b1", {"phase": "PHASE_DECODE"}),
        ("alloc", 2000, "r/b2", "PHASE_DECODE", "PRIORITY_WARM", gemma_block, None, ""),
        ("access", 2000, ["r/b0", "r/b1", "r/b2"], 3000),
        ("access", 3000, ["r/b0", "r/b1", "r/b2"], 4000),
        ("access", 4000, ["r/b0", "r/b1", "r/b2"], None),
        ("free", 4000, ["r/b0", "r/b1", "r/b2"]),
    ]
    # Without decode: the prompt's blocks from start to end (here: start, no end_ms).
    assert events_of(read_trace(path, "kvds-requests", TraceOptions(decode=False))) == [
        ("alloc", 1000, "r/b0", "PHASE_PREFILL", "PRIORITY_WARM", L8, None, ""),
        ("free", 1000, ["r/b0"]),
    ]
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        KvdsOptions(model="nope")
    with pytest.raises(ValueError, match="block_tokens must be > 0"):
        KvdsOptions(block_tokens=0)


def test_requests_are_simulated_in_start_order(tmp_path: pathlib.Path) -> None:
    path = write(
        tmp_path,
        [
            {"request_id": "late", "arrival_ms": 9, "prompt_tokens": 1, "generated_tokens": 0},
            {"request_id": "early", "arrival_ms": 2.5, "prompt_tokens": 1, "generated_tokens": 0},
        ],
    )
    assert [(e[0], e[1], e[2]) for e in events_of(read_kvds_requests(path))] == [
        ("alloc", 2500, "early/b0"),
        ("free", 2500, ["early/b0"]),
        ("alloc", 9000, "late/b0"),
        ("free", 9000, ["late/b0"]),
    ]


def test_at_equal_times_running_requests_go_before_new_ones(tmp_path: pathlib.Path) -> None:
    # As an engine's scheduler does: finished requests free their blocks before a new prefill
    # allocates, even when the new request comes first in the file.
    path = write(
        tmp_path,
        [
            {"request_id": "new", "arrival_ms": 5, "prompt_tokens": 1, "generated_tokens": 1, "end_ms": 6},
            {"request_id": "old", "arrival_ms": 0, "end_ms": 5, "prompt_tokens": 1, "generated_tokens": 0},
        ],
    )
    assert [(e[0], e[1], e[2]) for e in events_of(read_kvds_requests(path))] == [
        ("alloc", 0, "old/b0"),
        ("free", 5000, ["old/b0"]),
        ("alloc", 5000, "new/b0"),
        ("update", 6000, "new/b0"),
        ("access", 6000, ["new/b0"]),
        ("free", 6000, ["new/b0"]),
    ]


GOOD_REQUEST = {"request_id": "ok", "arrival_ms": 0, "prompt_tokens": 16, "generated_tokens": 1}

BAD_REQUEST_LINES: list[tuple[Any, str]] = [
    ({**GOOD_REQUEST, "request_id": ""}, "request_id"),
    ({k: v for k, v in GOOD_REQUEST.items() if k != "request_id"}, "request_id"),
    ({**GOOD_REQUEST, "request_id": "first"}, "request_id"),  # repeats line 1
    ({**GOOD_REQUEST, "arrival_ms": -1}, "arrival_ms"),
    ({k: v for k, v in GOOD_REQUEST.items() if k != "arrival_ms"}, "arrival_ms"),
    ({**GOOD_REQUEST, "arrival_ms": "0"}, "arrival_ms"),
    ({**GOOD_REQUEST, "prompt_tokens": "x"}, "prompt_tokens"),
    ({**GOOD_REQUEST, "prompt_tokens": -4}, "prompt_tokens"),
    ({k: v for k, v in GOOD_REQUEST.items() if k != "generated_tokens"}, "generated_tokens"),
    ({**GOOD_REQUEST, "generated_tokens": 2.5}, "generated_tokens"),
    ({**GOOD_REQUEST, "arrival_ms": 10, "start_ms": 5}, "start_ms"),
    ({**GOOD_REQUEST, "start_ms": 10, "end_ms": 5}, "end_ms"),
    ({**GOOD_REQUEST, "request_priority": 101}, "request_priority"),
    ({**GOOD_REQUEST, "request_priority": True}, "request_priority"),
    ({**GOOD_REQUEST, "deadline_ms": -5}, "deadline_ms"),
    ({**GOOD_REQUEST, "model_name": "gpt-5"}, "model_name"),
    ({**GOOD_REQUEST, "model_name": 8}, "model_name"),
    ({**GOOD_REQUEST, "status": 200}, "status"),
    ("[]", "line"),
]


@pytest.mark.parametrize(("bad", "field"), BAD_REQUEST_LINES)
def test_a_bad_request_line_names_file_line_and_field(tmp_path: pathlib.Path, bad: Any, field: str) -> None:
    path = write(tmp_path, [{**GOOD_REQUEST, "request_id": "first"}, bad, {**GOOD_REQUEST, "request_id": "last"}])
    with pytest.raises(TraceError) as info:
        list(read_trace(path, "kvds-requests", TraceOptions()))
    assert (info.value.path, info.value.line, info.value.field) == (path, 2, field)
    assert f"{path}:2: {field}:" in str(info.value)
    skips = SkipCounter(skip_bad=True)
    got = events_of(read_trace(path, "kvds-requests", TraceOptions(), skips))
    assert skips.skipped == 1
    assert sorted({e[2] for e in got if e[0] == "alloc"}) == ["first/b0", "first/b1", "last/b0", "last/b1"]


def test_an_unknown_model_error_lists_the_known_ones(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, [{**GOOD_REQUEST, "model_name": "gpt-5"}])
    with pytest.raises(TraceError, match=r"unknown model 'gpt-5'.*llama-3-8b"):
        list(read_kvds_requests(path))
    # Hugging Face ids of known shapes resolve.
    path = write(tmp_path, [{**GOOD_REQUEST, "model_name": "meta-llama/Meta-Llama-3-70B-Instruct"}])
    sizes = {e.allocated.intent.size_bytes for b in read_kvds_requests(path) for e in b.events if e.WhichOneof("kind") == "allocated"}
    assert sizes == {16 * 327_680}


def test_request_replay_is_accepted() -> None:
    batches = list(read_trace(str(REQUESTS), "kvds-requests", TraceOptions()))
    m = replay(lambda: ((1, b) for b in batches), kvds_core(), "lru").metrics
    assert m["rejected_events"] == 0
    # Block reads: interactive-1 2+2+3+3, batch-1 2+2.
    assert m["accesses"] == 14


def test_request_replay_under_pressure_has_no_rejections(tmp_path: pathlib.Path) -> None:
    # 16 overlapping 1k-token llama-3-8b requests (128 MiB of KV each) against 128 MiB of HBM.
    lines = [
        {
            "request_id": f"r{i}",
            "arrival_ms": i * 3,
            "prompt_tokens": 1024,
            "generated_tokens": 20,
            "request_priority": 90 if i % 4 == 0 else 50,
        }
        for i in range(16)
    ]
    batches = list(read_trace(write(tmp_path, lines), "kvds-requests", TraceOptions(tpot_us=5000)))
    m = replay(lambda: ((1, b) for b in batches), kvds_core(), "lru").metrics
    assert m["rejected_events"] == 0
    # Step k reads the 64 prompt blocks and the decode blocks started so far (one per 16 tokens).
    assert m["demotions"] > 0 and m["accesses"] == 16 * sum(64 + 1 + k // 16 for k in range(20))


def test_formats_are_registered() -> None:
    assert {"kvds-events", "kvds-requests"} <= set(FORMATS)
    with pytest.raises(TraceError, match="kvds-events, kvds-requests"):
        read_trace("x", "csv", TraceOptions())
