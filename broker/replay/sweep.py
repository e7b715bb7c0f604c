"""Replay jobs: (source, policy, capacities) -> one record; run serially or in processes.

A source is a journal (file or Redis) or a trace file with its importer. Each job builds
its batches in its own process, so policies run in parallel without shipping events
between processes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from broker.config import SIZE_RE, SIZE_UNITS, ConfigError, CoreConfig, TierConfig
from broker.journal import JournalSource
from broker.journal.redis_stream import redact
from broker.journal.redis_urls import is_redis_url, sync_client
from broker.replay.preread import SourceData
from broker.replay.progress import SweepProgress, count_into, events_in
from broker.replay.replay import BatchSource, capacity_text, journal_batches, replay
from broker.replay.traces import SkipCounter, TraceOptions, count_events, read_trace
from policies.base import PolicyError
from policies.registry import make_params, policy_class


def parse_capacity(text: str, bytes_per_token: int, flag: str) -> int:
    """Bytes from "16GiB", "4096", or "1000000tok" (tokens x bytes per token)."""
    m = SIZE_RE.match(text)
    if not m or m.group(1).startswith("-"):
        raise ConfigError(f"{flag}: expected a size such as 4GiB or 1000000tok, got {text!r}")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit in ("tok", "tokens"):
        return int(number) * bytes_per_token
    if unit not in SIZE_UNITS:
        raise ConfigError(f"{flag}: unknown unit {m.group(2)!r} in {text!r} (bytes units, or tok)")
    return int(number * SIZE_UNITS[unit])


@dataclasses.dataclass(frozen=True)
class Source:
    """Where the batches come from; picklable, so a worker process can open it itself."""

    journal: str | None = None
    stream: str | None = None
    trace: str | None = None
    fmt: str | None = None
    options: TraceOptions = dataclasses.field(default_factory=TraceOptions)
    # Replay with the engine's intent stripped (phase, priority, deadline): --ablate-intent.
    ablate_intent: bool = False
    # --engine: "" replays the trace's events as imported; else a Mooncake trace's requests
    # run through an engine (broker.replay.engines: "vllm", vLLM's CPU offload manager alone;
    # "vllm-scheduler", vLLM's scheduler with its GPU cache in front).
    engine: str = ""

    def batches(self) -> tuple[BatchSource, SkipCounter]:
        skips = SkipCounter(self.options.skip_bad)
        if self.journal is not None:
            return journal_batches(JournalSource(self.journal, self.stream)), skips
        assert self.trace is not None and self.fmt is not None
        trace, fmt, options = self.trace, self.fmt, self.options

        def source() -> Any:
            skips.skipped = 0
            return ((1, batch) for batch in read_trace(trace, fmt, options, skips))

        return source, skips

    @property
    def label(self) -> str:
        """The source as records name it (``source``): the journal URL without its password
        (with its stream when given apart), or the trace's path."""
        if self.journal is not None:
            url = redact(self.journal)
            return f"{url}{'&' if '?' in url else '?'}stream={self.stream}" if self.stream else url
        return str(self.trace)


@dataclasses.dataclass(frozen=True)
class Job:
    source: Source
    policy: str
    config: CoreConfig
    verify: bool = False
    # Policy parameters of this job (--param); None: the config's, for the configured policy.
    params: dict[str, Any] | None = None
    # The point of the sweep grid (capacities) this job is at: a fleet's total row adds up
    # the jobs of every source at one point (broker.replay.fleet).
    combo: int = 0

    def effective_params(self) -> dict[str, Any] | None:
        """Every parameter of the policy as it runs (defaults filled in); None for a label
        that is no policy (a split journal's arms, followed as journaled)."""
        values = self.params
        if values is None:
            values = dict(self.config.policy.params) if self.policy == self.config.policy.name else {}
        try:
            return dataclasses.asdict(make_params(policy_class(self.policy), values))
        except PolicyError:
            return None


def with_capacities(config: CoreConfig, capacities: dict[str, int]) -> CoreConfig:
    """The config with some tiers' capacities replaced (tier name -> bytes)."""
    unknown = set(capacities) - {t.name for t in config.tiers}
    if unknown:
        raise ConfigError(f"no tier named {', '.join(sorted(unknown))} in the config (tiers: {', '.join(t.name for t in config.tiers)})")
    tiers = tuple(dataclasses.replace(t, capacity_bytes=capacities.get(t.name, t.capacity_bytes)) for t in config.tiers)
    return dataclasses.replace(config, tiers=tiers)


def single_tier(capacity: int) -> CoreConfig:
    """One cache tier that evicts exactly when full: the prefix-cache study setup."""
    return CoreConfig(tiers=(TierConfig("hbm", capacity, 0.0, 2000.0, high_watermark=1.0, low_watermark=1.0),))


def run_job(job: Job, progress: bool = False, data: SourceData | None = None) -> dict[str, Any]:
    """Replay one job; the flat record of ``ReplayResult.as_record`` plus capacities.
    ``data``: the source already read (broker.replay.preread), instead of reading it here."""
    if job.source.engine:
        from broker.replay import engines

        result, skipped = engines.load(job.source.engine)(job.source, job.config, job.policy, job.params)
    else:
        batches, skips = job.source.batches() if data is None else (data.batches(), SkipCounter())
        expected = None
        if job.verify and job.source.journal is not None:
            expected = JournalSource(job.source.journal, job.source.stream).directives() if data is None else data.directives()
        # Verification follows the journal exactly (its policy and config changes as applied).
        policy = None if expected is not None else job.policy
        total: tuple[int | None, int | None] = (None, None)
        if progress:
            total = count_journal(job.source) if data is None else (data.batch_count, data.event_count)
        result = replay(
            batches,
            job.config,
            policy,
            job.params,
            expected=expected,
            progress=progress,
            total_batches=total[0],
            total_events=total[1],
            ablate_intent=job.source.ablate_intent,
        )
        skipped = skips.skipped if data is None else data.skipped_lines
    record = result.as_record()
    record.update(result.metrics.get("engine_record", {}))
    record["source"] = job.source.label
    record["params"] = job.effective_params()
    record["capacity_bytes"] = {t.name: t.capacity_bytes for t in job.config.tiers}
    bpt = job.source.options.bytes_per_token
    record["capacity_tokens"] = {t.name: t.capacity_bytes // bpt for t in job.config.tiers} if job.source.journal is None else None
    record["capacity_chunks"] = chunk_capacities(job)
    record["skipped_lines"] = skipped
    record["engine"] = job.source.engine or None
    record["intent"] = "stripped" if job.source.ablate_intent else "full"
    record["seconds"] = result.seconds
    if result.first_mismatch:
        record["first_mismatch"] = result.first_mismatch
    return record


# Mooncake's hash ids name 512-token blocks: one chunk of vLLM's CPU tier each (--engine vllm).
ENGINE_CHUNK_TOKENS = 512


def chunk_capacities(job: Job) -> dict[str, int] | None:
    """Tier name -> capacity in chunks, where the unit is vLLM's CPU tier's chunk: with
    ``--engine vllm`` (a chunk of 512 tokens), and for a journal that kvbroker's policy
    wrote inside vLLM (its one tier of one-byte chunks, vllm_integration's core_config):
    there 1,953 chunks read as ``cpu=1.91KiB``. None elsewhere."""
    if job.source.engine:
        chunk_bytes = ENGINE_CHUNK_TOKENS * job.source.options.bytes_per_token
        return {t.name: t.capacity_bytes // chunk_bytes for t in job.config.tiers}
    from broker.replay.engines import VLLM_CPU_TIER_CHECK, by_path

    if job.source.journal is not None and by_path(VLLM_CPU_TIER_CHECK)(job.config):
        return {t.name: t.capacity_bytes for t in job.config.tiers}
    return None


def count_journal(source: Source) -> tuple[int | None, int | None]:
    """(batches, events) a journal holds: the progress bar's 100%. A file's are counted
    (1.0 s for the 729k events of the Mooncake trace imported, read and counted); a Redis stream's batches are its
    length (its few config records included: an estimate) and its events unknown (None:
    the bar then follows batches). A trace's events where its format can count them
    without importing (broker.replay.traces.count_events: Mooncake), its batches unknown."""
    if source.journal is None:
        if source.engine or source.trace is None or source.fmt is None:
            return None, None
        return None, count_events(source.trace, source.fmt, source.options)
    if is_redis_url(source.journal):
        from broker.journal import split_redis_url

        conn, key = split_redis_url(source.journal)
        client = sync_client(conn, socket_timeout=10)
        try:
            return int(client.xlen(key or source.stream or "")), None
        finally:
            client.close()
    from broker.journal import file_path
    from broker.journal.file import read_file_journal
    from broker.journal.records import RecordKind

    batches = events = 0
    for record in read_file_journal(file_path(source.journal)):
        if record.kind == RecordKind.BATCH:
            batches += 1
            events += events_in(record.payload)
    return batches, events


def run_jobs(jobs: list[Job], workers: int, log: Callable[[str], None] | None = None, progress: bool | None = None) -> list[dict[str, Any]]:
    """Run jobs, in processes when ``workers`` > 1; records come back in job order.
    ``progress`` (default: stderr is a terminal): run one by one, a bar per job; in
    processes, the sweep's overall progress (broker.replay.progress: a bar on a terminal,
    plain lines elsewhere). Without it, a line as each job ends."""
    log = log or (lambda line: print(line, file=sys.stderr))
    if progress is None:
        progress = sys.stderr.isatty()
    if workers <= 1 or len(jobs) <= 1:
        records: list[dict[str, Any]] = []
        # The whole loop: a ^C between two jobs (while the line of the one that ended is
        # written) keeps the rows as one inside a job does.
        try:
            for i, job in enumerate(jobs, start=1):
                started = time.perf_counter()
                records.append(run_job(job, progress=progress))
                log(f"[{i}/{len(jobs)}] {job_label(job)} done in {time.perf_counter() - started:.1f}s")
        except KeyboardInterrupt:
            raise SweepInterrupted(records, len(jobs)) from None
        return records
    context = multiprocessing.get_context("spawn")
    counter = context.Value("q", 0)  # events replayed by every worker so far
    overall = SweepProgress([job.source.label for job in jobs], known=_known_events(jobs)) if progress else None
    out: list[dict[str, Any] | None] = [None] * len(jobs)
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_worker_start, initargs=(counter,))
    try:
        futures = {pool.submit(run_job, job): i for i, job in enumerate(jobs)}
        pending = set(futures)
        done = 0
        while pending:
            finished, pending = concurrent.futures.wait(pending, timeout=0.5, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                i = futures[future]
                out[i] = record = future.result()  # a job's error (bad trace line) is raised here
                done += 1
                if overall is not None:
                    overall.job_done(i, record, counter.value, job_label(jobs[i]))
                else:
                    log(f"[{done}/{len(jobs)}] {job_label(jobs[i])} done in {record['seconds']:.1f}s")
            if overall is not None:
                overall.update(counter.value)
    except KeyboardInterrupt:
        # ^C: the jobs that ended are kept (a 17-minute job's row was thrown away before).
        _stop_workers(pool)
        raise SweepInterrupted([r for r in out if r is not None], len(jobs)) from None
    except BaseException:
        # One job failed: the error is the answer; no worker may outlive this call
        # (one still starting when the parent returned failed to open the shared counter's
        # semaphore, unlinked with it, and printed a traceback under the one-line error).
        _stop_workers(pool)
        raise
    finally:
        if overall is not None:
            overall.close()
        pool.shutdown(wait=True)
    return [r for r in out if r is not None]


def _known_events(jobs: list[Job]) -> dict[str, int]:
    """Events of one job of each source, where they are known before it runs: the sweep's
    share done and time left from its start, not once a job of each source has ended."""
    known = {}
    for source in {job.source.label: job.source for job in jobs}.values():
        try:
            events = count_journal(source)[1]
        except Exception:  # progress only: a source not counted here is known once a job ends (its job says any error)
            continue
        if events:
            known[source.label] = events
    return known


def _worker_start(counter: Any) -> None:
    """A sweep worker's initializer. ^C at a terminal reaches the whole process group, the
    workers too: the parent answers it (the finished rows, then it stops the workers), so a
    worker ignores SIGINT. Else a worker idle in the executor's queue printed its own
    KeyboardInterrupt traceback under the parent's one line (seen with --jobs 2)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    count_into(counter)


class SweepInterrupted(Exception):
    """^C during a sweep: ``records``, the jobs that had ended (in job order), of ``jobs``."""

    def __init__(self, records: list[dict[str, Any]], jobs: int) -> None:
        super().__init__(f"interrupted: {len(records)} of {jobs} jobs had ended")
        self.records = records
        self.jobs = jobs


# How long a failed sweep waits for its stopped workers (and the executor's thread) to end.
STOP_S = 10.0


def _stop_workers(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Drop the jobs not started, stop the workers and wait until each has ended and is
    reaped. Python 3.11's executor can neither stop its workers nor wait for them after a
    shutdown(wait=False), hence its _processes and _executor_manager_thread
    (ProcessPoolExecutor.terminate_workers is 3.14's). With spawn every worker is started
    in submit(), on this thread, so the snapshot holds them all (the executor's thread
    starts one only to replace a worker that exited under max_tasks_per_child, unused).

    Once they are stopped, the executor's thread reaps them (it sees the pool broken and
    joins every worker): wait for that thread, then join. Joining beside it raced it: two
    threads waiting for one child, the loser's waitpid gets ECHILD, which multiprocessing
    reads as "still running", so its join returned with the worker still listed as a child
    (multiprocessing.active_children) until the other thread recorded the exit code;
    seen under load, 1 run in 20 (tests/broker/replay/test_sweep_processes.py)."""
    workers = list((pool._processes or {}).values())
    # Read before shutdown() forgets it (typeshed's type for it is wrong: it is the thread).
    manager: threading.Thread | None = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    for process in workers:
        process.terminate()
    if manager is not None:
        manager.join(STOP_S)
    for process in workers:
        process.join(STOP_S)  # reaped by the executor's thread: this drops it from the children


def job_label(job: Job) -> str:
    """A job as a person names it: policy, parameters, capacities, source."""
    params = "(" + ", ".join(f"{k}={v}" for k, v in job.params.items()) + ")" if job.params else ""
    return f"{job.policy}{params} {_caps(job)} on {job.source.label}"


def _caps(job: Job) -> str:
    """The capacities as the table names them (broker.replay.replay.capacity_text): in
    tokens for a trace, whose sizes are given in tokens, in bytes for a journal."""
    suffix = " (intent stripped)" if job.source.ablate_intent else ""
    chunks = chunk_capacities(job)
    if chunks is not None:
        return " ".join(f"{name}={n:,} chunks" for name, n in chunks.items()) + suffix
    per_token = job.source.options.bytes_per_token if job.source.journal is None else None
    return " ".join(f"{t.name}={capacity_text(t.capacity_bytes, per_token)}" for t in job.config.tiers) + suffix
