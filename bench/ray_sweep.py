#!/usr/bin/env python3
"""A replay sweep's wall time run locally (a process pool, as `kvbroker replay --jobs N`)
and as Ray tasks (`kvbroker replay --ray`), with the number of tasks, so that Ray's
overhead per task is known. Needs the [ray] extra.

    python bench/ray_sweep.py                               # this machine: local Ray of --cpus CPUs
    python bench/ray_sweep.py --policies lru,fifo,arc,deadline_edf --hbm 1000000tok,3000000tok
    python bench/ray_sweep.py --address auto --journal 'redis://redis:6379/0?stream=kvbroker:*:journal'
                                                            # a real Ray cluster, the fleet in its Redis
    python bench/ray_sweep.py --json

Local: ``run_jobs`` with --cpus processes. Ray: Ray started (or joined) first and timed
apart, then the same jobs as tasks (each source read once into the object store). Both give
the same records (the test suite checks it field by field); what differs is the time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from broker.cli.main import _trace_options, build_parser
from broker.replay.sweep import Job, Source, parse_capacity, run_jobs, single_tier

TRACE = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "mooncake", "synthetic_trace.jsonl")


def sweep_jobs(args: argparse.Namespace) -> list[Job]:
    """policies x capacities on the bundled Mooncake trace (prompt blocks only, one cache
    tier: the prefix-cache setup), or on the journals --journal names (their own configs)."""
    policies = [p for p in args.policies.split(",") if p]
    if args.journal:
        from broker.journal import open_source
        from broker.replay.fleet import expand_journals
        from broker.replay.plan import PlannedSource, SweepSpec, plan_jobs
        from broker.replay.replay import journal_config

        planned = []
        for url, stream in expand_journals([args.journal]):
            base = journal_config(open_source(url, stream))
            assert base is not None, f"{url} {stream}: no config record"
            planned.append(PlannedSource(Source(journal=url, stream=stream), base))
        combos = [{0: parse_capacity(c, 131072, "--hbm")} for c in args.hbm.split(",")]
        return plan_jobs(planned, SweepSpec(policies, combos=combos))
    options = _trace_options(build_parser().parse_args(["replay", "--trace", args.trace, "--format", "mooncake", "--no-decode"]))
    source = Source(trace=args.trace, fmt="mooncake", options=options)
    capacities = [parse_capacity(c, options.bytes_per_token, "--hbm") for c in args.hbm.split(",")]
    return [Job(source, policy, single_tier(capacity)) for capacity in capacities for policy in policies]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=TRACE, help="Mooncake trace (default: the bundled one)")
    parser.add_argument("--journal", help="replay these journals instead (URL or pattern, as kvbroker replay --journal)")
    parser.add_argument("--policies", default="lru,fifo,s3fifo,deadline_edf")
    parser.add_argument("--hbm", default="500000tok,1000000tok,2000000tok", help="capacities of the cache tier")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="local processes, and the local Ray's CPUs")
    parser.add_argument("--address", help="a Ray cluster (as ray.init takes it); default: a local Ray of --cpus CPUs")
    parser.add_argument("--skip-local", action="store_true", help="only the Ray run (a cluster's driver may be small)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from broker.replay.ray_runner import import_ray, run_jobs_on_ray

    ray = import_ray()
    jobs = sweep_jobs(args)
    quiet: Any = lambda line: None  # noqa: E731
    result: dict[str, Any] = {"tasks": len(jobs), "cpus": args.cpus, "address": args.address or "local"}
    if not args.skip_local:
        started = time.perf_counter()
        local = run_jobs(jobs, args.cpus, log=quiet, progress=False)
        result["local_s"] = time.perf_counter() - started
        result["replay_s"] = sum(r["seconds"] for r in local)
        result["events"] = sum(r["events"] for r in local)
    started = time.perf_counter()
    ray.init(address=args.address, include_dashboard=False, logging_level="warning", **({} if args.address else {"num_cpus": args.cpus}))
    result["ray_start_s"] = time.perf_counter() - started
    result["ray_cpus"] = ray.cluster_resources().get("CPU", 0)
    try:
        started = time.perf_counter()
        on_ray = run_jobs_on_ray(jobs, log=quiet)
        result["ray_s"] = time.perf_counter() - started
    finally:
        ray.shutdown()
    result.setdefault("events", sum(r["events"] for r in on_ray))
    if "local_s" in result:
        result["overhead_per_task_s"] = (result["ray_s"] - result["local_s"]) / len(jobs)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"sweep: {len(jobs)} tasks, {result['events']:,} events in all")
    if "local_s" in result:
        print(f"local ({args.cpus} processes): {result['local_s']:.2f} s wall ({result['replay_s']:.2f} s of replay in the jobs)")
    ray_line = f"ray ({result['address']}, {result['ray_cpus']:g} CPUs): {result['ray_s']:.2f} s wall"
    print(f"{ray_line}, plus {result['ray_start_s']:.2f} s to start Ray")
    if "overhead_per_task_s" in result:
        print(f"overhead per task on Ray: {result['overhead_per_task_s'] * 1000:+.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
