#!/usr/bin/env python3
"""Core speed: events per second of the broker's core alone, on ``kvbroker bench``'s workload.

The load generators' engines (broker/bench/workload.py) are encoded once, cut into batches
and serialized as IntentBatches, the streams interleaved as a broker would receive them;
each policy then applies those bytes through the broker's reader and core (``apply_batch``)
in this one process: no gRPC, no journal, no other process. What ``kvbroker bench``
measures end to end, less the server; with ``--prefix-cache`` the eviction path.

    python bench/core_speed.py                                   # deadline_edf and lru
    python bench/core_speed.py --prefix-cache --repeat 3
    python bench/core_speed.py --policies deadline_edf --events 200000 --json
    python bench/core_speed.py --prefix-cache --batch 64 --latency   # per-batch apply times too
    python bench/core_speed.py --prefix-cache --latency --watermarks 0.95,0.945   # smaller reclaims
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from broker.bench.workload import BENCH_TIERS, encode_workload, intent_batch, run_tag
from broker.config import ConfigError, parse_config
from broker.model.apply import apply_batch
from broker.model.core import Core


def batches(streams: int, events: int, batch: int, seed: int, prefix_cache: bool) -> list[bytes]:
    """IntentBatch bytes of ``streams`` engines, ``events`` each, in arrival order."""
    timed: list[tuple[int, int, bytes]] = []
    for client in range(streams):
        encoded = encode_workload(client, events, seed, prefix_cache=prefix_cache)
        blob = encoded.tagged(run_tag("core-speed", 0))
        client_id = f"bench-{client}".encode()
        for seq, start in enumerate(range(0, encoded.count, batch), 1):
            stop = min(start + batch, encoded.count)
            timed.append((start, client, intent_batch(client_id, seq, blob[encoded.offsets[start] : encoded.offsets[stop]])))
    timed.sort(key=lambda t: (t[0], t[1]))  # the streams' batches interleaved
    return [raw for _, _, raw in timed]


def tiers_toml(watermarks: tuple[float, float] | None) -> str:
    """The bench's tiers, each with these (high, low) watermarks if given."""
    if watermarks is None:
        return BENCH_TIERS
    high, low = watermarks
    return BENCH_TIERS.replace("[[tiers]]\n", f"[[tiers]]\nhigh_watermark = {high}\nlow_watermark = {low}\n")


def run(
    policy: str, raw: list[bytes], latency: list[tuple[float, int]] | None = None, watermarks: tuple[float, float] | None = None
) -> tuple[float, int, int]:
    """Seconds to apply every batch, directives issued, rejected events. With ``latency``,
    each batch's apply time (s) and directives are appended to it (a clock read a batch)."""
    config = parse_config(f'[policy]\nname = "{policy}"\n\n{tiers_toml(watermarks)}')
    core = Core(config.core)
    directives = rejected = 0
    clock = time.perf_counter
    started = clock()
    for data in raw:
        if latency is not None:
            t0 = clock()
        outcome = apply_batch(core, data)
        directives += len(outcome.directives)
        rejected += len(outcome.rejections)
        core.take_directives()
        if latency is not None:
            latency.append((clock() - t0, len(outcome.directives)))
    return clock() - started, directives, rejected


def latency_fields(latency: list[tuple[float, int]]) -> dict[str, float | int]:
    """Per-batch apply time percentiles (ms), and how many directives the slowest 1% made."""
    times = sorted(t for t, _ in latency)
    n = len(times)
    slowest = sorted(latency, reverse=True)[: max(1, n // 100)]
    return {
        "batch_p50_ms": round(times[n // 2] * 1000, 3),
        "batch_p99_ms": round(times[min(n - 1, n * 99 // 100)] * 1000, 3),
        "batch_p999_ms": round(times[min(n - 1, n * 999 // 1000)] * 1000, 3),
        "batch_max_ms": round(times[-1] * 1000, 3),
        "directives_per_batch": round(sum(d for _, d in latency) / n, 2),
        "directives_per_slowest_batch": round(sum(d for _, d in slowest) / len(slowest), 2),
        # The largest reclaim: the most directives one batch made (not a timing).
        "directives_max_batch": max(d for _, d in latency),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="deadline_edf,lru")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--events", type=int, default=100_000, help="events per stream")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--prefix-cache", action="store_true", help="requests release their blocks (as kvbroker bench --prefix-cache)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per policy; the median is reported")
    parser.add_argument("--latency", action="store_true", help="also each batch's apply time (first run): p50/p99/p999/max")
    parser.add_argument(
        "--watermarks", default="", help="HIGH,LOW: every tier's high_watermark and low_watermark (default: the config's 0.95,0.90)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    watermarks = None
    if args.watermarks:
        try:
            high, low = (float(w) for w in args.watermarks.split(","))
        except ValueError:
            parser.error(f"--watermarks: want HIGH,LOW (two numbers), got {args.watermarks!r}")
        watermarks = (high, low)
        try:
            parse_config(tiers_toml(watermarks))
        except ConfigError as exc:
            parser.error(f"--watermarks: {exc}")
    raw = batches(args.streams, args.events, args.batch, args.seed, args.prefix_cache)
    events = args.streams * args.events
    records = []
    for policy in (p for p in args.policies.split(",") if p):
        latency: list[tuple[float, int]] | None = [] if args.latency else None
        runs = [run(policy, raw, latency if i == 0 else None, watermarks) for i in range(max(1, args.repeat))]
        seconds = statistics.median(r[0] for r in runs)
        _, directives, rejected = runs[0]
        if rejected:
            print(f"core_speed: {policy}: {rejected} events rejected", file=sys.stderr)
            return 1
        record = {
            "policy": policy,
            "prefix_cache": args.prefix_cache,
            "watermarks": list(watermarks) if watermarks else None,
            "events": events,
            "seconds": round(seconds, 3),
            "events_per_s": round(events / seconds),
            "directives": directives,
            "runs": len(runs),
        }
        if latency:
            record.update(latency_fields(latency))
        records.append(record)
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            rates = [events / r[0] for r in runs]
            spread = f", {min(rates):,.0f}..{max(rates):,.0f}" if len(runs) > 1 else ""
            print(f"{policy:<20} {record['events_per_s']:>10,} events/s  ({directives:,} directives; {seconds:.2f}s{spread})", flush=True)
            if latency:
                print(
                    f"{'':<20} a batch: p50 {record['batch_p50_ms']} ms, p99 {record['batch_p99_ms']}, p999 {record['batch_p999_ms']}, "
                    f"max {record['batch_max_ms']}; directives {record['directives_per_batch']} a batch, "
                    f"{record['directives_per_slowest_batch']} in the slowest 1%, at most {record['directives_max_batch']}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
