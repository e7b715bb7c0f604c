"""The engine as it runs (issue 39): vLLM's own scheduler, GPU prefix cache and CPU tier on a
Mooncake trace, per CPU-tier policy: TTFT, throughput, where prompt tokens came from.

Needs vLLM (the [vllm] extra, in a venv of its own: ``python3 -m venv .venv-vllm && .venv-vllm/bin/pip install -e '.[vllm]'``)::

    python bench/vllm_scheduler.py                                  # the whole synthetic trace
    python bench/vllm_scheduler.py --requests 300 --gpu-blocks 4096 --cpu-gib 24
    python bench/vllm_scheduler.py --policies history_arc,lru --jobs 2 --json

Each cell (a GPU size and a CPU size) runs the trace once without a CPU tier (the baseline)
and once per policy: vLLM's lru and arc at each ``--store-thresholds``, and each kvbroker
policy (default: every online one) through kvbroker's CachePolicy. Every run is vLLM's
Scheduler and KVCacheManager with the OffloadingConnector's scheduler side, a fake executor
and the cost model of vllm_integration/scheduler_harness/settings.py (Llama-3.1-8B bf16 on one
H100 unless told otherwise): docs/vllm.md ("The engine as it runs") has the table and reads it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import pathlib
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from policies import registry  # noqa: E402
from vllm_integration.scheduler_harness.figures import HEADER, Figures, summarize, table_row  # noqa: E402
from vllm_integration.scheduler_harness.settings import VLLM_POLICIES, HarnessError, HarnessSettings  # noqa: E402
from vllm_integration.scheduler_harness.trace import TraceRequest, mooncake  # noqa: E402

TRACE = ROOT / "tests" / "data" / "mooncake" / "synthetic_trace.jsonl"
ONLINE = tuple(name for name in registry.names() if not registry.policy_class(name).offline)
GIB = 1 << 30


def _run(settings: HarnessSettings, trace: list[TraceRequest]) -> Any:
    from vllm_integration.scheduler_harness import engine  # vLLM is imported here, in the worker

    # The CachePolicy stays in the worker (it does not pickle); the figures come back.
    return dataclasses.replace(engine.run(settings, trace), policy=None)


def _cell(base: HarnessSettings, engines: list[HarnessSettings], trace: list[TraceRequest], jobs: int) -> list[Figures]:
    """The baseline and every engine of one cell, their figures against the baseline."""
    everything = [dataclasses.replace(base, cpu_bytes=0), *engines]
    if jobs > 1:
        with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
            results = list(pool.map(_run, everything, [trace] * len(everything)))
    else:
        results = [_run(s, trace) for s in everything]
    baseline = results[0]
    return [summarize(s.label(), r, baseline) for s, r in zip(everything, results, strict=True)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(TRACE), help="a Mooncake trace (default: the synthetic one)")
    ap.add_argument("--requests", type=int, default=None, help="the first N requests (default: all)")
    ap.add_argument("--gpu-blocks", default="16384,32768", help="GPU KV cache sizes, in 16-token blocks")
    ap.add_argument("--cpu-gib", default="32,128,512", help="CPU tier sizes, in GiB (cpu_bytes_to_use)")
    ap.add_argument("--policies", default=",".join(ONLINE), help="kvbroker policies (default: every online one)")
    ap.add_argument("--vllm-policies", default=",".join(VLLM_POLICIES), help="vLLM's own CPU-tier policies")
    ap.add_argument("--store-thresholds", default="1,2,3,4", help="vLLM's store_threshold values for its policies")
    ap.add_argument("--time-scale", type=float, default=1.0, help="arrival times multiplied by this (2: half the rate)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    ap.add_argument("--json", action="store_true", help="one JSON object per cell instead of tables")
    args = ap.parse_args(argv)
    try:
        gpus = [int(x) for x in args.gpu_blocks.split(",")]
        cpus = [float(x) for x in args.cpu_gib.split(",")]
        thresholds = [int(x) for x in args.store_thresholds.split(",")]
    except ValueError as exc:
        print(f"bench/vllm_scheduler.py: a size list: {exc}", file=sys.stderr)
        return 2
    kvbroker = [p for p in args.policies.split(",") if p]
    for p in kvbroker:
        if p not in registry.names() or registry.policy_class(p).offline:
            print(f"bench/vllm_scheduler.py: --policies: {p!r} is not an online kvbroker policy", file=sys.stderr)
            return 2
    started = time.perf_counter()
    trace = mooncake(args.trace, args.requests)
    for gpu in gpus:
        for cpu in cpus:
            base = HarnessSettings(
                gpu_blocks=gpu,
                cpu_bytes=int(cpu * GIB),
                time_scale=args.time_scale,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
            )
            engines = [
                dataclasses.replace(base, policy=f"vllm:{p}", store_threshold=t)
                for p in args.vllm_policies.split(",")
                if p
                for t in thresholds
            ]
            engines += [dataclasses.replace(base, policy=f"kvbroker:{p}") for p in kvbroker]
            try:
                for s in engines:
                    s.check()
            except HarnessError as exc:
                print(f"bench/vllm_scheduler.py: {exc}", file=sys.stderr)
                return 2
            cell_started = time.perf_counter()
            rows = _cell(base, engines, trace, args.jobs)
            chunks = f"{base.cpu_chunks:,} chunks of {base.cpu_chunk_tokens} tokens"
            title = f"GPU {gpu} blocks ({gpu * 16:,} tokens), CPU {cpu:g} GiB ({chunks})"
            if args.json:
                print(json.dumps({"gpu_blocks": gpu, "cpu_gib": cpu, "rows": [r.as_dict() for r in rows]}))
            else:
                refused = rows[0].refused
                took = time.perf_counter() - cell_started
                print(f"\n{title}: {rows[0].requests} requests ({refused} longer than the GPU cache, refused), {took:.0f} s")
                print("\n".join(HEADER))
                print("\n".join(table_row(r) for r in rows))
            sys.stdout.flush()
    print(f"\n{len(trace)} requests, {len(gpus) * len(cpus)} cells, {time.perf_counter() - started:.0f} s in all", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
