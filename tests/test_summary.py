"""The test run's summary says how many vLLM- and Ray-marked tests were deselected: with
-n (the default) pytest's own summary does not ("1846 passed" read as the whole suite
while 127 were not run)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
# A vllm-marked test and the Ray tests (Ray is not installed in the main venv; where it is,
# only the vllm line is said).
FILES = ["tests/vllm_integration/test_imports.py", "tests/broker/replay/test_ray_runner.py"]
LINE = re.compile(r"^not run here: (\d+) (vllm|ray)-marked tests? deselected \(run by \.ci/run's (vLLM|Ray) step", re.M)


def pytest(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args, *FILES], capture_output=True, text=True, cwd=ROOT, timeout=240
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_summary_counts_the_deselected_vllm_and_ray_tests_with_and_without_workers() -> None:
    one = pytest("-n", "0")
    deselected = int(re.search(r"(\d+) deselected", one).group(1))  # type: ignore[union-attr]  # pytest's own count, -n 0
    for out in (one, pytest("-n", "2")):  # with workers, pytest's summary has no "deselected"
        said = {marker: int(count) for count, marker, _ in LINE.findall(out)}
        assert "vllm" in said, out
        assert sum(said.values()) == deselected, out
