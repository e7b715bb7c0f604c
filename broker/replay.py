"""Replay a journal through one or more policies, on the same core as the live broker.

Each policy gets a fresh core built from the same config (tiers, margins) with only the
policy changed, and sees exactly the batches the live broker applied, in the same order.
For the policy the broker ran, ``verify`` compares every directive with the ones the
broker journaled (when it journaled them): replay must reproduce the live run exactly.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator
from typing import Any

from broker.apply import apply_batch
from broker.config import ConfigError, CoreConfig, PolicyConfig, core_from_json
from broker.core import Core, Directive
from broker.journal import JournalSource
from broker.journal.records import JournalRecord
from broker.service import directive_to_pb
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb


@dataclasses.dataclass
class ReplayResult:
    policy: str
    batches: int
    events: int
    directives: int
    seconds: float
    metrics: dict[str, Any]
    # None: not verified; else the number of directives that differed from the journal's.
    mismatches: int | None = None
    first_mismatch: str = ""

    def as_record(self) -> dict[str, Any]:
        """Flat JSON record with stable names (a contract for scripts and dashboards)."""
        m = self.metrics
        return {
            "policy": self.policy,
            "batches": self.batches,
            "events": self.events,
            "accesses": m["accesses"],
            "hit_rate": m["hit_rate"],
            "accesses_by_tier": m["accesses_by_tier"],
            "dc_accesses": m["dc_accesses"],
            "dc_misses": m["dc_misses"],
            "dc_miss_rate": m["dc_miss_rate"],
            "demotions": m["demotions"],
            "evictions": m["evictions"],
            "prefetches": m["prefetches"],
            "recomputes": m["recomputes"],
            "bytes_up": m["bytes_up"],
            "bytes_down": m["bytes_down"],
            "bytes_moved": m["bytes_moved"],
            "directives": self.directives,
            "rejected_events": m["rejected_events"],
            "events_per_s": self.events / self.seconds if self.seconds > 0 else 0.0,
            "verified": None if self.mismatches is None else self.mismatches == 0,
            "mismatches": self.mismatches,
        }


def journal_config(source: JournalSource) -> CoreConfig | None:
    """The first core config the journal recorded, if any."""
    for record in source.configs():
        return core_from_json(record.payload.decode())
    return None


def replay(
    batches: Iterable[JournalRecord],
    config: CoreConfig,
    policy: str,
    params: dict[str, Any] | None = None,
    *,
    expected: Iterable[JournalRecord] | None = None,
    sink: list[Directive] | None = None,
) -> ReplayResult:
    """Run the batches through a fresh core with ``policy``.

    With ``expected`` (the journal's DIRECTIVES records), every DirectiveBatch the replay
    produces is compared, in order, with the journaled one. ``sink`` collects every
    directive the replay decides.
    """
    core_config = dataclasses.replace(config, policy=PolicyConfig(policy, dict(params or {})))
    core = Core(core_config, allow_offline=True)
    expect: Iterator[JournalRecord] | None = iter(expected) if expected is not None else None
    mismatches = 0
    first = ""
    n_batches = n_events = n_directives = 0
    started = time.perf_counter()
    for record in batches:
        batch = pb.IntentBatch.FromString(record.payload)
        core.generation = record.generation
        outcome = apply_batch(core, batch)
        n_batches += 1
        n_events += len(batch.events)
        n_directives += len(outcome.directives)
        if sink is not None:
            sink.extend(outcome.directives)
        if expect is not None and outcome.directives:
            got = [directive_to_pb(d) for d in outcome.directives]
            want_record = next(expect, None)
            want = list(dpb.DirectiveBatch.FromString(want_record.payload).directives) if want_record else []
            if got != want:
                bad = sum(1 for g, w in zip(got, want, strict=False) if g != w) + abs(len(got) - len(want))
                mismatches += bad
                if not first:
                    first = f"batch {batch.client_id}#{batch.batch_seq}: replay gave {len(got)} directives, journal has {len(want)}"
    if expect is not None:
        extra = sum(len(dpb.DirectiveBatch.FromString(r.payload).directives) for r in expect)
        if extra:
            mismatches += extra
            first = first or f"journal holds {extra} directives the replay never produced"
    seconds = time.perf_counter() - started
    tier_names = [t.name for t in core.tiers]
    return ReplayResult(
        policy=core.policy_name,
        batches=n_batches,
        events=n_events,
        directives=n_directives,
        seconds=seconds,
        metrics=core.stats.as_dict(tier_names),
        mismatches=mismatches if expect is not None else None,
        first_mismatch=first,
    )


def replay_source(
    source: JournalSource,
    policies: list[str],
    config: CoreConfig | None = None,
    *,
    verify: bool = False,
) -> list[ReplayResult]:
    """Replay a journal through each policy; verify the live policy's directives if asked."""
    source.check()
    recorded = journal_config(source)
    cfg = config or recorded
    if cfg is None:
        raise ConfigError("the journal holds no config record; pass --config with the broker's config")
    live_policy = recorded.policy.name if recorded is not None else None
    results = []
    for name in policies:
        check = verify and name == live_policy
        results.append(replay(source.batches(), cfg, name, expected=source.directives() if check else None))
    return results


def format_table(results: list[ReplayResult]) -> str:
    """A terminal table, one row per policy."""
    headers = ["policy", "events", "accesses", "hit_rate", "dc_miss_rate", "demotions", "evictions", "prefetches", "MiB_moved", "verified"]
    rows = []
    for r in results:
        rec = r.as_record()
        verified = "-" if rec["verified"] is None else ("yes" if rec["verified"] else f"NO ({r.mismatches})")
        rows.append(
            [
                r.policy,
                str(rec["events"]),
                str(rec["accesses"]),
                f"{rec['hit_rate']:.4f}",
                f"{rec['dc_miss_rate']:.4f}",
                str(rec["demotions"]),
                str(rec["evictions"]),
                str(rec["prefetches"]),
                f"{rec['bytes_moved'] / 2**20:.1f}",
                verified,
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths, strict=True)))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    return "\n".join(lines)
