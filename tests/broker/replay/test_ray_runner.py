"""Issue 25: a sweep's jobs as Ray tasks on a local Ray of 2 CPUs (``ray.init(num_cpus=2,
include_dashboard=False)``, started once for the module). Marked ``ray``: the main suite
deselects these where Ray is not installed (tests/conftest.py); .ci/run runs them in a venv
with the [ray] extra and fails unless they ran."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from broker.cli.main import main
from broker.config import CoreConfig
from broker.replay.ray_runner import SweepFailed, run_jobs_on_ray
from broker.replay.sweep import Job, Source
from tests.broker.replay.fleet_journals import copy_to_redis, file_journals
from tests.conftest import REDIS_URL

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]
FAULTY = "tests.broker.replay.faulty_policies"
TIME_FIELDS = ("seconds", "events_per_s")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[Any]:
    import ray

    # The workers import the test policies by module path, from the checkout.
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[list[Path], str]]:
    """Two pods' journals as files, and the same in Redis under a fresh key prefix."""
    paths = file_journals(tmp_path)
    prefix = f"kvbroker-test:{uuid.uuid4().hex}"
    keys = copy_to_redis(paths, REDIS_URL, prefix)
    try:
        yield paths, prefix
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        client.delete(*keys, *(f"{k}:directives" for k in keys))
        client.close()


def replay_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert main(["replay", *argv, "--json"]) == 0, capsys.readouterr().err
    records: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return records


def without_time(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in TIME_FIELDS}


def test_a_sweep_on_ray_gives_the_local_records_field_by_field(
    local_ray: Any, fleet: tuple[list[Path], str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 25 acceptance: a fleet (Redis journals by pattern and a file journal), two
    policies, a parameter sweep and two capacities: every record equal to the local run's."""
    paths, prefix = fleet
    argv = [
        "--journal",
        f"{REDIS_URL}?stream={prefix}:*:journal",
        "--journal",
        f"file://{paths[0]}",
        "--policy",
        "lru,deadline_edf",
        "--param",
        "deadline_edf.guard_us=250,2000",
        "--hbm",
        "32MiB,96MiB",
    ]
    local = replay_json([*argv, "--jobs", "1"], capsys)
    on_ray = replay_json([*argv, "--ray", "--jobs", "2"], capsys)
    # 3 sources x 2 capacities x (lru + 2 deadline_edf settings), and a fleet row per point.
    assert len(local) == 3 * 2 * 3 + 2 * 3
    assert [r["source"] for r in on_ray] == [r["source"] for r in local]
    for mine, theirs in zip(on_ray, local, strict=True):
        assert mine.keys() == theirs.keys()
        for field in mine:
            if field not in TIME_FIELDS:
                assert mine[field] == theirs[field], f"{field} of {theirs['source']} {theirs['policy']} {theirs['params']}"
    assert {r["params"]["guard_us"] for r in local if r["policy"] == "deadline_edf"} == {250, 2000}
    assert sum(r["source"] == "fleet" for r in local) == 6


def test_a_failed_task_is_retried(local_ray: Any, tmp_path: Path) -> None:
    """The first attempt of the job raises; Ray runs it again and the sweep completes."""
    journal = file_journals(tmp_path)[0]
    marker = tmp_path / "first-attempt"
    source = Source(journal=f"file://{journal}")
    jobs = [Job(source, "fifo", CoreConfig()), Job(source, f"{FAULTY}:FailOncePolicy", CoreConfig(), params={"marker": str(marker)})]
    lines: list[str] = []
    records = run_jobs_on_ray(jobs, log=lines.append)
    assert marker.exists(), "the first attempt ran and failed"
    assert [r["policy"] for r in records] == ["fifo", "fail_once"]
    assert without_time(records[1]) | {"policy": "fifo", "params": None} == without_time(records[0]) | {"params": None}


def test_a_task_that_keeps_failing_is_reported_by_name_after_its_retries(local_ray: Any, tmp_path: Path) -> None:
    journal = file_journals(tmp_path)[0]
    attempts = tmp_path / "attempts"
    source = Source(journal=f"file://{journal}")
    jobs = [Job(source, "lru", CoreConfig()), Job(source, f"{FAULTY}:AlwaysFailsPolicy", CoreConfig(), params={"marker": str(attempts)})]
    with pytest.raises(SweepFailed) as failed:
        run_jobs_on_ray(jobs, retries=2, log=lambda line: None)
    message = str(failed.value)
    assert f"job 2/2 ({FAULTY}:AlwaysFailsPolicy(marker={attempts})" in message
    assert "failed after 3 attempts: RuntimeError: always_fails: as designed" in message
    assert len(attempts.read_text().splitlines()) == 3, "one first attempt and two retries"
    assert [f.index for f in failed.value.failures] == [1], "the other job finished"


def test_ctrl_c_cancels_the_tasks_not_yet_done(local_ray: Any, tmp_path: Path) -> None:
    """Interrupted after the first job is done, the runner cancels the rest: stalled jobs of
    a minute each do not keep it (or the workers) busy."""
    journal = file_journals(tmp_path)[0]
    source = Source(journal=f"file://{journal}")
    stall = {"seconds": 60.0}
    jobs = [Job(source, "lru", CoreConfig()), *(Job(source, f"{FAULTY}:StallPolicy", CoreConfig(), params=stall) for _ in range(3))]
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if line.startswith("[1/4]"):
            raise KeyboardInterrupt

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_jobs_on_ray(jobs, log=log, poll_s=0.2)
    assert time.monotonic() - started < 45
    assert any("cancelled 3 task(s) not yet done" in line for line in lines), lines
    # The CPUs are free again at once: a new job runs without waiting for the stalls.
    started = time.monotonic()
    assert [r["policy"] for r in run_jobs_on_ray(jobs[:1], log=lambda line: None)] == ["lru"]
    assert time.monotonic() - started < 45
