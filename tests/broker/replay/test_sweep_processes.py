"""The process sweep (``run_jobs`` with workers > 1): a job's error is the answer, and no
worker outlives it (a worker left starting after the parent returned printed a traceback
under the one-line error: seen once in CI, on a loaded machine)."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from broker.config import CoreConfig
from broker.replay.sweep import Job, Source, run_jobs
from tests.broker.replay.fleet_journals import file_journals

FAULTY = "tests.broker.replay.faulty_policies"


def test_a_failed_job_stops_every_worker_before_its_error_is_raised(tmp_path: Path) -> None:
    journal = file_journals(tmp_path)[0]
    source = Source(journal=f"file://{journal}")
    stall = {"seconds": 60.0}
    jobs = [
        Job(source, f"{FAULTY}:AlwaysFailsPolicy", CoreConfig(), params={"marker": str(tmp_path / "attempts")}),
        *(Job(source, f"{FAULTY}:StallPolicy", CoreConfig(), params=stall) for _ in range(3)),
    ]
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="always_fails: as designed"):
        run_jobs(jobs, workers=2, log=lambda line: None, progress=False)
    # Not a minute: the stalled job was stopped, not waited for; and no worker is left.
    assert time.monotonic() - started < 45
    assert multiprocessing.active_children() == []
