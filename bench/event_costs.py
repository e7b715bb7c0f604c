#!/usr/bin/env python3
"""Where a broker's time goes per event: decode, apply (core), policy, answer, journal.

On ``kvbroker bench``'s workload (``bench/core_speed.py`` builds the same interleaved
IntentBatch bytes), in this one process, CPU time (``time.process_time``: on a shared host
wall time counts the other tenants too), each stage over every batch:

- decode: the broker's reader of the batch bytes (``read_batch`` and its events), alone;
- apply: ``apply_batch`` on a fresh core: decode, the core's bookkeeping and the policy;
- policy: the same apply with every tier's policy wrapped by an interpreted subclass that
  times each call into it (``insert``, ``access``, ``update``, ``choose_victims`` ...), less
  the wrapper's own cost calibrated on an empty call; an upper bound, since the compiled
  core calls an interpreted override more slowly than the compiled method;
- core: apply less decode less policy;
- answer: the DirectiveBatch bytes of each batch's outcome (``answer_bytes``);
- journal: a file journal's work per batch (framing, CRC, ``pwrite`` to a temporary file;
  the Redis journal's CPU is ``bench/journal_write.py``'s).

What is not here is the server: gRPC, the event loop, the stream's framing, whose ceiling
the echo server of ``kvbroker bench`` measures.

    python bench/event_costs.py                          # deadline_edf, 4 streams x 50k events, batch 256
    python bench/event_costs.py --policies lru,deadline_edf --batch 64 --prefix-cache
    python bench/event_costs.py --quick --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from core_speed import batches as workload_batches  # noqa: E402

from broker.bench.workload import BENCH_TIERS  # noqa: E402
from broker.config import parse_config  # noqa: E402
from broker.journal.records import JournalRecord, RecordKind, encode  # noqa: E402
from broker.model.apply import apply_batch  # noqa: E402
from broker.model.core import Core  # noqa: E402
from broker.model.wire import read_batch  # noqa: E402
from broker.service.broker_service import answer_bytes  # noqa: E402
from policies.base import Policy  # noqa: E402

# The calls the core makes into a policy (policies/base.py's interface).
HOOKS = (
    "insert",
    "access",
    "access_many",
    "update",
    "remove",
    "evicted",
    "choose_victims",
    "score",
    "prefer_drop",
    "after_access",
    "admit_prefetch",
)


class Clock:
    """Seconds spent inside policy calls, and how many calls."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0


def timed_policy(policy: Policy, clock: Clock) -> Policy:
    """A policy of a subclass of ``policy``'s class whose hooks add their time to ``clock``."""
    base = type(policy)

    def wrap(name: str) -> Callable[..., Any]:
        inner = getattr(base, name)

        def hook(self: Policy, *args: Any) -> Any:
            t0 = time.process_time()
            try:
                return inner(self, *args)
            finally:
                clock.seconds += time.process_time() - t0
                clock.calls += 1

        return hook

    timed = type(f"Timed{base.__name__}", (base,), {name: wrap(name) for name in HOOKS if name in dir(base)})
    return timed(policy.ctx, policy.params)  # type: ignore[no-any-return]


def wrapper_cost(calls: int = 200_000) -> float:
    """Seconds the wrapper itself adds to one call (an empty call, timed the same way)."""
    clock = Clock()

    def empty() -> None:
        return None

    started = time.process_time()
    for _ in range(calls):
        t0 = time.process_time()
        try:
            empty()
        finally:
            clock.seconds += time.process_time() - t0
            clock.calls += 1
    return (time.process_time() - started) / calls


def costs(data: list[bytes], policy: str) -> dict[str, Any]:
    config = parse_config(f'[policy]\nname = "{policy}"\n\n{BENCH_TIERS}').core
    events = 0
    started = time.process_time()
    for b in data:
        reader = read_batch(b)
        events += len(list(reader.events({})))
    decode = time.process_time() - started

    core = Core(config)
    outcomes = []
    started = time.process_time()
    for b in data:
        outcomes.append(apply_batch(core, b))
        core.take_directives()
    apply = time.process_time() - started

    core = Core(config)
    clock = Clock()
    for tier in core.tiers:
        tier.policy = timed_policy(tier.policy, clock)
    started = time.process_time()
    for b in data:
        apply_batch(core, b)
        core.take_directives()
    timed_apply = time.process_time() - started
    policy_s = max(0.0, clock.seconds - clock.calls * wrapper_cost())

    readers = [read_batch(b) for b in data]
    started = time.process_time()
    for reader, outcome in zip(readers, outcomes, strict=True):
        answer_bytes(reader, outcome, 1)
    answer = time.process_time() - started

    with tempfile.TemporaryDirectory(prefix="kvbroker-costs-") as tmp:
        fd = os.open(os.path.join(tmp, "journal"), os.O_WRONLY | os.O_CREAT, 0o600)
        offset = 0
        started = time.process_time()
        for b in data:
            frame = encode(JournalRecord(RecordKind.BATCH, 1, 1, b))
            offset += os.pwrite(fd, frame, offset)
        journal = time.process_time() - started
        os.close(fd)

    def us(seconds: float) -> float:
        return round(seconds / events * 1e6, 3) if events else 0.0

    core_s = max(0.0, apply - decode - policy_s)
    return {
        "policy": policy,
        "events": events,
        "batches": len(data),
        "decode_us": us(decode),
        "core_us": us(core_s),
        "policy_us": us(policy_s),
        "apply_us": us(apply),
        "answer_us": us(answer),
        "journal_file_us": us(journal),
        "total_us": us(apply + answer + journal),
        "policy_calls": clock.calls,
        "timed_apply_us": us(timed_apply),
        "load_1m": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="deadline_edf")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--events", type=int, default=50_000, help="events per stream")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prefix-cache", action="store_true", help="finished requests release their blocks: the eviction path")
    ap.add_argument("--quick", action="store_true", help="2 streams x 3,000 events: checks the output, not the figure")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.streams, args.events = 2, 3_000
    data = workload_batches(args.streams, args.events, args.batch, args.seed, args.prefix_cache)
    for policy in (p for p in args.policies.split(",") if p):
        row = costs(data, policy)
        row.update(batch=args.batch, streams=args.streams, prefix_cache=args.prefix_cache)
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        total = row["total_us"] or 1.0
        print(f"{policy}: {row['events']:,} events in {row['batches']:,} batches of {args.batch} (load average {row['load_1m']})")
        for stage, key in (
            ("decode", "decode_us"),
            ("core", "core_us"),
            ("policy", "policy_us"),
            ("answer", "answer_us"),
            ("journal (file)", "journal_file_us"),
        ):
            print(f"  {stage:<15} {row[key]:>8.3f} us/event  {100 * row[key] / total:5.1f}%")
        print(f"  {'total':<15} {row['total_us']:>8.3f} us/event  (policy timed over {row['policy_calls']:,} calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
