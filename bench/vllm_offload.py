"""The Mooncake trace through vLLM's real CPUOffloadingManager: hits of vLLM's own lru and
arc at each of its admission settings (``store_threshold`` 1-4) and of kvbroker's policies
through the adapter (vllm_integration/decisions_to_vllm), the default first, each beside its
share of Belady's hits (broker/replay/belady_prefix.py) and what ``kvbroker replay --engine
vllm`` predicts for it, at three CPU tier sizes; the default against vLLM's default (lru)
and against vLLM's best setting there, chosen in hindsight; and the cost per policy call of
the adapter (kvbroker's lru and the default) against vLLM's LRU.

Needs vLLM, in a venv of its own (in the clone: ``python3 -m venv .venv-vllm && .venv-vllm/bin/pip install -e '.[vllm]'``)::

    python bench/vllm_offload.py --requests 1000 --no-cost   # try it: under a minute, no GPU
    python bench/vllm_offload.py                             # the whole trace, 1M / 3M / 10M tokens
    python bench/vllm_offload.py --trace T.jsonl --policies history_arc,lru --no-cost
    python bench/vllm_offload.py --requests 1000 --sizes 0.02,0.05 --policies lru,arc

Each request of tests/data/mooncake/synthetic_trace.jsonl (3,993 requests, 512-token
chunks given by prefix-chained hashes) is run as vLLM's scheduler runs it
(tests/vllm_integration/decisions_to_vllm/manager_driver.py): look up its chunks in order until a miss, load
the hits, store the misses (the manager evicts through the policy), finish the request
(token positions set, as vLLM's scheduler sets them). The hit ratio is chunks hit over
chunks asked. Sizes are chunk counts (default 1,953 / 5,859 / 19,531: 1M, 3M and 10M
tokens) or, below 1, fractions of the trace's distinct chunks. kvbroker's adapter reads the
trace's time (each request at its arrival), as replay does; the prediction beside each
figure is ``vllm_integration.manager_replay.engine.replay_requests``, what ``kvbroker replay --engine
vllm`` reports.

Cost: every policy call the manager makes is timed on the calling thread's CPU clock
(``time.thread_time_ns`` around it, less the clock's own cost: what it costs vLLM's
scheduler thread, whatever else the machine runs; the start heap frozen, as vLLM's engine
core freezes it), for vLLM's LRU and for the adapter
running kvbroker's lru (no journal, and with a file journal) and the default policy, over
the trace at the middle size; the median and the best of ``--repeat`` alternating runs are
printed with their ratio to vLLM's LRU (target: at most 2x), and the process CPU time of each whole run (the
manager, the policy and the journal's thread).
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from broker.config.settings import DEFAULT_POLICY  # noqa: E402
from broker.replay.belady_prefix import belady_prefix_hits  # noqa: E402
from tests.vllm_integration.decisions_to_vllm.manager_driver import (  # noqa: E402
    MOONCAKE,
    TimedPolicy,
    kvbroker_manager,
    mooncake,
    mooncake_at_trace_time,
    vllm_manager,
)
from vllm_integration.manager_replay.engine import replay_requests  # noqa: E402

KVBROKER_POLICIES = f"{DEFAULT_POLICY},lru,arc,prefix_aware,adaptive,s3fifo,heavy_hitter,sieve"


def timed_requests(trace: pathlib.Path, limit: int | None) -> list[tuple[int, list[int]]]:
    """(arrival in ms, hash ids) of the trace's first ``limit`` requests."""
    import json

    with trace.open() as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(r["timestamp"], r["hash_ids"]) for r in rows[:limit]]


def hit_ratio(manager: Any, requests: list[list[int]], evictions: list[Any] | None = None) -> float:
    hit, asked = mooncake(manager, requests, evictions=evictions)
    return hit / asked


def cost(make: Any, requests: list[list[int]]) -> tuple[float, int, float]:
    """(us per policy call on the calling thread's CPU clock, calls, process CPU seconds of
    the whole run: the manager, the policy, and the journal thread if any)."""
    from vllm.utils.gc_utils import freeze_gc_heap

    manager = make()
    timed = TimedPolicy(manager)
    # vLLM's engine core freezes its start heap (vllm/v1/engine/core.py: freeze_gc_heap), so
    # the collector's full passes walk what serving allocates, not vLLM's and torch's
    # modules: measured as vLLM runs it.
    freeze_gc_heap()
    started = time.process_time()
    try:
        mooncake(manager, requests)
        close = getattr(timed.inner, "close", None)
        if close is not None:
            close()
    finally:
        gc.unfreeze()
    return timed.us_per_call(), timed.calls, time.process_time() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--requests", type=int, default=None, help="the first N requests of the trace (default: all)")
    parser.add_argument(
        "--sizes", default="1953,5859,19531", help="CPU tier sizes: chunk counts, or fractions (< 1) of the trace's distinct chunks"
    )
    parser.add_argument("--policies", default=KVBROKER_POLICIES, help="kvbroker policies to run through the adapter")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each cost measurement (median and best are printed)")
    parser.add_argument("--cost-only", action="store_true", help="skip the hit ratio table")
    parser.add_argument("--no-cost", action="store_true", help="skip the cost per policy call (the table only)")
    parser.add_argument(
        "--trace", type=pathlib.Path, default=MOONCAKE, help="a Mooncake JSONL trace (default: the synthetic trace in tests/data)"
    )
    parser.add_argument(
        "--thresholds", default="1,2,3,4", help="vLLM's store_threshold settings to run its lru and arc with (1: no admission filter)"
    )
    args = parser.parse_args()

    timed = timed_requests(args.trace, args.requests)
    requests = [ids for _, ids in timed]
    distinct = len({h for r in requests for h in r})
    asked = sum(len(r) for r in requests)
    sizes = [int(f) if float(f) >= 1 else max(1, int(float(f) * distinct)) for f in args.sizes.split(",")]
    policies = [p for p in args.policies.split(",") if p]
    thresholds = [int(t) for t in args.thresholds.split(",") if t]
    print(f"{args.trace.name}: {len(requests)} requests, {asked} chunks asked, {distinct} distinct chunks")
    print(
        "chunks hit through vLLM 0.33.0's CPUOffloadingManager; each beside its share of Belady's hits "
        "(broker/replay/belady_prefix.py) and replay's prediction (kvbroker replay --engine vllm)"
    )
    same: list[str] = []
    for size in [] if args.cost_only else sizes:
        bound = belady_prefix_hits(requests, size)
        print(f"\nCPU tier of {size} chunks ({size * 512:,} tokens); Belady: {bound} hits ({bound / asked:.4f})")
        print(f"  {'policy':<36} {'in vLLM':>9} {'ratio':>7} {'Belady':>7}   {'replay':>9} {'ratio':>7} {'diff':>7}")

        def row(label: str, hit: int, tail: str = "", bound: int = bound) -> None:
            share = hit / bound if bound else 0.0
            print(f"  {label:<36} {hit:>9} {hit / asked:>7.4f} {share:>7.1%}{tail}", flush=True)

        theirs: list[Any] = []
        ours: list[Any] = []
        settings: dict[str, int] = {}
        for name in ("lru", "arc"):
            for t in thresholds:
                keep = theirs if (name, t) == ("lru", 1) else None
                hit, _ = mooncake(vllm_manager(name, size, store_threshold=t), requests, evictions=keep)
                label = f"vLLM {name}" + (f", store_threshold {t}" if t > 1 else "")
                settings[label] = hit
                row(label, hit)
        leader = ("", 0)
        mine = 0
        for p in policies:
            hit, _ = mooncake_at_trace_time(kvbroker_manager(p, size), timed)
            if p == "lru":
                mooncake(kvbroker_manager(p, size), requests, evictions=ours)
            predicted = replay_requests(timed, size, p).hits
            label = f"kvbroker {p}" + (" (default)" if p == DEFAULT_POLICY else "")
            diff = (predicted - hit) / hit if hit else 0.0
            row(label, hit, f"   {predicted:>9} {predicted / asked:>7.4f} {diff:>+7.1%}")
            if hit > leader[1]:
                leader = (p, hit)
            if p == DEFAULT_POLICY:
                mine = hit
        if DEFAULT_POLICY in policies:
            best_label, best = max(settings.items(), key=lambda kv: kv[1])
            default = settings.get("vLLM lru", 0)
            print(
                f"  the default: {mine / default if default else 0:.3f}x vLLM's default (lru); "
                f"{mine / best if best else 0:.3f}x vLLM's best setting here ({best_label.removeprefix('vLLM ')}, "
                f"chosen in hindsight; target >= 0.99x); {mine / leader[1] if leader[1] else 0:.1%} of kvbroker's best "
                f"here ({leader[0]}); {mine / bound if bound else 0:.1%} of Belady's hits"
            )
        if "lru" in policies and 1 in thresholds:
            same.append(f"{size}: {'identical' if ours == theirs else 'DIFFERENT'} ({sum(len(e or ()) for e in theirs)} evictions)")
    if same:
        print("\nkvbroker lru's evictions against vLLM lru's, store by store: " + "; ".join(same))
    if args.no_cost:
        return 0

    size = sizes[len(sizes) // 2]
    with tempfile.TemporaryDirectory() as tmp:
        makers = {
            "vLLM lru": lambda: vllm_manager("lru", size),
            "adapter, kvbroker lru, no journal": lambda: kvbroker_manager("lru", size),
            "adapter, kvbroker lru, file journal": lambda: kvbroker_manager(
                "lru", size, journal=f"file://{tmp}/j-{time.time_ns()}.journal"
            ),
            f"adapter, kvbroker {DEFAULT_POLICY}, no journal": lambda: kvbroker_manager(DEFAULT_POLICY, size),
        }
        runs: dict[str, list[float]] = {name: [] for name in makers}
        whole: dict[str, list[float]] = {name: [] for name in makers}
        calls: dict[str, int] = {}
        for _ in range(args.repeat):
            for name, make in makers.items():
                us, n, cpu = cost(make, requests)
                runs[name].append(us)
                whole[name].append(cpu)
                calls[name] = n
    base = statistics.median(runs["vLLM lru"])
    best = min(runs["vLLM lru"])
    print(f"\ncost per policy call at {size} chunks ({args.repeat} alternating runs; the calling thread's CPU time around each call)")
    print(f"  {'':<38} {'median':>10} {'ratio':>6}  {'best':>10} {'ratio':>6}  {'whole run, process CPU':>24}")
    cpu_base = statistics.median(whole["vLLM lru"])
    for name, values in runs.items():
        us, low = statistics.median(values), min(values)
        cpu = statistics.median(whole[name])
        print(
            f"  {name:<38} {us:7.3f} us {us / base:5.2f}x  {low:7.3f} us {low / best:5.2f}x  {cpu:9.2f} s ({cpu / cpu_base:4.2f}x)"
            f"   ({calls[name]} calls; per-call runs: {', '.join(f'{v:.3f}' for v in values)})"
        )
    print("  target: the adapter at most 2.00x vLLM's lru per call (the default's included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
