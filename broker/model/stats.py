"""Counters of the core: what GetStats, `kvbroker status` and replay reports show."""

from __future__ import annotations

from typing import Any, Final

from mypy_extensions import mypyc_attr

DIRECTIVE_KINDS = ("evict", "demote", "promote", "prefetch")
EVENT_KINDS = ("allocated", "accessed", "intent_updated", "released", "freed", "cleared", "acked", "eviction_requested")


# Every counter of CoreStats (merged() walks them; a compiled class has no __slots__ to read).
FIELDS: Final = (
    "accesses_by_tier",
    "acks_done",
    "acks_failed",
    "allocated_bytes",
    "batches",
    "bytes_down",
    "bytes_up",
    "dc_accesses",
    "dc_misses",
    "demotions",
    "directives",
    "duplicate_batches",
    "events",
    "evictions",
    "overcommits",
    "latency_hist",
    "latency_total_us",
    "deadline_accesses",
    "deadline_misses",
    "prefetches",
    "recomputes",
    "rejected_events",
    "reuses",
    "prompt_blocks",
    "prefix_hits_top",
    "prefix_hits_any",
)


# Compiled (broker/native.py): the core bumps these counters a dozen times per event, and
# on an interpreted class each bump was a generic getattr plus setattr (measured: 15 per
# allocation of a prompt-only replay). Copyable when compiled: see policies.base.Block.
@mypyc_attr(allow_interpreted_subclasses=True)
class CoreStats:
    """Plain counters, updated in place on the hot path."""

    __slots__ = FIELDS

    def __init__(self, tiers: int) -> None:
        # One slot per tier, plus a last one for accesses to dropped blocks, so that the
        # dropped tier index -1 lands on it.
        self.accesses_by_tier = [0] * (tiers + 1)
        self.dc_accesses = 0
        self.dc_misses = 0
        self.events = dict.fromkeys(EVENT_KINDS, 0)
        self.directives = dict.fromkeys(DIRECTIVE_KINDS, 0)
        self.batches = 0
        self.duplicate_batches = 0
        self.rejected_events = 0
        self.demotions = 0
        self.evictions = 0
        self.prefetches = 0
        self.recomputes = 0
        self.reuses = 0
        # Blocks prompts brought (new allocations + reuses), and how many the broker still
        # had: in the top tier, and in any tier.
        self.prompt_blocks = 0
        self.prefix_hits_top = 0
        self.prefix_hits_any = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.allocated_bytes = 0
        self.acks_done = 0
        self.acks_failed = 0
        self.overcommits = 0
        # Simulated access latency (µs) by bucket: exact below 4096 µs, then 64 buckets per
        # power of two (under 1.6% apart), so percentiles cost no per-access storage.
        self.latency_hist: dict[int, int] = {0: 0}
        self.latency_total_us = 0
        self.deadline_accesses = 0
        self.deadline_misses = 0

    def record_latency(self, latency_us: int) -> None:
        if not latency_us:
            self.latency_hist[0] += 1
            return
        if latency_us < 4096:
            key = latency_us
        else:
            shift = latency_us.bit_length() - 7
            key = (latency_us >> shift) << shift
        hist = self.latency_hist
        hist[key] = hist.get(key, 0) + 1
        self.latency_total_us += latency_us

    def latency_percentile(self, q: float) -> int:
        """The latency (µs, bucket floor) under which a fraction ``q`` of accesses fall."""
        total = sum(self.latency_hist.values())
        if not total:
            return 0
        rank = q * total
        seen = 0
        for key in sorted(self.latency_hist):
            seen += self.latency_hist[key]
            if seen >= rank:
                return key
        return max(self.latency_hist)

    @property
    def accesses(self) -> int:
        return sum(self.accesses_by_tier)

    def hit_rate(self) -> float:
        """Fraction of block accesses served from the top tier."""
        total = self.accesses
        return self.accesses_by_tier[0] / total if total else 0.0

    def dc_miss_rate(self) -> float:
        """Decode-critical misses per decode-critical access (not per block)."""
        return self.dc_misses / self.dc_accesses if self.dc_accesses else 0.0

    def prefix_hit_rate(self) -> float:
        """Of the prompt blocks requests brought, the fraction already in the top tier."""
        return self.prefix_hits_top / self.prompt_blocks if self.prompt_blocks else 0.0

    def prefix_hit_rate_any(self) -> float:
        """Of the prompt blocks requests brought, the fraction still held in any tier."""
        return self.prefix_hits_any / self.prompt_blocks if self.prompt_blocks else 0.0

    def as_dict(self, tier_names: list[str]) -> dict[str, Any]:
        by_tier = {name: self.accesses_by_tier[i] for i, name in enumerate(tier_names)}
        by_tier["dropped"] = self.accesses_by_tier[-1]
        return {
            "accesses": self.accesses,
            "hit_rate": self.hit_rate(),
            "accesses_by_tier": by_tier,
            "dc_accesses": self.dc_accesses,
            "dc_misses": self.dc_misses,
            "dc_miss_rate": self.dc_miss_rate(),
            "events": dict(self.events),
            "directives": dict(self.directives),
            "batches": self.batches,
            "duplicate_batches": self.duplicate_batches,
            "rejected_events": self.rejected_events,
            "demotions": self.demotions,
            "evictions": self.evictions,
            "prefetches": self.prefetches,
            "recomputes": self.recomputes,
            "reuses": self.reuses,
            "prompt_blocks": self.prompt_blocks,
            "prefix_hits": self.prefix_hits_top,
            "prefix_hit_rate": self.prefix_hit_rate(),
            "prefix_hit_rate_any_tier": self.prefix_hit_rate_any(),
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "bytes_moved": self.bytes_up + self.bytes_down,
            "acks_done": self.acks_done,
            "acks_failed": self.acks_failed,
            "overcommits": self.overcommits,
            "p50_us": self.latency_percentile(0.50),
            "p95_us": self.latency_percentile(0.95),
            "p99_us": self.latency_percentile(0.99),
            "mean_us": self.latency_total_us / self.accesses if self.accesses else 0.0,
            "deadline_accesses": self.deadline_accesses,
            "deadline_misses": self.deadline_misses,
            "deadline_miss_rate": self.deadline_misses / self.deadline_accesses if self.deadline_accesses else 0.0,
            "latency_hist": dict(self.latency_hist),
        }


def merged(parts: list[CoreStats]) -> CoreStats:
    """The counters of several cores as one (a split's arms together are the broker)."""
    out = CoreStats(len(parts[0].accesses_by_tier) - 1)
    for name in FIELDS:
        total: Any = getattr(out, name)
        for part in parts:
            value = getattr(part, name)
            if isinstance(value, dict):
                for key, n in value.items():
                    total[key] = total.get(key, 0) + n
            elif isinstance(value, list):
                total = [a + b for a, b in zip(total, value, strict=True)]
            else:
                total += value
        setattr(out, name, total)
    return out
