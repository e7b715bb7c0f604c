#!/usr/bin/env python3
"""Every online policy on every trace at three sizes, in replay and inside vLLM: the matrix a
default policy is chosen from (issue 30).

    python bench/policy_matrix.py                                  # everything (vLLM if importable)
    python bench/policy_matrix.py --engines replay,libcachesim     # no vLLM: minutes
    python bench/policy_matrix.py --traces synthetic --requests 500 --policies lru,adaptive
    PYTHONPATH=$PWD /work/main/.venv-vllm/bin/python bench/policy_matrix.py --json /tmp/matrix.json

Traces (``--traces``): ``synthetic`` (tests/data/mooncake/synthetic_trace.jsonl), its halves
``synthetic_first_half`` and ``synthetic_second_half``, ``two_turn_chat``,
``zipf_docs_scan``, ``multi_turn_chat:1`` / ``multi_turn_chat:2`` and ``long_gap_chat:1`` /
``long_gap_chat:2`` (generator:seed), all
from bench/synthetic_prefix_traces.py, each written as a Mooncake JSONL file (first
``--requests`` requests). Sizes (``--sizes``): fractions of the trace's distinct chunks,
in chunks of 512 tokens (at least 1).

Engines (``--engines``), each at the same number of chunks:

- ``replay``: each kvbroker policy through ``kvbroker replay --trace F --format mooncake
  --no-decode --hbm Ntok``'s path (``broker.replay.sweep.run_job`` on one tier of N chunks,
  the trace imported once per cell), and ``belady`` (offline: the upper bound, never the
  best online). Hits: ``prefix_hits``, the prompt chunks found in the top tier (the
  statistic vLLM's chunk hit corresponds to); ratio: over ``prompt_blocks``. Replay counts
  every resident chunk of a prompt; vLLM stops at the first miss (see below).
- ``libcachesim``: libCacheSim's online algorithms (``--libcachesim``) on the chunk sequence
  the same import allocates (``bench/libcachesim_compare.py``'s ``libcachesim_hits``):
  every access of a resident chunk is a hit, as in replay.
- ``vllm`` (where ``import vllm`` works; else the emulated manager of ``kvbroker replay
  --engine vllm``, which the vllm-marked tests hold within 3% of the real one, with vLLM's
  lru as kvbroker's lru and without vLLM's arc, and a line says so): vLLM
  0.33's CPUOffloadingManager run as its scheduler runs it
  (tests/vllm_integration/decisions_to_vllm/manager_driver.py ``mooncake``: each request looks its chunks up
  until the first miss, loads the hits, stores the rest), with vLLM's ``lru`` and ``arc``
  and each kvbroker policy through the adapter. Hits: the chunks of that prefix.

Per (trace, size) a table: replay hits and ratio, vLLM hits and ratio; ``*`` marks the best
online figure of each column (kvbroker's and libCacheSim's in replay; everything run inside
vLLM in vLLM). Then the summary for ``--candidate``: at each cell its hits as a percentage
of the best online policy's, in replay and in vLLM, and the worst cell. ``--json OUT``
writes every figure. Tasks (one per trace, size and engine) run in ``--jobs`` processes (default 2), each in a
fresh one; ``--json`` is rewritten after each task, so a run stopped early keeps its figures.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import synthetic_prefix_traces as gen  # noqa: E402
from broker.config.settings import DEFAULT_POLICY  # noqa: E402
from policies import registry  # noqa: E402

TRACES = (
    "synthetic",
    "synthetic_first_half",
    "synthetic_second_half",
    "two_turn_chat",
    "zipf_docs_scan",
    "multi_turn_chat:1",
    "multi_turn_chat:2",
    "long_gap_chat:1",
    "long_gap_chat:2",
    "returning_chat",
)
SIZES = "0.02,0.05,0.15"
ENGINES = ("replay", "libcachesim", "vllm")
ONLINE = tuple(name for name in registry.names() if not registry.policy_class(name).offline)
UPPER_BOUND = "belady"
# libCacheSim's online algorithms (bench/libcachesim_compare.py's list without the offline
# Belady and BeladySize).
LIBCACHESIM = (
    "LRU,FIFO,ARC,S3FIFO,Sieve,Clock,LFU,LFUDA,TwoQ,SLRU,LRUK,MQ,LIRS,ClockPro,Clock2QPlus,"
    "WTinyLFU,LeCaR,Cacheus,LHD,Hyperbolic,GDSF,Random,Size,LRUProb,FlashProb,GLCache"
)
# vLLM's own policies at each of its admission settings (``@N``: store_threshold N, a chunk
# stored on its Nth offer): the baseline is vLLM's best setting, not its default.
VLLM_BUILTINS = tuple(f"{p}@{t}" if t > 1 else p for p in ("lru", "arc") for t in (1, 2, 3, 4))
CHUNK_TOKENS = 512


@dataclasses.dataclass(frozen=True)
class Task:
    """One unit of work: a trace at one size on one engine, for some policies."""

    trace: str
    path: str
    fraction: float
    chunks: int
    engine: str
    policies: tuple[str, ...]


def trace_lines(name: str, limit: int | None) -> list[str]:
    """The Mooncake JSONL lines of a trace (its first ``limit`` requests)."""
    base, _, seed = name.partition(":")
    if base == "synthetic":
        lines = [line for line in gen.SYNTHETIC_TRACE.read_text().splitlines() if line.strip()]
    elif base in ("synthetic_first_half", "synthetic_second_half"):
        lines = gen.synthetic_half(0 if base == "synthetic_first_half" else 1)
    elif base in gen.GENERATORS:
        lines = list(gen.mooncake_lines(gen.GENERATORS[base](int(seed) if seed else 1)))
    else:
        raise ValueError(f"--traces: unknown trace {name!r} (traces: {', '.join(TRACES)}; a generator takes :SEED)")
    return lines if limit is None else lines[:limit]


def requests_of(path: str) -> list[list[int]]:
    """The hash-id lists of a Mooncake file, in the order the importer replays them
    (timestamps, file order breaking ties)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r["hash_ids"] for r in sorted(rows, key=lambda r: r["timestamp"])]


def run_task(task: Task) -> list[dict[str, Any]]:
    """The rows of one task: one per policy (engine, source, policy, hits, asked, ratio, seconds)."""
    runners: dict[str, Callable[[Task], Iterable[tuple[str, str, int, int, float]]]] = {
        "replay": _replay,
        "libcachesim": _libcachesim,
        "vllm": _vllm,
    }
    rows = []
    for source, policy, hits, asked, seconds in runners[task.engine](task):
        rows.append(
            {
                "trace": task.trace,
                "fraction": task.fraction,
                "chunks": task.chunks,
                "engine": task.engine,
                "source": source,
                "policy": policy,
                "online": policy != UPPER_BOUND,
                "hits": hits,
                "asked": asked,
                "ratio": hits / asked if asked else 0.0,
                "seconds": round(seconds, 3),
            }
        )
    return rows


def _replay(task: Task) -> Iterable[tuple[str, str, int, int, float]]:
    from broker.replay.preread import preread
    from broker.replay.sweep import Job, Source, run_job, single_tier
    from broker.replay.traces import TraceOptions

    source = Source(trace=task.path, fmt="mooncake", options=TraceOptions(decode=False))
    data = preread(*source.batches())  # imported once, replayed by every policy (as a sweep's jobs)
    capacity = task.chunks * CHUNK_TOKENS * source.options.bytes_per_token
    for policy in task.policies:
        record = run_job(Job(source, policy, single_tier(capacity)), data=data)
        yield "kvbroker", policy, int(record["prefix_hits"]), int(record["prompt_blocks"]), float(record["seconds"])


def _libcachesim(task: Task) -> Iterable[tuple[str, str, int, int, float]]:
    from bench.libcachesim_compare import batches_of, libcachesim_hits
    from broker.replay.traces.sequence import block_sequence

    seq, _ = block_sequence(batches_of(task.path, "mooncake"))
    for algorithm in task.policies:
        started = time.perf_counter()
        hits = libcachesim_hits(algorithm, seq, task.chunks)
        yield "libCacheSim", algorithm, hits, len(seq), time.perf_counter() - started


def timed_requests_of(path: str) -> list[tuple[int, list[int]]]:
    """(timestamp in ms, hash ids) of a Mooncake file, in ``requests_of``'s order."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [(r["timestamp"], r["hash_ids"]) for r in sorted(rows, key=lambda r: r["timestamp"])]


def _vllm(task: Task) -> Iterable[tuple[str, str, int, int, float]]:
    """vLLM's manager: the real one where vLLM imports (kvbroker's adapter reading the
    trace's time, as replay does); else the emulated one of ``kvbroker replay --engine
    vllm`` (vllm_integration/manager_replay/engine.py, held within 3% of the real one by the vllm-marked
    tests), where vLLM's lru is kvbroker's lru (identical, store for store) and vLLM's arc
    is left out."""
    timed = timed_requests_of(task.path)
    if f"offline:{UPPER_BOUND}" in task.policies:
        from broker.replay.belady_prefix import belady_prefix_hits

        started = time.perf_counter()
        requests = [ids for _, ids in timed]
        hits = belady_prefix_hits(requests, task.chunks)
        yield "offline", UPPER_BOUND, hits, sum(map(len, requests)), time.perf_counter() - started
    task = dataclasses.replace(task, policies=tuple(p for p in task.policies if p != f"offline:{UPPER_BOUND}"))
    if vllm_available():
        from tests.vllm_integration.decisions_to_vllm.manager_driver import kvbroker_manager, mooncake, mooncake_at_trace_time, vllm_manager

        for name in task.policies:
            source, _, policy = name.partition(":")
            started = time.perf_counter()
            if source == "vllm":
                base, _, threshold = policy.partition("@")
                manager = vllm_manager(base, task.chunks, store_threshold=int(threshold or 0))
                hits, asked = mooncake(manager, [ids for _, ids in timed])
            else:
                hits, asked = mooncake_at_trace_time(kvbroker_manager(policy, task.chunks), timed)
            yield source, policy, hits, asked, time.perf_counter() - started
        return
    from vllm_integration.manager_replay.engine import replay_requests

    for name in task.policies:
        source, _, policy = name.partition(":")
        if source == "vllm" and policy != "lru":
            continue  # the emulated manager runs kvbroker's lru, which is vLLM's lru at no threshold
        started = time.perf_counter()
        result = replay_requests(timed, task.chunks, policy)
        yield source, policy, result.hits, result.asked, time.perf_counter() - started


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def plan(
    paths: dict[str, str], fractions: list[float], engines: list[str], policies: list[str], algorithms: list[str], belady: bool
) -> list[Task]:
    """The tasks: one per (trace, size, engine), vLLM's first (the slow ones), each engine's
    in the order of the traces given."""
    tasks = []
    for trace, path in paths.items():
        distinct = len({h for r in requests_of(path) for h in r})
        for fraction in fractions:
            here = (trace, path, fraction, max(1, int(fraction * distinct)))
            if "vllm" in engines:
                bound = (f"offline:{UPPER_BOUND}",) if belady else ()
                tasks.append(Task(*here, "vllm", (*(f"vllm:{p}" for p in VLLM_BUILTINS), *(f"kvbroker:{p}" for p in policies), *bound)))
            if "replay" in engines:
                tasks.append(Task(*here, "replay", (*policies, *([UPPER_BOUND] if belady else []))))
            if "libcachesim" in engines and algorithms:
                tasks.append(Task(*here, "libcachesim", tuple(algorithms)))
    order = {"vllm": 0, "replay": 1, "libcachesim": 2}
    return sorted(tasks, key=lambda t: order[t.engine])


def run_tasks(
    tasks: list[Task], jobs: int, log: Callable[[str], None], checkpoint: Callable[[list[dict[str, Any]]], None]
) -> list[dict[str, Any]]:
    """Every task's rows, ``jobs`` at a time, each task in a fresh process (spawned: vLLM's
    imports do not fork well; fresh: libCacheSim's randomized algorithms (Random, LRUProb,
    FlashProb, Cacheus, LHD, Hyperbolic) draw from one process-wide generator, so their
    figures would depend on what ran before them in the process). ``checkpoint`` gets the
    rows so far after each task."""
    rows: list[dict[str, Any]] = []
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context, max_tasks_per_child=1) as pool:
        futures = {pool.submit(run_task, task): task for task in tasks}
        for i, future in enumerate(concurrent.futures.as_completed(futures), start=1):
            task, got = futures[future], future.result()
            rows.extend(got)
            checkpoint(rows)
            seconds = sum(r["seconds"] for r in got)
            log(f"[{i}/{len(tasks)}] {task.engine} {task.trace} {task.chunks} chunks: {len(got)} policies, {seconds:.1f}s")
    return rows


def label(row: dict[str, Any]) -> str:
    return f"{row['source']}:{row['policy']}"


def cells(rows: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """The (trace, fraction) cells of the rows, in the order they first appear."""
    return list(dict.fromkeys((r["trace"], r["fraction"]) for r in rows))


def best_online(rows: list[dict[str, Any]], engine: str, sources: tuple[str, ...] | None = None) -> dict[str, Any] | None:
    online = [r for r in rows if r["engine"] == engine and r["online"] and (sources is None or r["source"] in sources)]
    return max(online, key=lambda r: r["hits"]) if online else None


def bound_of(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The offline bound's row among one engine's rows (Belady: replay's ``belady`` policy;
    in vLLM, broker/replay/belady_prefix.py through the same prefix lookups)."""
    return next((r for r in rows if r["policy"] == UPPER_BOUND), None)


def replay_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Replay's figures: kvbroker's replays and libCacheSim's runs of the same sequence."""
    return [dict(r, engine="replay") if r["engine"] == "libcachesim" else r for r in rows if r["engine"] in ("replay", "libcachesim")]


def table(rows: list[dict[str, Any]], trace: str, fraction: float) -> str:
    """One cell's table: policy, replay hits/ratio, vLLM hits/ratio; ``*`` on each column's
    best online figure."""
    here = [r for r in rows if r["trace"] == trace and r["fraction"] == fraction]
    replay = {label(r): r for r in replay_rows(here)}
    vllm = {label(r): r for r in here if r["engine"] == "vllm"}
    best_replay = best_online(list(replay.values()), "replay")
    best_vllm = best_online(list(vllm.values()), "vllm")
    chunks = here[0]["chunks"] if here else 0
    asked = next((r["asked"] for r in here), 0)
    lines = [
        f"{trace} at {fraction:g} of its distinct chunks: {chunks:,} chunks ({chunks * CHUNK_TOKENS:,} tokens), {asked:,} chunks asked"
    ]
    lines.append(f"  {'policy':<28} {'replay hits':>12} {'ratio':>7} {'Belady':>7}  {'vLLM hits':>12} {'ratio':>7} {'Belady':>7}")
    bounds = {engine: bound_of(list(pool.values())) for engine, pool in (("replay", replay), ("vllm", vllm))}

    def figure(r: dict[str, Any] | None, best: dict[str, Any] | None, bound: dict[str, Any] | None) -> str:
        if r is None:
            return f"{'-':>12} {'-':>7} {'-':>7}"
        mark = "*" if best is not None and r["online"] and r["hits"] == best["hits"] else " "
        share = f"{r['hits'] / bound['hits']:7.1%}" if bound is not None and bound["hits"] else f"{'-':>7}"
        return f"{r['hits']:>11,}{mark} {r['ratio']:7.4f} {share}"

    for name in dict.fromkeys([*vllm, *replay]):
        lines.append(
            f"  {name:<28} {figure(replay.get(name), best_replay, bounds['replay'])}  {figure(vllm.get(name), best_vllm, bounds['vllm'])}"
        )
    for what, best in (("replay", best_replay), ("vLLM", best_vllm)):
        if best is not None:
            lines.append(f"  best online in {what}: {label(best)} {best['hits']:,}")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]], candidate: str) -> list[dict[str, Any]]:
    """Per cell, the candidate's (kvbroker policy) hits as a share of the best online
    policy's: in replay (kvbroker's and libCacheSim's), and in vLLM (vLLM's own and
    kvbroker's through the adapter). None where a figure is missing."""
    out = []
    for trace, fraction in cells(rows):
        here = [r for r in rows if r["trace"] == trace and r["fraction"] == fraction]
        entry: dict[str, Any] = {"trace": trace, "fraction": fraction, "chunks": here[0]["chunks"]}
        for engine, pool in (("replay", replay_rows(here)), ("vllm", [r for r in here if r["engine"] == "vllm"])):
            mine = next((r for r in pool if r["source"] == "kvbroker" and r["policy"] == candidate), None)
            best = best_online(pool, engine)
            entry[f"{engine}_hits"] = None if mine is None else mine["hits"]
            entry[f"{engine}_best"] = None if best is None else label(best)
            entry[f"{engine}_best_hits"] = None if best is None else best["hits"]
            share = None
            if mine is not None and best is not None:
                share = mine["hits"] / best["hits"] if best["hits"] else 1.0
            entry[f"{engine}_share_of_best"] = share
            bound = bound_of(pool)
            entry[f"{engine}_share_of_belady"] = (
                None if mine is None or bound is None or not bound["hits"] else mine["hits"] / bound["hits"]
            )
        out.append(entry)
    return out


def summary_text(entries: list[dict[str, Any]], candidate: str) -> str:
    lines = [f"{candidate}'s hits as a % of the best online policy's (replay: kvbroker + libCacheSim; vLLM: vLLM's + kvbroker's)"]
    lines.append(
        f"  {'trace':<24} {'size':>6} {'chunks':>7}  {'replay':>7} {'best in replay':<26} {'vLLM':>7} {'best in vLLM':<26}"
        f" {'Belady (replay, vLLM)':>22}"
    )

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    for e in entries:
        lines.append(
            f"  {e['trace']:<24} {e['fraction']:>6g} {e['chunks']:>7}  {pct(e['replay_share_of_best']):>7} {e['replay_best'] or '-':<26}"
            f" {pct(e['vllm_share_of_best']):>7} {e['vllm_best'] or '-':<26}"
            f" {pct(e.get('replay_share_of_belady')):>10} {pct(e.get('vllm_share_of_belady')):>10}"
        )
    for engine in ("replay", "vllm"):
        measured = [e for e in entries if e[f"{engine}_share_of_best"] is not None]
        if measured:
            worst = min(measured, key=lambda e: e[f"{engine}_share_of_best"])
            lines.append(
                f"  worst cell in {engine}: {worst['trace']} at {worst['fraction']:g} ({worst['chunks']} chunks):"
                f" {pct(worst[f'{engine}_share_of_best'])} of {worst[f'{engine}_best']}"
            )
    return "\n".join(lines)


def matrix(
    traces: list[str],
    fractions: list[float],
    policies: list[str],
    *,
    engines: list[str] = list(ENGINES),  # noqa: B006 (never mutated)
    algorithms: list[str] | None = None,
    requests: int | None = None,
    jobs: int = 2,
    belady: bool = True,
    workdir: str | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Write the traces, run every task, and return every figure: ``traces`` (requests,
    chunks asked, distinct chunks each), ``rows`` (one per engine, trace, size, policy).
    ``checkpoint`` gets the figures so far after each task (``complete`` False)."""
    algorithms = LIBCACHESIM.split(",") if algorithms is None else algorithms
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        paths = {}
        info = {}
        for name in traces:
            path = Path(tmp) / (name.replace(":", "-") + ".jsonl")
            path.write_text("".join(line + "\n" for line in trace_lines(name, requests)))
            paths[name] = str(path)
            reqs = requests_of(str(path))
            info[name] = {"requests": len(reqs), "chunks_asked": sum(map(len, reqs)), "distinct_chunks": len({h for r in reqs for h in r})}
        tasks = plan(paths, fractions, engines, policies, algorithms, belady)

        def partial(rows: list[dict[str, Any]]) -> None:
            if checkpoint is not None:
                checkpoint({"traces": info, "fractions": fractions, "rows": rows, "complete": False})

        rows = run_tasks(tasks, jobs, log, partial)
    # Rows in a stable order whatever the order tasks finished in.
    trace_order = {t: i for i, t in enumerate(traces)}
    engine_order = {e: i for i, e in enumerate(ENGINES)}
    rows.sort(key=lambda r: (trace_order[r["trace"]], r["fraction"], engine_order[r["engine"]]))
    return {"traces": info, "fractions": fractions, "rows": rows, "complete": True}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=",".join(TRACES), help="traces (comma separated; a generator takes :SEED)")
    ap.add_argument("--sizes", default=SIZES, help="tier sizes as fractions of each trace's distinct chunks")
    ap.add_argument("--policies", default=",".join(ONLINE), help="kvbroker online policies (default: all)")
    ap.add_argument("--libcachesim", default=LIBCACHESIM, help="libCacheSim algorithms (class names; '' for none)")
    ap.add_argument("--engines", default=",".join(ENGINES), help="replay, libcachesim, vllm")
    ap.add_argument("--no-belady", action="store_true", help="do not replay belady (the upper bound)")
    ap.add_argument("--requests", type=int, default=None, help="the first N requests of each trace")
    ap.add_argument("--jobs", type=int, default=2, help="processes for the independent tasks")
    ap.add_argument("--candidate", default=DEFAULT_POLICY, help="the kvbroker policy the summary measures (default: the default policy)")
    ap.add_argument("--json", metavar="OUT", help="write every figure to this file")
    args = ap.parse_args(argv)

    def fail(message: str) -> int:
        print(f"policy_matrix: {message}", file=sys.stderr)
        return 2

    traces = [t for t in args.traces.split(",") if t]
    for t in traces:
        try:
            trace_lines(t, 0)
        except ValueError as exc:
            return fail(str(exc))
    try:
        fractions = [float(f) for f in args.sizes.split(",") if f]
    except ValueError:
        return fail(f"--sizes: expected fractions such as 0.02,0.05, got {args.sizes!r}")
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        return fail(f"--sizes: each fraction must be in (0, 1], got {args.sizes!r}")
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in registry.names():
            return fail(f"--policies: unknown policy {p!r} (policies: {', '.join(registry.names())})")
        if registry.policy_class(p).offline:
            return fail(f"--policies: {p} is offline (replay reports belady as the upper bound; --no-belady drops it)")
    engines = [e for e in args.engines.split(",") if e]
    for e in engines:
        if e not in ENGINES:
            return fail(f"--engines: unknown engine {e!r} (engines: {', '.join(ENGINES)})")
    if args.requests is not None and args.requests <= 0:
        return fail(f"--requests: must be > 0, got {args.requests}")
    if args.jobs <= 0:
        return fail(f"--jobs: must be > 0, got {args.jobs}")
    if "vllm" in engines and not vllm_available():
        print(
            "vLLM: not importable here: its columns come from the emulated manager of kvbroker replay --engine vllm"
            " (vLLM's lru is kvbroker's lru; vLLM's arc is left out). Run with a Python that has vLLM for the real one."
        )
    algorithms = [a for a in args.libcachesim.split(",") if a]

    def save(result: dict[str, Any]) -> None:
        if args.json:  # after each task too: a long run stopped early keeps what it measured
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")

    started = time.perf_counter()
    result = matrix(
        traces,
        fractions,
        policies,
        engines=engines,
        algorithms=algorithms,
        requests=args.requests,
        jobs=args.jobs,
        belady=not args.no_belady,
        checkpoint=save,
    )
    elapsed = time.perf_counter() - started
    rows = result["rows"]
    for name, info in result["traces"].items():
        print(f"{name}: {info['requests']:,} requests, {info['chunks_asked']:,} chunks asked, {info['distinct_chunks']:,} distinct")
    print()
    for trace, fraction in cells(rows):
        print(table(rows, trace, fraction))
        print()
    entries = summary(rows, args.candidate)
    print(summary_text(entries, args.candidate))
    per_engine = {e: sum(r["seconds"] for r in rows if r["engine"] == e) for e in ENGINES}
    busy = ", ".join(f"{e} {s:.0f}s" for e, s in per_engine.items() if s)
    print(f"\nelapsed {elapsed:.0f}s with {args.jobs} jobs (policy runs: {busy})")
    result.update(candidate=args.candidate, summary=entries, elapsed_s=round(elapsed, 1), jobs=args.jobs, engines=engines)
    save(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
