"""`kvbroker bench`: events per second, batch round trips, CPU and memory of a real broker.

For each configuration (batch size x streams x journal) the bench starts a broker as a
`kvbroker serve` process on a free loopback port (policy deadline_edf unless ``--policy``;
journal none, a file in a temporary directory, or a fresh Redis stream deleted afterwards)
and drives it from separate load-generator processes, one per stream (broker.bench.load),
with an engine's event mix (broker.bench.workload) encoded before anything is timed:

1. unpaced, with a window of batches in flight per stream: the maximum rate (events/s),
   the broker's CPU time per event (/proc/PID/stat) and its peak RSS (VmHWM);
2. paced at 50% and then 90% of that rate: the batch round trip p50/p99/p99.9, each batch
   timed from its write to its answer.

The echo server (broker.bench.echo: the same Stream method and messages, nothing behind it)
runs the same batches unpaced in the same invocation; ``ratio_to_echo`` is the broker's rate
over the echo's. After each run every stream sends one ``cleared`` batch, and the broker's
GetStats must count exactly the events the streams sent (``broker_events`` against
``events_sent``). With ``--target`` the running broker is driven instead (no CPU or RSS,
journal as its GetStats says). Event time restarts at 0 with every run; the broker's clock
only moves forward (clients' clocks may interleave), so later runs see some deadlines as due.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
import time
import uuid
from array import array
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from typing import Any

from broker.bench.load import RunResult, RunSpec
from broker.bench.procs import BenchError, Server, Workers, broker_argv, cpu_seconds, echo_argv, peak_rss_bytes
from broker.bench.report import format_table
from broker.bench.targets import MEMORY_POLICIES, full_path_lines, memory_lines, render
from broker.bench.workload import BENCH_TIERS, run_tag

JOURNALS = ("none", "file", "redis")
PACED = (50, 90)  # percent of the maximum rate


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    target: str | None = None
    events: int = 400_000  # per run, over all streams
    seconds: float = 5.0  # per run
    batches: tuple[int, ...] = (1, 64, 256)
    streams: tuple[int, ...] = (1, 4)
    journals: tuple[str, ...] = JOURNALS
    policy: str = "deadline_edf"
    redis_url: str = "redis://127.0.0.1:6379/0"
    window: int = 0  # batches in flight per stream; 0 = by batch size
    seed: int = 1
    # Finished requests release their blocks (cached) instead of freeing them (bench_workload).
    prefix_cache: bool = False
    echo: bool = True

    @staticmethod
    def quick(**changes: Any) -> BenchOptions:
        """About a minute: batches 64 and 256 on four streams, each journal (the targets name
        the file and Redis journals), 1 s runs."""
        base = BenchOptions(events=60_000, seconds=1.0, batches=(64, 256), streams=(4,), journals=JOURNALS)
        return dataclasses.replace(base, **changes)


def window_for(batch: int, window: int = 0) -> int:
    """Batches unanswered per stream: enough events in flight that the server, not the
    round trip, bounds the rate."""
    return window or max(4, min(64, 2048 // batch))


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of sorted values; NaN when empty."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


@dataclasses.dataclass
class Measured:
    events: int
    seconds: float
    rtts: list[float]  # sorted, seconds
    sent_total: int  # events, cleanup batches included
    cpu_s: float | None = None

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else 0.0

    def ms(self, q: float) -> float | None:
        return round(percentile(self.rtts, q) * 1000, 3) if self.rtts else None


def measure(
    workers: Workers, target: str, batch: int, streams: int, rate: float, opts: BenchOptions, nonce: str, run: int, pid: int | None
) -> Measured:
    """One run: ``streams`` streams of ``batch``-event batches, unpaced (rate 0) or paced at
    ``rate`` events/s in total."""
    specs = [
        RunSpec(
            target=target,
            client_id=f"bench-{nonce}-{run}-c{i}",
            tag=run_tag(nonce, run),
            batch=batch,
            events=max(batch, opts.events // streams),
            seconds=opts.seconds,
            window=window_for(batch, opts.window),
            rate=rate / streams,
            phase=i / streams,
        )
        for i in range(streams)
    ]
    cpu: list[float] = []

    def sample() -> None:
        if pid is not None:
            cpu.append(cpu_seconds(pid))

    results: list[RunResult] = workers.run(specs, on_go=sample, on_timed=sample)
    rtts: list[float] = []
    for r in results:
        rtts.extend(array("d", r.rtts))
    rtts.sort()
    events = sum(r.events for r in results)
    seconds = max(r.finished for r in results) - min(r.started for r in results)
    sent = events + sum(r.cleanup_events for r in results)
    cpu_s = cpu[1] - cpu[0] if len(cpu) == 2 else None
    return Measured(events, seconds, rtts, sent, cpu_s)


def _stats_total(target: str) -> tuple[int, int, int, str]:
    """(events counted, directives, rejected events, journal description) from GetStats."""
    import grpc

    from clients.admin import get_stats

    try:
        s = get_stats(target, timeout=10.0)
    except grpc.RpcError as exc:
        raise BenchError(f"cannot reach {target}: {exc.code().name}: {exc.details()}") from None
    return sum(s.events.values()), sum(s.directives.values()), s.rejected_events, s.journal


def journal_kind(description: str) -> str:
    if description == "none":
        return "none"
    return "file" if description.startswith("file://") else "redis"


class Brokers:
    """Starts a fresh broker per configuration and cleans up its journal."""

    def __init__(self, stack: ExitStack, opts: BenchOptions, nonce: str) -> None:
        self.opts = opts
        self.nonce = nonce
        self.dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvbroker-bench-"))
        self.redis_keys: list[str] = []
        stack.callback(self._delete_redis_keys)
        self.count = 0

    @contextmanager
    def start(self, journal: str) -> Iterator[Server]:
        self.count += 1
        name = f"bench-{self.nonce}-{self.count}"
        config_path = os.path.join(self.dir, f"{name}.toml")
        with open(config_path, "w", encoding="utf-8") as f:
            f.write(f'[broker]\nid = "{name}"\n\n[policy]\nname = "{self.opts.policy}"\n\n{BENCH_TIERS}')
        if journal == "none":
            url = "none"
        elif journal == "file":
            url = f"file://{os.path.join(self.dir, name + '.journal')}"
        else:
            key = f"kvbroker-bench:{name}"
            self.redis_keys.append(key)
            url = f"{self.opts.redis_url}{'&' if '?' in self.opts.redis_url else '?'}stream={key}"
        server = Server(broker_argv(config_path, url), os.path.join(self.dir, f"{name}.log"), f"broker ({journal} journal)")
        try:
            yield server
        finally:
            server.stop()
            if journal == "file":
                with_suppress_remove(url[len("file://") :])

    def _delete_redis_keys(self) -> None:
        if not self.redis_keys:
            return
        import redis

        client = redis.Redis.from_url(self.opts.redis_url, socket_timeout=5)
        try:
            client.delete(*self.redis_keys, *(f"{k}:directives" for k in self.redis_keys))
        finally:
            client.close()


def with_suppress_remove(path: str) -> None:
    with suppress(OSError):
        os.remove(path)


def redis_reachable(url: str) -> str | None:
    """None when Redis answers, else why not."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
        return None
    except redis.RedisError as exc:
        return str(exc)
    finally:
        client.close()


def needs(opts: BenchOptions) -> list[int]:
    """Events each load generator encodes: client i serves every stream count above i."""
    top = max(opts.streams)
    return [max(max(b, opts.events // s) for s in opts.streams for b in opts.batches if s > i) for i in range(top)]


def run_bench(
    opts: BenchOptions, log: Callable[[str], None] = lambda _m: None, on_record: Callable[[dict[str, Any]], None] = lambda _r: None
) -> list[dict[str, Any]]:
    """Every configuration's record (see README: `kvbroker bench --json`), each also handed
    to ``on_record`` as soon as it is measured."""
    nonce = uuid.uuid4().hex[:8]
    records: list[dict[str, Any]] = []
    journals = list(opts.journals)
    if opts.target is None and "redis" in journals:
        why = redis_reachable(opts.redis_url)
        if why is not None:
            log(f"redis journal skipped: {opts.redis_url} does not answer ({why})")
            journals.remove("redis")
    if opts.target is not None:
        _stats_total(opts.target)  # reachable, before seconds of encoding
    run = 0
    with ExitStack() as stack:
        log(f"encoding the workload in {max(opts.streams)} load generator process(es) ...")
        workers = Workers(needs(opts), opts.seed, opts.prefix_cache)
        stack.callback(workers.stop)
        mix = workers.info[0]["mix"]
        total = sum(mix.values())
        ids_per_event = round(workers.info[0]["block_ids_per_event"], 2)
        log(
            "event mix: "
            + ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(mix.items(), key=lambda kv: -kv[1]))
            + f"; {ids_per_event} block ids per event"
            + ("; finished requests release their blocks (--prefix-cache)" if opts.prefix_cache else "")
        )
        echo: Server | None = None
        if opts.echo:
            echo = Server(
                echo_argv(),
                os.path.join(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvbroker-echo-")), "echo.log"),
                "echo server",
            )
            stack.callback(echo.stop)
        brokers = Brokers(stack, opts, nonce) if opts.target is None else None
        for streams in opts.streams:
            for batch in opts.batches:
                ceiling: Measured | None = None
                if echo is not None:
                    run += 1
                    ceiling = measure(workers, echo.target, batch, streams, 0.0, opts, nonce, run, echo.pid)
                    log(f"batch {batch:>3} streams {streams}: echo {ceiling.rate:>10,.0f} events/s")
                for journal in journals if opts.target is None else ["target"]:
                    with ExitStack() as one:
                        if brokers is not None:
                            server = one.enter_context(brokers.start(journal))
                            target, pid = server.target, server.pid
                        else:
                            assert opts.target is not None
                            target, pid = opts.target, None
                        before = _stats_total(target)
                        if journal == "target":
                            journal = journal_kind(before[3])
                        run += 1
                        top = measure(workers, target, batch, streams, 0.0, opts, nonce, run, pid)
                        middle = _stats_total(target)
                        paced: dict[int, Measured] = {}
                        for percent in PACED:
                            run += 1
                            paced[percent] = measure(workers, target, batch, streams, top.rate * percent / 100, opts, nonce, run, None)
                        after = _stats_total(target)
                        rss = peak_rss_bytes(pid) if pid is not None else None
                    floor: Measured | None = None
                    if echo is not None:
                        # The echo server paced at the broker's 50% rate: the round trip of the
                        # transport, the load generators and this machine alone, so that the
                        # broker's p99 can be read against it (on 2 shared cores it is not 0).
                        run += 1
                        floor = measure(workers, echo.target, batch, streams, top.rate * 0.5, opts, nonce, run, None)
                    record = _record(batch, streams, journal, opts, top, paced, ceiling, before, middle, after, rss, floor)
                    record["block_ids_per_event"] = ids_per_event
                    records.append(record)
                    on_record(record)
                    log(
                        f"batch {batch:>3} streams {streams} journal {journal:<5}: {record['events_per_s']:>10,.0f} events/s, "
                        f"p99 {record['p99_ms']} ms at 50%, ratio {record['ratio_to_echo']}"
                    )
    return records


def _record(
    batch: int,
    streams: int,
    journal: str,
    opts: BenchOptions,
    top: Measured,
    paced: dict[int, Measured],
    ceiling: Measured | None,
    before: tuple[int, int, int, str],
    middle: tuple[int, int, int, str],
    after: tuple[int, int, int, str],
    rss: int | None,
    floor: Measured | None = None,
) -> dict[str, Any]:
    half, most = paced[50], paced[90]
    return {
        "kind": "throughput",
        "batch": batch,
        "streams": streams,
        "journal": journal,
        "policy": opts.policy,
        "target": opts.target or "spawned",
        "prefix_cache": opts.prefix_cache,
        "events": top.events,
        "seconds": round(top.seconds, 3),
        "events_per_s": round(top.rate, 1),
        "p50_ms": half.ms(50),
        "p99_ms": half.ms(99),
        "p999_ms": half.ms(99.9),
        "events_per_s_at_50": round(half.rate, 1),
        "p50_ms_at_90": most.ms(50),
        "p99_ms_at_90": most.ms(99),
        "p999_ms_at_90": most.ms(99.9),
        "events_per_s_at_90": round(most.rate, 1),
        "p50_ms_unpaced": top.ms(50),
        "p99_ms_unpaced": top.ms(99),
        "cpu_us_per_event": round(top.cpu_s / top.events * 1e6, 3) if top.cpu_s is not None and top.events else None,
        "peak_rss_bytes": rss,
        "echo_events_per_s": round(ceiling.rate, 1) if ceiling is not None else None,
        "echo_cpu_us_per_event": round(ceiling.cpu_s / ceiling.events * 1e6, 3)
        if ceiling and ceiling.cpu_s is not None and ceiling.events
        else None,
        "ratio_to_echo": round(top.rate / ceiling.rate, 4) if ceiling is not None and ceiling.rate else None,
        "echo_p50_ms_at_50": floor.ms(50) if floor is not None else None,
        "echo_p99_ms_at_50": floor.ms(99) if floor is not None else None,
        "directives": middle[1] - before[1],
        "events_sent": top.sent_total + half.sent_total + most.sent_total,
        "broker_events": after[0] - before[0],
        "rejected_events": after[2] - before[2],
        "load_1m": round(os.getloadavg()[0], 2),  # the machine's load average when measured
    }


def main(
    opts: BenchOptions,
    *,
    as_json: bool,
    memory_blocks: tuple[int, ...] = (),
    memory_policies: tuple[str, ...] = MEMORY_POLICIES,
    quick: bool = False,
) -> int:
    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.monotonic()
    load = os.getloadavg()
    log(f"kvbroker bench: policy {opts.policy}, {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")

    def emit(record: dict[str, Any]) -> None:
        if as_json:
            print(json.dumps(record), flush=True)

    try:
        records = run_bench(opts, log, emit)
    except BenchError as exc:
        print(f"kvbroker bench: {exc}", file=sys.stderr)
        return 2
    memory: list[dict[str, Any]] = []
    if memory_blocks:
        from broker.bench.memory import measure_blocks

        for policy in memory_policies:
            for blocks in memory_blocks:
                try:
                    memory.append(measure_blocks(blocks, policy))
                except (RuntimeError, ValueError) as exc:
                    print(f"kvbroker bench: memory: {exc}", file=sys.stderr)
                    return 2
                log(f"memory: {policy}: {blocks:,} blocks: {memory[-1]['rss_bytes_per_block']:.0f} bytes of RSS per block")
    if as_json:
        for record in memory:
            print(json.dumps(record), flush=True)
        return 0
    if records:
        print(format_table(records))
        print()
        print(render("full path (gRPC + core + journal) against the echo ceiling, same run", full_path_lines(records), quick=quick))
    for m in memory:
        print(
            f"\nmemory: {m['blocks']:,} tracked blocks: {m['rss_bytes_per_block']:.0f} bytes of RSS per block ({m['policy']}); "
            f"a full garbage collection {m['gc_full_ms']:.0f} ms",
            end="",
        )
    if memory:
        print("\n")
        print(render("memory", memory_lines(memory, memory_policies), quick=quick))
    log(f"done in {time.monotonic() - started:.0f}s; load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0
