"""kv_deadline_scheduler compatibility replay: the seed simulator's importer rules and cost
model, driving kvbroker's own policy objects, so that the ports can be checked figure for
figure against the original (``kvbroker replay --kvds-compat``, bench/kvds_compare.py).

kvbroker's normal replay (``--format kvds-events``) reads a seed trace as an engine's intent
stream and lets the core decide everything. The seed's simulator (kvmi simulate) differs in
ways that change its figures; this mode does what it does instead:

- **Labels, not clocks.** ``deadline_us`` is a static label (time to need as the engine
  last wrote it; it does not count down); ``recency_score`` is the engine's label, set by
  the events below and decayed by 0.03 (floored at 0) once per distinct step, after that
  step's first event; ``last_access_step`` and ``target_decode_step`` are labels too. A
  ported policy reads them through ``SeedLabels`` (policies.scored) instead of deriving
  recency, age and deadlines from event time.
- **The seed's merge rules.** Each event type updates only the fields the seed takes from
  its snapshot: ACCESSED (last access, recency set to 1, phase, priority, deadline, slack,
  target step, reuse window, pin, prefetch_ok), MARKED_DECODE_CRITICAL (DECODE_CRITICAL and
  pinned, phase, deadline, slack, target step, reuse window, request priority, recency),
  MARKED_COLD (COLD, phase, deadline, slack, the three _ok flags, recency), COMMITTED
  (committed, not a draft), PREFETCHED (every field); ALLOCATED takes the whole snapshot.
  DECODE_CRITICAL always implies pinned. MISS lines change nothing.
- **The seed's own decisions replayed.** PREFETCHED: a live block outside HBM takes the
  snapshot and is moved up if the policy would prefetch it with nothing to displace
  (``admit_prefetch(block, [])``); SPILLED: moved to DRAM; EVICTED: leaves every tier.
- **The seed's cost model.** Two tiers, HBM and DRAM (the trace's lower tiers all count as
  DRAM, then as gone when DRAM is full). A block placed in HBM (allocated, read, prefetched)
  is placed first, then victims leave one at a time while HBM holds more than its capacity;
  every HBM block is a candidate, the one just placed included, scored at that step (a
  scored policy's ``key`` is taken for every candidate: O(blocks in HBM) a choice, as the
  seed's own scan).
  Which pinned blocks are offered: the seed's IntentAware and DeadlineAware take pinned
  blocks only when every block is pinned; its LRU, HotCold and PredictiveHotness ignore
  pins (``SEED_IGNORES_PINS``); every other policy gets the first rule. A victim goes to
  DRAM if it fits, else is gone. A read outside HBM is a miss at a flat 5,000 us; a
  decode-critical miss is one whose block is DECODE_CRITICAL or in DECODE after the read's
  merge. Per event: 50 us base, +5,000 a miss, +200 a spill, +100 a prefetch.

This is a reproduction mode for the seed's small traces (a policy scan per victim), not a
serving path: the live broker and kvbroker's replay never use it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from broker.replay.traces.base import SkipCounter, TraceError, read_jsonl
from broker.replay.traces.kvds import EventLine, Snapshot, parse_event_line
from policies.base import Block, Clock, Phase, Policy, PolicyContext, Priority, TierInfo
from policies.registry import make_params, policy_class
from policies.scored import ScoredPolicy

MIB = 1 << 20
DECAY_PER_STEP = 0.03
MISS_US = 5_000
SPILL_US = 200
PREFETCH_US = 100
BASE_US = 50
# The seed's policies that choose among pinned blocks as among any other.
SEED_IGNORES_PINS = frozenset({"lru", "hotcold", "predictive_hotness"})

# What each seed event takes from its snapshot (Snapshot attribute names).
_ACCESS_FIELDS = (
    "phase",
    "priority",
    "deadline_us",
    "slack_us",
    "target_decode_step",
    "expected_reuse_window_tokens",
    "pin_requested",
    "prefetch_ok",
)
_CRITICAL_FIELDS = (
    "phase",
    "pin_requested",
    "deadline_us",
    "slack_us",
    "target_decode_step",
    "expected_reuse_window_tokens",
    "request_priority",
    "recency_score",
)
_COLD_FIELDS = ("phase", "deadline_us", "slack_us", "compression_ok", "recompute_ok", "prefetch_ok", "recency_score")


@dataclasses.dataclass
class CompatResult:
    """One policy's figures, as the seed's simulator counts them."""

    policy: str
    hbm_bytes: int
    dc_misses: int = 0
    dc_accesses: int = 0
    accesses: int = 0
    misses: int = 0
    spills: int = 0
    evictions: int = 0
    prefetches: int = 0
    latency_us: int = 0

    @property
    def dc_miss_rate(self) -> float:
        return self.dc_misses / self.dc_accesses if self.dc_accesses else 0.0

    def as_record(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "dc_miss_rate": self.dc_miss_rate}


class _Seed:
    """A block's state as the seed keeps it: its merged snapshot and its recency label."""

    __slots__ = ("snap", "recency0", "decays_at", "block", "tier")

    def __init__(self, snap: Snapshot, block: Block, decays: int) -> None:
        self.snap = snap
        self.recency0 = snap.recency_score
        self.decays_at = decays
        self.block = block
        self.tier = ""  # "hbm", "dram" or "" (in no tier)


def _decayed(start: float, times: int, memo: dict[tuple[float, int], float]) -> float:
    """``start`` after ``times`` decays of 0.03 floored at 0, subtracted one at a time as
    the seed does (so that equal labels stay bit-for-bit equal)."""
    if start <= 0.0 or times <= 0:
        return max(start, 0.0) if times > 0 else start
    times = min(times, math.ceil(start / DECAY_PER_STEP) + 1)
    key = (start, times)
    value = memo.get(key)
    if value is None:
        value = start
        for _ in range(times):
            value = max(value - DECAY_PER_STEP, 0.0)
        memo[key] = value
    return value


class KvdsCompat:
    """The seed's simulator loop around one kvbroker policy (see the module docstring)."""

    def __init__(
        self, policy: str, hbm_bytes: int, dram_bytes: int = 4096 * MIB, *, us_per_step: int = 1000, params: dict[str, Any] | None = None
    ) -> None:
        self.us_per_step = us_per_step
        self.hbm_bytes = hbm_bytes
        self.dram_bytes = dram_bytes
        self.clock = Clock()
        hbm = TierInfo(0, "hbm", hbm_bytes, 0.0, 2000.0 * 1000)
        dram = TierInfo(1, "dram", dram_bytes, 2.0, 25.0 * 1000)
        cls = policy_class(policy)
        self.policy: Policy = cls(PolicyContext(hbm, (hbm, dram), self.clock), make_params(cls, params or {}))
        if hasattr(self.policy, "kvds"):
            self.policy.kvds = self
        self.name = cls.name
        self.ignores_pins = cls.name in SEED_IGNORES_PINS
        self.live: dict[str, _Seed] = {}
        self.hbm_used = 0
        self.dram_used = 0
        self.step = 0
        self.decays = 0
        self._last_decay_step = -1
        self._memo: dict[tuple[float, int], float] = {}
        self.result = CompatResult(self.name, hbm_bytes)

    # ---- SeedLabels (policies.scored) ----------------------------------------------------

    def terms(self, block_id: str) -> tuple[float, float, int | None, float | None]:
        seed = self.live[block_id]
        snap = seed.snap
        target = snap.target_decode_step
        return (
            _decayed(seed.recency0, self.decays - seed.decays_at, self._memo),
            float(max(self.step - snap.last_access_step, 0)),
            snap.deadline_us,
            None if target is None else float(max(target - self.step, 0)),
        )

    def last_access_step(self, block_id: str) -> int:
        return self.live[block_id].snap.last_access_step

    # ---- the loop ------------------------------------------------------------------------

    def run(self, events: Iterator[EventLine]) -> CompatResult:
        for ev in events:
            self.step = ev.step
            self.clock.now_us = ev.step * self.us_per_step
            self.clock.event_index += 1
            latency = BASE_US + self._apply(ev)
            self.result.latency_us += latency
            if ev.step != self._last_decay_step:
                self.decays += 1  # every live label loses 0.03 (read lazily by ``terms``)
                self._last_decay_step = ev.step
        return self.result

    def _apply(self, ev: EventLine) -> int:
        snap, kind = ev.intent, ev.event_type
        oid = snap.object_id
        seed = self.live.get(oid)
        if kind == "ALLOCATED":
            if seed is None:
                seed = self.live[oid] = _Seed(_copy(snap), Block(oid, snap.size_bytes, request_id=snap.request_id), self.decays)
            else:
                self._set(seed, snap)
            self._sync(seed)
            if snap.current_tier == "hbm":
                return self._to_hbm(seed)
            if seed.tier != "dram":
                self._place(seed, "dram")
            return 0
        if kind == "ACCESSED":
            if seed is None:
                seed = self.live[oid] = _Seed(_copy(snap), Block(oid, snap.size_bytes, request_id=snap.request_id), self.decays)
            s = seed.snap
            for name in _ACCESS_FIELDS:
                setattr(s, name, getattr(snap, name))
            s.last_access_step = ev.step
            self._label(seed, 1.0)
            self._sync(seed)
            self.result.accesses += 1
            critical = s.priority == Priority.DECODE_CRITICAL or s.phase == Phase.DECODE
            self.result.dc_accesses += critical
            if seed.tier == "hbm":
                return 0
            self.result.misses += 1
            self.result.dc_misses += critical
            return MISS_US + self._to_hbm(seed)
        if kind == "MARKED_DECODE_CRITICAL":
            if seed is None:
                seed = self.live[oid] = _Seed(_copy(snap), Block(oid, snap.size_bytes, request_id=snap.request_id), self.decays)
            else:
                for name in _CRITICAL_FIELDS:
                    setattr(seed.snap, name, getattr(snap, name))
                self._label(seed, snap.recency_score)
            seed.snap.priority = Priority.DECODE_CRITICAL
            seed.snap.pin_requested = True
            self._sync(seed)
            return 0
        if seed is None:
            return 0  # the seed ignores the other events of a block it does not know
        if kind == "MARKED_COLD":
            for name in _COLD_FIELDS:
                setattr(seed.snap, name, getattr(snap, name))
            seed.snap.priority = Priority.COLD
            self._label(seed, snap.recency_score)
            self._sync(seed)
        elif kind == "COMMITTED":
            seed.snap.is_committed, seed.snap.is_draft = True, False
            self._sync(seed)
        elif kind == "SPILLED":
            if "dram" in seed.snap.allowed_tiers:
                self._place(seed, "dram")
                self.result.spills += 1
                return SPILL_US
        elif kind == "PREFETCHED":
            if seed.tier != "hbm":
                self._set(seed, snap)
                self._sync(seed)
                if self.policy.admit_prefetch(seed.block, []):
                    self.result.prefetches += 1
                    return PREFETCH_US + self._to_hbm(seed)
        elif kind == "EVICTED":
            self._place(seed, "")
            self.result.evictions += 1
        elif kind == "FREED":
            self._place(seed, "")
            del self.live[oid]
        return 0

    def _set(self, seed: _Seed, snap: Snapshot) -> None:
        """Every field from the snapshot (the tier stays where the model has it)."""
        tier = seed.snap.current_tier
        seed.snap = _copy(snap)
        seed.snap.current_tier = tier
        self._label(seed, snap.recency_score)

    def _label(self, seed: _Seed, recency: float) -> None:
        seed.recency0 = recency
        seed.decays_at = self.decays

    def _sync(self, seed: _Seed) -> None:
        """Our Block's intent fields from the seed's state (what a ported policy reads)."""
        s, b = seed.snap, seed.block
        if s.priority == Priority.DECODE_CRITICAL:
            s.pin_requested = True
        b.priority = s.priority
        b.phase = s.phase
        b.pin_requested = b.pinned = s.pin_requested
        b.critical = s.priority == Priority.DECODE_CRITICAL
        b.slack_us = s.slack_us
        b.recompute_cost_us = s.recompute_cost_us
        b.request_priority = s.request_priority
        b.is_draft, b.is_committed = s.is_draft, s.is_committed
        b.reuse_window = s.expected_reuse_window_tokens
        b.recompute_ok, b.compression_ok, b.prefetch_ok = s.recompute_ok, s.compression_ok, s.prefetch_ok
        now = self.clock.now_us
        # Policies that do not read the seed's labels see the label as kvbroker's importer
        # maps it: an absolute time from now.
        b.deadline_us = b.due_us = None if s.deadline_us is None else max(0, now + s.deadline_us)
        b.created_us = s.created_step * self.us_per_step
        b.last_access_us = s.last_access_step * self.us_per_step
        if seed.tier == "hbm" and not isinstance(self.policy, ScoredPolicy):
            self.policy.update(seed.block)  # a scored policy is rescored at each choice

    def _place(self, seed: _Seed, tier: str) -> None:
        """Move a block's accounting (and its policy entry) to ``tier`` ("" for none)."""
        if seed.tier == tier:
            return
        size = seed.block.size
        if seed.tier == "hbm":
            self.hbm_used -= size
            self.policy.remove(seed.block)
        elif seed.tier == "dram":
            self.dram_used -= size
        seed.tier = tier
        if tier == "hbm":
            self.hbm_used += size
            self.policy.insert(seed.block)
        elif tier == "dram":
            self.dram_used += size

    def _to_hbm(self, seed: _Seed) -> int:
        self._place(seed, "hbm")
        seed.snap.current_tier = "hbm"
        latency = 0
        while self.hbm_used > self.hbm_bytes:
            victim = self._choose()
            if victim is None:
                break
            vseed = self.live[victim.block_id]
            self.policy.evicted(victim)
            vseed.tier = ""
            self.hbm_used -= victim.size
            if "dram" in vseed.snap.allowed_tiers and self.dram_used + victim.size <= self.dram_bytes:
                vseed.tier = "dram"
                vseed.snap.current_tier = "dram"
                self.dram_used += victim.size
                self.result.spills += 1
                latency += SPILL_US
            else:
                self.result.evictions += 1
        return latency

    def _choose(self) -> Block | None:
        policy = self.policy
        held = [s.block for s in self.live.values() if s.tier == "hbm"]
        candidates = held
        if not self.ignores_pins:
            unpinned = [b for b in held if not b.pinned]
            candidates = unpinned or held
        if isinstance(policy, ScoredPolicy):
            # Scores move with the step: the policy's own key, taken now for every
            # candidate, as the seed's scan does (its kept order would be stale).
            return min(candidates, key=policy.key, default=None)
        if self.ignores_pins:
            for b in held:
                b.pinned = False  # the seed's pin-blind policies: a pin is no protection
        protected = {b.block_id for b in held} - {b.block_id for b in candidates}
        victims = policy.choose_victims(1, protected)
        if self.ignores_pins:
            for b in held:
                b.pinned = self.live[b.block_id].snap.pin_requested
        return victims[0] if victims else None


def _copy(snap: Snapshot) -> Snapshot:
    return dataclasses.replace(snap, allowed_tiers=list(snap.allowed_tiers))


def read_events(path: str, skips: SkipCounter | None = None) -> Iterator[EventLine]:
    """The trace's lines, validated as ``kvds-events`` validates them (in step order)."""
    skips = skips or SkipCounter()
    last = 0
    for line, obj in read_jsonl(path, skips):
        try:
            ev = parse_event_line(obj, path, line)
            if ev.step < last:
                raise TraceError(path, line, "step", f"goes back in time: {ev.step} after step {last}")
        except TraceError as exc:
            skips.bad(exc)
            continue
        last = ev.step
        yield ev


def replay_compat(
    path: str, policy: str, hbm_bytes: int, dram_bytes: int = 4096 * MIB, *, params: dict[str, Any] | None = None
) -> CompatResult:
    """One policy over a kvds-events trace in the seed's compatibility mode."""
    return KvdsCompat(policy, hbm_bytes, dram_bytes, params=params).run(read_events(path))


def format_compat(records: list[CompatResult]) -> str:
    """The terminal table of ``kvbroker replay --kvds-compat``."""
    rows = [("policy", "hbm", "dc_miss", "dc_miss_rate", "misses", "spills", "prefetches", "latency_ms")]
    for r in records:
        rows.append(
            (
                r.policy,
                f"{r.hbm_bytes / MIB:g}MiB",
                f"{r.dc_misses}/{r.dc_accesses}",
                f"{r.dc_miss_rate:.4f}",
                str(r.misses),
                str(r.spills),
                str(r.prefetches),
                f"{r.latency_us / 1000:.1f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def run_cli(trace: str, policies: list[str], hbm: list[int], dram: int, as_json: bool, skip_bad: bool) -> int:
    """``kvbroker replay --trace T --format kvds-events --kvds-compat``: every policy at every
    HBM size, in the seed's compatibility mode; the table (or JSON) on stdout."""
    import json
    import sys

    records = []
    for size in hbm:
        for policy in policies:
            skips = SkipCounter(skip_bad=skip_bad)
            sim = KvdsCompat(policy, size, dram)
            records.append(sim.run(read_events(trace, skips)))
            if skips.skipped:
                print(f"kvbroker replay: skipped {skips.skipped} bad lines of {trace}", file=sys.stderr)
    print(json.dumps([r.as_record() for r in records], indent=2) if as_json else format_compat(records))
    return 0
