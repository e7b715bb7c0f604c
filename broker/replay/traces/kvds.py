"""kv_deadline_scheduler traces: its MemoryIntentEvent log and its request trace.

**Event trace** (``kvds-events``): one MemoryIntentEvent a line, each with a full snapshot of
the object's intent. Event time is ``step × us_per_step``. What each event type becomes:

- ALLOCATED: ``allocated`` (block_id = object_id, tier = current_tier lower-cased).
- ACCESSED, MISS: ``accessed``. Both are reads by the engine; MISS is only the seed
  simulator's note that its read missed, and here the broker's residency decides that.
  The snapshot's deadline becomes the access's ``next_use_us``.
- COMMITTED: ``intent_updated(is_committed)``; MARKED_DECODE_CRITICAL:
  ``intent_updated(priority DECODE_CRITICAL, pin, deadline, slack)``; MARKED_COLD:
  ``intent_updated(priority COLD)``.
- FREED: ``freed``.
- SPILLED, PREFETCHED, EVICTED: skipped and counted (``KvdsStats.seed_decisions``). They are
  the seed simulator's own tier decisions, which the replayed policy makes for itself.

The snapshot is the truth: before an event's own mapping, any change of an updatable intent
field (phase, priority, deadline, slack, pin, committed, draft, recompute cost, reuse window,
request priority) since the last snapshot the broker was told is sent as ``intent_updated``.
The seed's ``deadline_us`` is relative to its event; ours is absolute (``ts_us + deadline_us``;
a deadline already past is kept as a past time, clamped at 0). Our schema has no negative
slack: a negative ``slack_us`` (already late) becomes 0. ``step`` must never decrease.

An event for an object that was never allocated (a trace cut from a longer log) allocates
it from its snapshot first (``KvdsStats.implicit_allocations``); a FREED of an unknown object
is dropped (``KvdsStats.orphan_frees``). A second ALLOCATED of a live object is an error.

Nullable fields (``reason``, ``latency_us`` and the int-or-null intent fields) may be absent;
every other listed field is required. The seed's tier names map to the tiers of
``KVDS_TIERS_TOML``; replay these traces on that config (or one with the same tier names).

**Request trace** (``kvds-requests``): requests are simulated in event time like the Mooncake
importer's decode mode; see ``request_events``.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from broker.replay.traces.base import SkipCounter, TraceError, batched, read_jsonl, require_int
from clients import kvsize
from kvbroker.v1 import intent_pb2 as pb

if TYPE_CHECKING:  # broker.replay.traces imports this module to register the formats
    from broker.replay.traces.options import TraceOptions

# The tiers the seed's names map to, sized like its published setup (HBM 128 MB, DRAM
# 4096 MB; CXL and NVMe below them). Latencies and bandwidths are those of kvbroker's default
# tiers, with CXL between DRAM and NVMe (a Type-3 expander behind a PCIe Gen5 x8 link).
KVDS_TIERS_TOML = """\
# kv_deadline_scheduler's tiers, for replays of kvds-events / kvds-requests traces.
[[tiers]]
name = "hbm"
capacity = "128MiB"
read_latency_us = 0.0
bandwidth_gb_per_s = 2000.0

[[tiers]]
name = "dram"
capacity = "4096MiB"
read_latency_us = 2.0
bandwidth_gb_per_s = 25.0

[[tiers]]
name = "cxl"
capacity = "8GiB"
read_latency_us = 5.0
bandwidth_gb_per_s = 16.0

[[tiers]]
name = "nvme"
capacity = "64GiB"
read_latency_us = 80.0
bandwidth_gb_per_s = 6.0
"""

TIERS = {"HBM": "hbm", "DRAM": "dram", "CXL": "cxl", "NVME": "nvme"}
PHASES = {
    "PREFILL": pb.PHASE_PREFILL,
    "DECODE": pb.PHASE_DECODE,
    "VERIFY": pb.PHASE_VERIFY,
    "ROLLBACK": pb.PHASE_ROLLBACK,
    "DONE": pb.PHASE_DONE,
    "IDLE": pb.PHASE_IDLE,
}
PRIORITIES = {"COLD": pb.PRIORITY_COLD, "WARM": pb.PRIORITY_WARM, "HOT": pb.PRIORITY_HOT, "DECODE_CRITICAL": pb.PRIORITY_DECODE_CRITICAL}
OBJECT_TYPES = ("KV_CACHE", "WEIGHT", "ACTIVATION", "SCRATCH")
EVENT_TYPES = (
    "ALLOCATED",
    "ACCESSED",
    "COMMITTED",
    "MARKED_DECODE_CRITICAL",
    "MARKED_COLD",
    "SPILLED",
    "PREFETCHED",
    "MISS",
    "EVICTED",
    "FREED",
)
# The seed simulator's own decisions: not engine input, so not replayed.
SEED_DECISIONS = frozenset({"SPILLED", "PREFETCHED", "EVICTED"})

_I64 = 2**63 - 1
_U32 = 2**32 - 1
_U64 = 2**64 - 1
_MAX_TOKENS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class KvdsOptions:
    # kvds-events: event time of one seed step.
    us_per_step: int = 1000
    # kvds-requests: tokens per KV block, the model of requests that name none, decode pace
    # when a request has no end_ms, and whether to simulate decode steps at all.
    block_tokens: int = 16
    model: str = "llama-3-8b"
    tpot_us: int = 20_000
    decode: bool = True
    batch_events: int = 512
    client_id: str = "kvds"

    def __post_init__(self) -> None:
        for name in ("us_per_step", "block_tokens", "tpot_us", "batch_events"):
            if getattr(self, name) <= 0:
                raise ValueError(f"kvds option {name} must be > 0, got {getattr(self, name)}")
        kvsize.get_model(self.model)  # an unknown default model fails here, not on the first request


@dataclasses.dataclass
class KvdsStats:
    """What an events import did besides mapping events one to one."""

    lines: int = 0
    # SPILLED / PREFETCHED / EVICTED lines skipped, by type.
    seed_decisions: dict[str, int] = dataclasses.field(default_factory=dict)
    implicit_allocations: int = 0
    orphan_frees: int = 0
    # intent_updated events sent only because a snapshot differed from the last one.
    snapshot_updates: int = 0


# ---- field validation ---------------------------------------------------------------------


def _missing(obj: dict[str, Any], key: str) -> bool:
    return key not in obj or obj[key] is None


def _int(
    obj: dict[str, Any],
    key: str,
    path: str,
    line: int,
    where: str = "",
    *,
    nullable: bool = False,
    minimum: int | None = 0,
    maximum: int = _I64,
) -> int | None:
    """An integer (a float with no fraction is accepted) in [minimum, maximum], or None if nullable."""
    field = where + key
    if _missing(obj, key):
        if nullable:
            return None
        raise TraceError(path, line, field, "required" if key not in obj else "required, got null")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not value.is_integer()):
        raise TraceError(path, line, field, f"expected an integer, got {value!r}")
    number = int(value)
    if minimum is not None and number < minimum:
        raise TraceError(path, line, field, f"must be >= {minimum}, got {number}")
    if number > maximum:
        raise TraceError(path, line, field, f"must be <= {maximum}, got {number}")
    if number < -_I64:
        raise TraceError(path, line, field, f"out of range: {number}")
    return number


def _bool(obj: dict[str, Any], key: str, path: str, line: int, where: str) -> bool:
    value = obj.get(key)
    if not isinstance(value, bool):
        raise TraceError(path, line, where + key, "required" if key not in obj else f"expected true or false, got {value!r}")
    return value


def _enum(obj: dict[str, Any], key: str, path: str, line: int, where: str, choices: Any) -> str:
    value = obj.get(key)
    if key not in obj:
        raise TraceError(path, line, where + key, "required")
    if not isinstance(value, str) or value not in choices:
        raise TraceError(path, line, where + key, f"expected one of {', '.join(choices)}, got {value!r}")
    return value


def _ms_to_us(obj: dict[str, Any], key: str, path: str, line: int, *, optional: bool = False) -> int | None:
    """Milliseconds >= 0 (fractions allowed: real traces log sub-millisecond times) as microseconds."""
    if _missing(obj, key):
        if optional:
            return None
        raise TraceError(path, line, key, "required")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TraceError(path, line, key, f"expected a number of milliseconds, got {value!r}")
    if value < 0:
        raise TraceError(path, line, key, f"must be >= 0, got {value}")
    us = round(value * 1000)
    if us > _I64 // 2:
        raise TraceError(path, line, key, f"too large: {value}")
    return us


# ---- events trace -------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Snapshot:
    """One validated intent snapshot, in the seed's units (deadline relative to its event)."""

    object_id: str
    request_id: str
    block_index: int
    object_type: str
    phase: int
    priority: int
    allowed_tiers: list[str]
    current_tier: str
    size_bytes: int
    request_priority: int
    recency_score: float
    deadline_us: int | None
    slack_us: int | None
    arrival_step: int | None
    target_decode_step: int | None
    expected_reuse_window_tokens: int | None
    recompute_cost_us: int | None
    spill_cost_us: int | None
    compression_ok: bool
    recompute_ok: bool
    prefetch_ok: bool
    pin_requested: bool
    is_draft: bool
    is_committed: bool
    created_step: int
    last_access_step: int


@dataclasses.dataclass(slots=True)
class EventLine:
    line: int
    step: int
    event_type: str
    intent: Snapshot
    reason: str | None
    latency_us: int | None


def parse_snapshot(raw: Any, path: str, line: int) -> Snapshot:
    """Validate an ``intent`` object; every error names ``intent.<field>``."""
    w = "intent."
    if not isinstance(raw, dict):
        raise TraceError(path, line, "intent", "required, an object" if raw is None else f"expected an object, got {raw!r}")
    object_id = raw.get("object_id")
    if not isinstance(object_id, str) or not object_id:
        raise TraceError(path, line, w + "object_id", f"required, a non-empty string, got {object_id!r}")
    request_id = raw.get("request_id")
    if request_id is None:
        request_id = ""  # objects that belong to no request (weights, scratch)
    elif isinstance(request_id, int) and not isinstance(request_id, bool):
        request_id = str(request_id)
    elif not isinstance(request_id, str):
        raise TraceError(path, line, w + "request_id", f"expected a string, got {request_id!r}")
    tiers = raw.get("allowed_tiers")
    if not isinstance(tiers, list) or not tiers:
        raise TraceError(path, line, w + "allowed_tiers", f"expected a non-empty list of {', '.join(TIERS)}, got {tiers!r}")
    for i, tier in enumerate(tiers):
        if not isinstance(tier, str) or tier not in TIERS:
            raise TraceError(path, line, f"{w}allowed_tiers[{i}]", f"expected one of {', '.join(TIERS)}, got {tier!r}")
    current = _enum(raw, "current_tier", path, line, w, TIERS)
    if current not in tiers:
        raise TraceError(path, line, w + "current_tier", f"{current} is not in allowed_tiers {tiers}")
    phase = PHASES[_enum(raw, "phase", path, line, w, PHASES)]
    priority = PRIORITIES[_enum(raw, "priority", path, line, w, PRIORITIES)]
    recency = raw.get("recency_score")
    if isinstance(recency, bool) or not isinstance(recency, (int, float)) or not 0 <= recency <= 1:
        reason = "required" if "recency_score" not in raw else f"expected a number in 0..1, got {recency!r}"
        raise TraceError(path, line, w + "recency_score", reason)
    pin = _bool(raw, "pin_requested", path, line, w)
    if priority == pb.PRIORITY_DECODE_CRITICAL and not pin:
        raise TraceError(path, line, w + "pin_requested", "DECODE_CRITICAL forces pin_requested = true, got false")

    def nullable(key: str, maximum: int = _I64, minimum: int | None = 0) -> int | None:
        return _int(raw, key, path, line, w, nullable=True, minimum=minimum, maximum=maximum)

    def required(key: str, maximum: int = _I64) -> int:
        value = _int(raw, key, path, line, w, maximum=maximum)
        assert value is not None
        return value

    return Snapshot(
        object_id=object_id,
        request_id=request_id,
        block_index=required("block_id"),
        object_type=_enum(raw, "object_type", path, line, w, OBJECT_TYPES),
        phase=phase,
        priority=priority,
        allowed_tiers=[TIERS[t] for t in tiers],
        current_tier=TIERS[current],
        size_bytes=_positive_size(raw, path, line),
        request_priority=required("request_priority", maximum=100),
        recency_score=float(recency),
        # Relative to the event; may be negative (already overdue), see the module docstring.
        deadline_us=nullable("deadline_us", minimum=None),
        slack_us=nullable("slack_us", minimum=None),
        arrival_step=nullable("arrival_step"),
        target_decode_step=nullable("target_decode_step"),
        expected_reuse_window_tokens=nullable("expected_reuse_window_tokens", maximum=_U32),
        recompute_cost_us=nullable("recompute_cost_us"),
        spill_cost_us=nullable("spill_cost_us"),
        compression_ok=_bool(raw, "compression_ok", path, line, w),
        recompute_ok=_bool(raw, "recompute_ok", path, line, w),
        prefetch_ok=_bool(raw, "prefetch_ok", path, line, w),
        pin_requested=pin,
        is_draft=_bool(raw, "is_draft", path, line, w),
        is_committed=_bool(raw, "is_committed", path, line, w),
        created_step=required("created_step"),
        last_access_step=required("last_access_step"),
    )


def _positive_size(raw: dict[str, Any], path: str, line: int) -> int:
    size = _int(raw, "size_bytes", path, line, "intent.", minimum=1, maximum=_U64)
    assert size is not None
    return size


def parse_event_line(obj: dict[str, Any], path: str, line: int) -> EventLine:
    """Validate one MemoryIntentEvent line (every field the format lists)."""
    step = _int(obj, "step", path, line)
    assert step is not None
    event_type = _enum(obj, "event_type", path, line, "", EVENT_TYPES)
    if "intent" not in obj:
        raise TraceError(path, line, "intent", "required")
    intent = parse_snapshot(obj["intent"], path, line)
    reason = obj.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise TraceError(path, line, "reason", f"expected a string or null, got {reason!r}")
    latency = _int(obj, "latency_us", path, line, nullable=True)
    return EventLine(line, step, event_type, intent, reason, latency)


# Intent fields an IntentUpdated can carry, compared between snapshots.
_UPDATABLE = (
    "phase",
    "priority",
    "deadline_us",
    "slack_us",
    "pin_requested",
    "is_committed",
    "is_draft",
    "recompute_cost_us",
    "expected_reuse_window_tokens",
    "request_priority",
)


def _view(snap: Snapshot, ts_us: int) -> dict[str, Any]:
    """The snapshot's updatable fields in the broker's units (absolute deadline, slack >= 0)."""
    return {
        "phase": snap.phase,
        "priority": snap.priority,
        "deadline_us": None if snap.deadline_us is None else max(0, ts_us + snap.deadline_us),
        "slack_us": None if snap.slack_us is None else max(0, snap.slack_us),
        "pin_requested": snap.pin_requested,
        "is_committed": snap.is_committed,
        "is_draft": snap.is_draft,
        "recompute_cost_us": snap.recompute_cost_us,
        "expected_reuse_window_tokens": snap.expected_reuse_window_tokens,
        "request_priority": snap.request_priority,
    }


def _changes(told: dict[str, Any], view: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in _UPDATABLE:
        new = view[key]
        if new == told[key]:
            continue
        if new is None and key != "deadline_us":
            continue  # the schema can clear only a deadline; the broker keeps the last value
        out[key] = new
    return out


def _update_event(ts_us: int, block_id: str, changes: dict[str, Any]) -> pb.Event:
    upd = pb.IntentUpdated(block_id=block_id)
    for key, value in changes.items():
        if key == "deadline_us" and value is None:
            upd.clear_deadline = True
        else:
            setattr(upd, key, value)
    return pb.Event(ts_us=ts_us, intent_updated=upd)


def _allocate_event(ts_us: int, snap: Snapshot, view: dict[str, Any]) -> pb.Event:
    intent = pb.MemoryIntent(
        block_id=snap.object_id,
        request_id=snap.request_id,
        phase=snap.phase,  # type: ignore[arg-type]
        priority=snap.priority,  # type: ignore[arg-type]
        size_bytes=snap.size_bytes,
        pin_requested=snap.pin_requested,
        is_draft=snap.is_draft,
        is_committed=snap.is_committed,
        request_priority=snap.request_priority,
        recompute_ok=snap.recompute_ok,
        compression_ok=snap.compression_ok,
        prefetch_ok=snap.prefetch_ok,
        allowed_tiers=snap.allowed_tiers,
    )
    # Optional fields are set only when the seed knew them (unset means unknown, not 0).
    for key in ("deadline_us", "slack_us", "recompute_cost_us", "expected_reuse_window_tokens"):
        if view[key] is not None:
            setattr(intent, key, view[key])
    if snap.spill_cost_us is not None:
        intent.spill_cost_us = snap.spill_cost_us
    return pb.Event(ts_us=ts_us, allocated=pb.BlockAllocated(intent=intent, tier=snap.current_tier))


def _map_event(ev: EventLine, ts_us: int, live: dict[str, dict[str, Any]], stats: KvdsStats) -> Iterator[pb.Event]:
    snap = ev.intent
    oid = snap.object_id
    kind = ev.event_type
    if kind in SEED_DECISIONS:
        stats.seed_decisions[kind] = stats.seed_decisions.get(kind, 0) + 1
        return
    view = _view(snap, ts_us)
    told = live.get(oid)
    if kind == "FREED":
        if told is None:
            stats.orphan_frees += 1
            return
        del live[oid]
        yield pb.Event(ts_us=ts_us, freed=pb.BlocksFreed(block_ids=[oid]))
        return
    if told is None:
        if kind != "ALLOCATED":
            stats.implicit_allocations += 1
        live[oid] = dict(view)
        yield _allocate_event(ts_us, snap, view)
        if kind == "ALLOCATED":
            return
        told = live[oid]
    changes = _changes(told, view)
    forced: dict[str, Any] = {}
    next_use: int | None = None
    if kind in ("ACCESSED", "MISS"):
        # The access itself carries the new deadline (next_use_us), as an engine's step would.
        next_use = view["deadline_us"]
        if next_use is not None:
            changes.pop("deadline_us", None)
            told["deadline_us"] = next_use
    elif kind == "COMMITTED":
        forced = {"is_committed": True}
    elif kind == "MARKED_DECODE_CRITICAL":
        forced = {"priority": pb.PRIORITY_DECODE_CRITICAL, "pin_requested": True, "deadline_us": view["deadline_us"]}
        if view["slack_us"] is not None:
            forced["slack_us"] = view["slack_us"]
    elif kind == "MARKED_COLD":
        forced = {"priority": pb.PRIORITY_COLD}
    if changes or forced:
        if not forced:
            stats.snapshot_updates += 1
        changes.update(forced)
        told.update(changes)
        yield _update_event(ts_us, oid, changes)
    if kind in ("ACCESSED", "MISS"):
        accessed = pb.BlocksAccessed(block_ids=[oid])
        if next_use is not None:
            accessed.next_use_us = next_use
        yield pb.Event(ts_us=ts_us, accessed=accessed)


def kvds_events(path: str, opts: KvdsOptions, skips: SkipCounter, stats: KvdsStats) -> Iterator[pb.Event]:
    """Events of a MemoryIntentEvent trace, read and mapped one line at a time."""
    live: dict[str, dict[str, Any]] = {}
    allocated_at: dict[str, int] = {}
    last_step, last_line = 0, 0
    for line, obj in read_jsonl(path, skips):
        try:
            ev = parse_event_line(obj, path, line)
            if ev.step < last_step:
                raise TraceError(path, line, "step", f"goes back in time: {ev.step} after step {last_step} at line {last_line}")
            ts_us = ev.step * opts.us_per_step
            if ts_us > _I64 // 2:
                raise TraceError(path, line, "step", f"too large for us_per_step {opts.us_per_step}: {ev.step}")
            oid = ev.intent.object_id
            if ev.event_type == "ALLOCATED" and oid in live:
                raise TraceError(path, line, "intent.object_id", f"{oid!r} is already allocated (line {allocated_at[oid]}) and not freed")
        except TraceError as exc:
            skips.bad(exc)
            continue
        last_step, last_line = ev.step, line
        stats.lines += 1
        if ev.event_type not in SEED_DECISIONS and oid not in live and ev.event_type != "FREED":
            allocated_at[oid] = line
        yield from _map_event(ev, ts_us, live, stats)
        if oid not in live:
            allocated_at.pop(oid, None)


def read_kvds_events(
    path: str, opts: KvdsOptions | None = None, skips: SkipCounter | None = None, stats: KvdsStats | None = None
) -> Iterator[pb.IntentBatch]:
    """IntentBatches of a kv_deadline_scheduler MemoryIntentEvent trace (streamed)."""
    opts = opts or KvdsOptions()
    events = kvds_events(path, opts, skips or SkipCounter(), stats if stats is not None else KvdsStats())
    yield from batched(events, opts.client_id, opts.batch_events)


# ---- request trace ------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class KvdsRequest:
    line: int
    request_id: str
    arrival_us: int
    start_us: int
    end_us: int | None
    prompt_tokens: int
    generated_tokens: int
    request_priority: int
    # Absolute (arrival + deadline_ms), None when the request has none.
    deadline_us: int | None
    block_bytes: int


def parse_request(obj: dict[str, Any], path: str, line: int, opts: KvdsOptions, shapes: dict[str, kvsize.ModelShape]) -> KvdsRequest:
    """Validate one request line; sizes its blocks from its model."""
    request_id = obj.get("request_id")
    if isinstance(request_id, int) and not isinstance(request_id, bool):
        request_id = str(request_id)
    if not isinstance(request_id, str) or not request_id:
        raise TraceError(path, line, "request_id", f"required, a non-empty string, got {request_id!r}")
    arrival = _ms_to_us(obj, "arrival_ms", path, line)
    # Bounded so that block indexes, token offsets and decode step times stay in range.
    prompt = require_int(obj, "prompt_tokens", path, line, maximum=_MAX_TOKENS)
    generated = require_int(obj, "generated_tokens", path, line, maximum=_MAX_TOKENS)
    start = _ms_to_us(obj, "start_ms", path, line, optional=True)
    end = _ms_to_us(obj, "end_ms", path, line, optional=True)
    priority = require_int(obj, "request_priority", path, line, optional=True)
    deadline = _ms_to_us(obj, "deadline_ms", path, line, optional=True)
    assert arrival is not None and prompt is not None and generated is not None
    if start is None:
        start = arrival
    elif start < arrival:
        raise TraceError(path, line, "start_ms", f"{obj['start_ms']} is before arrival_ms {obj['arrival_ms']}")
    if end is not None and end < start:
        raise TraceError(path, line, "end_ms", f"{obj['end_ms']} is before the start ({start / 1000:g} ms)")
    if priority is None:
        priority = 50
    elif priority > 100:
        raise TraceError(path, line, "request_priority", f"must be in 0..100, got {priority}")
    model = obj.get("model_name")
    if model is None:
        model = opts.model
    elif not isinstance(model, str):
        raise TraceError(path, line, "model_name", f"expected a string, got {model!r}")
    status = obj.get("status")
    if status is not None and not isinstance(status, str):
        raise TraceError(path, line, "status", f"expected a string, got {status!r}")
    shape = shapes.get(model)
    if shape is None:
        try:
            shape = shapes[model] = kvsize.get_model(model)
        except kvsize.UnknownModelError as exc:
            raise TraceError(path, line, "model_name", str(exc)) from None
    # Sliding-window layers are averaged over the request's final context (kvsize docstring).
    block_bytes = kvsize.bytes_per_block(shape, opts.block_tokens, context_tokens=prompt + generated)
    return KvdsRequest(
        line=line,
        request_id=request_id,
        arrival_us=arrival,
        start_us=start,
        end_us=end,
        prompt_tokens=prompt,
        generated_tokens=generated,
        request_priority=priority,
        deadline_us=None if deadline is None else arrival + deadline,
        block_bytes=block_bytes,
    )


def read_requests(path: str, opts: KvdsOptions, skips: SkipCounter) -> list[KvdsRequest]:
    """Every valid request, in start order (file order breaks ties)."""
    requests: list[KvdsRequest] = []
    seen: dict[str, int] = {}
    shapes: dict[str, kvsize.ModelShape] = {}
    for line, obj in read_jsonl(path, skips):
        try:
            req = parse_request(obj, path, line, opts, shapes)
            if req.request_id in seen:
                # Block ids derive from the request id: a repeat would collide with the first.
                raise TraceError(path, line, "request_id", f"{req.request_id!r} repeats line {seen[req.request_id]}")
        except TraceError as exc:
            skips.bad(exc)
            continue
        seen[req.request_id] = line
        requests.append(req)
    requests.sort(key=lambda r: r.start_us)
    return requests


def _step_time(req: KvdsRequest, k: int, tpot_us: int) -> int:
    """Time of decode step k (0-based): steps spread evenly after the prefill, the last at end."""
    g = req.generated_tokens
    span = req.end_us - req.start_us if req.end_us is not None else g * tpot_us
    return req.start_us + (k + 1) * span // g


def _block_intent(req: KvdsRequest, index: int, opts: KvdsOptions, parent: str, phase: int) -> pb.MemoryIntent:
    intent = pb.MemoryIntent(
        block_id=f"{req.request_id}/b{index}",
        request_id=req.request_id,
        phase=phase,  # type: ignore[arg-type]
        priority=pb.PRIORITY_HOT if req.request_priority >= 80 else pb.PRIORITY_WARM,
        size_bytes=req.block_bytes,
        request_priority=req.request_priority,
        token_start=index * opts.block_tokens,
        token_count=opts.block_tokens,
        parent_block_id=parent,
    )
    if req.deadline_us is not None:
        intent.deadline_us = req.deadline_us
    return intent


_PREFILL, _STEP = 1, 0  # at equal times, running requests step (and free) before new ones allocate


def request_events(requests: list[KvdsRequest], opts: KvdsOptions) -> Iterator[pb.Event]:
    """Overlapping requests in event time.

    - At ``start_ms`` (default ``arrival_ms``) the prefill allocates ceil(prompt/block_tokens)
      blocks ``{request_id}/b{i}`` (phase PREFILL, parent-chained, HOT when request_priority
      >= 80 else WARM, deadline = arrival + deadline_ms when given).
    - One decode step per generated token, spread evenly after the prefill so that the last
      lands on ``end_ms`` (without end_ms: one every ``tpot_us``). The first step moves the
      prompt blocks to phase DECODE. A step whose token starts a new block allocates it
      (the prompt's partly filled last block is filled first), then reads all the request's
      blocks, naming the next step's time as their next use.
    - After the last step (or at ``end_ms`` when nothing is generated, or with ``decode``
      off) all the request's blocks are freed.
    """
    bt = opts.block_tokens
    # (time, rank, order, request index, step); step -1 is the prefill, generated_tokens the end.
    heap: list[tuple[int, int, int, int, int]] = []
    for i, req in enumerate(requests):
        heapq.heappush(heap, (req.start_us, _PREFILL, i, i, -1))
    order = len(requests)
    blocks: dict[int, list[str]] = {}
    while heap:
        now, _, _, i, step = heapq.heappop(heap)
        req = requests[i]
        g = req.generated_tokens if opts.decode else 0
        if step == -1:
            ids: list[str] = []
            for b in range(kvsize.blocks_for(req.prompt_tokens, bt)):
                intent = _block_intent(req, b, opts, ids[-1] if ids else "", pb.PHASE_PREFILL)
                yield pb.Event(ts_us=now, allocated=pb.BlockAllocated(intent=intent))
                ids.append(intent.block_id)
            blocks[i] = ids
            order += 1
            if g:
                heapq.heappush(heap, (_step_time(req, 0, opts.tpot_us), _STEP, order, i, 0))
            else:
                heapq.heappush(heap, (req.end_us if req.end_us is not None else now, _STEP, order, i, g))
            continue
        ids = blocks[i]
        if step >= g:  # nothing generated: the request ends
            del blocks[i]
            if ids:
                yield pb.Event(ts_us=now, freed=pb.BlocksFreed(block_ids=ids))
            continue
        if step == 0:
            for block_id in ids:
                yield pb.Event(ts_us=now, intent_updated=pb.IntentUpdated(block_id=block_id, phase=pb.PHASE_DECODE))
        if (req.prompt_tokens + step) // bt >= len(ids):
            intent = _block_intent(req, len(ids), opts, ids[-1] if ids else "", pb.PHASE_DECODE)
            yield pb.Event(ts_us=now, allocated=pb.BlockAllocated(intent=intent))
            ids.append(intent.block_id)
        last = step + 1 >= g
        accessed = pb.BlocksAccessed(block_ids=ids)
        if not last:
            accessed.next_use_us = _step_time(req, step + 1, opts.tpot_us)
        yield pb.Event(ts_us=now, accessed=accessed)
        if last:
            del blocks[i]
            yield pb.Event(ts_us=now, freed=pb.BlocksFreed(block_ids=ids))
        else:
            order += 1
            heapq.heappush(heap, (_step_time(req, step + 1, opts.tpot_us), _STEP, order, i, step + 1))


def read_kvds_requests(path: str, opts: KvdsOptions | None = None, skips: SkipCounter | None = None) -> Iterator[pb.IntentBatch]:
    """IntentBatches of a kv_deadline_scheduler request trace (all requests are read first, to order them)."""
    opts = opts or KvdsOptions()
    requests = read_requests(path, opts, skips or SkipCounter())
    yield from batched(request_events(requests, opts), opts.client_id, opts.batch_events)


# ---- the FORMATS entries of broker.replay.traces ---------------------------------------------------


def kvds_options(opts: TraceOptions) -> KvdsOptions:
    """The kvds options carried by the importers' common TraceOptions.

    ``bytes_per_token`` does not apply: request blocks are sized from each request's model.
    """
    return KvdsOptions(
        us_per_step=opts.us_per_step,
        block_tokens=opts.block_tokens,
        model=opts.model,
        tpot_us=opts.tpot_us,
        decode=opts.decode,
        batch_events=opts.batch_events,
    )


def events_format(path: str, opts: TraceOptions, skips: SkipCounter) -> Iterator[pb.IntentBatch]:
    return read_kvds_events(path, kvds_options(opts), skips)


def requests_format(path: str, opts: TraceOptions, skips: SkipCounter) -> Iterator[pb.IntentBatch]:
    return read_kvds_requests(path, kvds_options(opts), skips)
