"""What shadows and what-if sizes cost inside vLLM's real CPUOffloadingManager (issue 31).

Needs vLLM, in a venv of its own (in the clone: ``python3 -m venv .venv-vllm && .venv-vllm/bin/pip install -e '.[vllm]'``)::

    python bench/vllm_shadows.py                       # the whole trace at 19,531 chunks, 5 runs
    python bench/vllm_shadows.py --size 5859 --repeat 3

The Mooncake synthetic trace runs, request after request, through the real manager with
kvbroker's adapter deciding (the default policy, no journal), as bench/vllm_offload.py runs
it. Every policy call is timed on the calling thread's CPU clock (what it costs vLLM's
scheduler thread; tests/vllm_integration/decisions_to_vllm/manager_driver.TimedPolicy), and the total over the
run is compared across:

- the adapter alone;
- the adapter with one unsampled shadow of the deciding policy (the dearest shadow of that
  policy: it runs every chunk, as the decider does) -- bound: it adds at most the adapter's
  own cost;
- the adapter with a what-if curve of three sizes (0.5x, 2x, 4x) at the default sampling
  rate -- bound: it adds at most half the adapter's own cost.

The heap is frozen after the manager is built, as vLLM's engine core freezes it after its
start. The runs alternate, ``--repeat`` times; the medians are compared, and each line prints the
figure, its bound and the verdict.
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import statistics
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from broker.config.settings import DEFAULT_POLICY  # noqa: E402
from tests.vllm_integration.decisions_to_vllm.manager_driver import TimedPolicy, kvbroker_manager, mooncake_at_trace_time  # noqa: E402
from vllm_integration.decisions_to_vllm.settings import DEFAULT_WHATIF_SAMPLE  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from vllm_offload import timed_requests  # noqa: E402


def total_ms(make: Any, requests: list[tuple[int, list[int]]]) -> float:
    """The calling thread's CPU time in policy calls over the whole run, in ms. The heap is
    frozen once the manager is built, as vLLM's engine core does after its start
    (vllm.utils.gc_utils.freeze_gc_heap): the collector's full passes then walk what the
    run allocates, not vLLM's and torch's modules, and land where they do in vLLM."""
    from vllm.utils.gc_utils import freeze_gc_heap

    manager = make()
    timed = TimedPolicy(manager)
    freeze_gc_heap()
    try:
        mooncake_at_trace_time(manager, requests)
    finally:
        gc.unfreeze()
    return timed.us_per_call() * timed.calls / 1000.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--size", type=int, default=19531, help="the CPU tier in chunks (default 19,531: 10M tokens)")
    parser.add_argument("--requests", type=int, default=None, help="the first N requests of the trace (default: all)")
    parser.add_argument("--policy", default=DEFAULT_POLICY, help="the deciding policy (default: the default)")
    parser.add_argument("--sample", type=float, default=DEFAULT_WHATIF_SAMPLE, help="the what-if sampling rate")
    parser.add_argument("--repeat", type=int, default=5, help="alternating runs of each variant (medians compared)")
    args = parser.parse_args()

    requests = timed_requests(args.requests)
    size, policy = args.size, args.policy
    variants = {
        "adapter alone": lambda: kvbroker_manager(policy, size),
        f"+ shadow {policy}": lambda: kvbroker_manager(policy, size, shadows=policy),
        f"+ what-if 0.5x,2x,4x at {args.sample:g}": lambda: kvbroker_manager(policy, size, whatif="0.5,2,4", whatif_sample=args.sample),
    }
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeat):
        for name, make in variants.items():
            runs[name].append(total_ms(make, requests))
    base = statistics.median(runs["adapter alone"])
    print(f"{policy} deciding at {size} chunks, {len(requests)} requests; CPU time in policy calls, median of {args.repeat}")
    print(f"  {'':<32} {'total':>10} {'added':>10} {'added/own':>10} {'bound':>6}  verdict")
    bounds = {f"+ shadow {policy}": 1.0, f"+ what-if 0.5x,2x,4x at {args.sample:g}": 0.5}
    failed = False
    for name, values in runs.items():
        ms = statistics.median(values)
        if name not in bounds:
            print(f"  {name:<32} {ms:8.1f} ms {'':>10} {'':>10} {'':>6}  (runs: {', '.join(f'{v:.0f}' for v in values)})")
            continue
        added = ms - base
        share = added / base
        ok = share <= bounds[name]
        failed |= not ok
        print(
            f"  {name:<32} {ms:8.1f} ms {added:7.1f} ms {share:9.2f}x {bounds[name]:5.2f}x  {'met' if ok else 'NOT MET'}"
            f"  (runs: {', '.join(f'{v:.0f}' for v in values)})"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
