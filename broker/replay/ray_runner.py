"""A sweep's jobs as Ray tasks (``kvbroker replay --ray [ADDRESS]``), on one machine or many.

Ray schedules; this module only says what to run. Each source is read once: a Redis
journal by a task of its own (any node can reach Redis), a file journal or a trace by the
driver (its path is the driver's); either way into one object in Ray's object store, which
every node that runs a job of it fetches once. Each job is a task that replays from that
object (``broker.replay.sweep.run_job``) and returns its record; the records come back in
job order, the same records a local run gives (``seconds`` and ``events_per_s`` aside).

A task that fails (an exception, or its worker or node lost) is retried ``retries`` times
by Ray, then reported by its name (policy, parameters, capacities, source) with the cause;
the other jobs still finish. Ctrl-C cancels every task not yet done.

Ray is an optional extra, in a venv of its own (broker.extras): nothing here imports it until
a sweep runs on it.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from broker import extras
from broker.journal import JournalSource
from broker.journal.redis_urls import is_redis_url
from broker.replay.preread import SourceData, preread
from broker.replay.sweep import Job, Source, job_label, run_job


def install_hint() -> str:
    """--ray without Ray: the venv of its own that the [ray] extra goes into (broker.extras)."""
    return "--ray needs Ray (the [ray] extra); " + extras.install_hint("ray", then=".venv-ray/bin/kvbroker replay ... --ray")


# Attempts after the first of a failed task (Ray's max_retries; exceptions included).
RETRIES = 2


class RayMissing(RuntimeError):
    """Ray is not installed."""


@dataclasses.dataclass(frozen=True)
class JobFailure:
    index: int
    label: str
    cause: str


class SweepFailed(RuntimeError):
    """Some jobs failed after their retries; the message names each."""

    def __init__(self, failures: list[JobFailure], total: int, attempts: int) -> None:
        self.failures = failures
        lines = [f"job {f.index + 1}/{total} ({f.label}) failed after {attempts} attempts: {f.cause}" for f in failures]
        super().__init__(f"{len(failures)} of {total} jobs failed on Ray:\n  " + "\n  ".join(lines))


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayMissing(install_hint()) from None
    return ray


def _read(source: Source, directives: bool) -> SourceData:
    """A source read once (in a task for a Redis journal, else in the driver)."""
    batches, skips = source.batches()
    expected = JournalSource(source.journal, source.stream).directives() if directives and source.journal is not None else None
    return preread(batches, skips, expected)


def _run(job: Job, data: SourceData) -> dict[str, Any]:
    return run_job(job, data=data)


def _base(source: Source) -> Source:
    """The source as read: stripping the intent is the replay's business, not the reader's."""
    return dataclasses.replace(source, ablate_intent=False)


def run_jobs_on_ray(
    jobs: list[Job],
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    retries: int = RETRIES,
    log: Callable[[str], None] | None = None,
    poll_s: float = 1.0,
) -> list[dict[str, Any]]:
    """Run ``jobs`` as Ray tasks; records in job order. ``address``: as ``ray.init`` takes
    it (None: a local Ray for this run, or the cluster RAY_ADDRESS names); ``num_cpus``:
    the local Ray's CPUs. Raises SweepFailed naming the jobs that failed after ``retries``
    retries; on KeyboardInterrupt cancels the tasks still running and re-raises."""
    ray = import_ray()
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    started_here = not ray.is_initialized()
    if started_here:
        options: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
        if address is None and num_cpus:
            options["num_cpus"] = num_cpus
        ray.init(address=address, **options)
    try:
        return _run_all(ray, jobs, retries, log, poll_s)
    finally:
        if started_here:
            ray.shutdown()


def _run_all(ray: Any, jobs: list[Job], retries: int, log: Callable[[str], None], poll_s: float) -> list[dict[str, Any]]:
    task = {"max_retries": retries, "retry_exceptions": True, "num_cpus": 1}
    read_task = ray.remote(**task)(_read)
    run_task = ray.remote(**task)(_run)
    started = time.perf_counter()
    data: dict[Source, Any] = {}
    for job in jobs:
        base = _base(job.source)
        if base in data:
            continue
        verifies = any(j.verify and _base(j.source) == base for j in jobs)
        if base.journal is not None and is_redis_url(base.journal):
            data[base] = read_task.remote(base, verifies)
        else:
            data[base] = ray.put(_read(base, verifies))
    refs = [run_task.remote(job, data[_base(job.source)]) for job in jobs]
    index = {ref: i for i, ref in enumerate(refs)}
    records: list[dict[str, Any] | None] = [None] * len(jobs)
    failures: list[JobFailure] = []
    pending = list(refs)
    events = done = 0
    log(f"ray: {len(jobs)} jobs over {len(data)} source(s) on {ray.cluster_resources().get('CPU', 0):g} CPUs")
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=poll_s)
            for ref in ready:
                i = index[ref]
                done += 1
                try:
                    record = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    cause = getattr(exc, "cause", None) or exc
                    failures.append(JobFailure(i, job_label(jobs[i]), f"{type(cause).__name__}: {cause}"))
                    log(f"[{done}/{len(jobs)}] {job_label(jobs[i])} FAILED: {type(cause).__name__}: {cause}")
                    continue
                records[i] = record
                events += record["events"]
                elapsed = time.perf_counter() - started
                log(
                    f"[{done}/{len(jobs)}] {job_label(jobs[i])} done in {record['seconds']:.1f}s; "
                    f"{events:,} events, {events / max(elapsed, 1e-9):,.0f} events/s overall"
                )
    except KeyboardInterrupt:
        for ref in pending:
            ray.cancel(ref, force=True)
        log(f"ray: interrupted: cancelled {len(pending)} task(s) not yet done")
        raise
    if failures:
        raise SweepFailed(sorted(failures, key=lambda f: f.index), len(jobs), retries + 1)
    return [r for r in records if r is not None]
