"""^C during `kvbroker replay`: one line, the rows of the jobs that had ended printed (and
written with --json), exit 130. Before, a KeyboardInterrupt traceback and nothing kept."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

KVBROKER = Path(sys.executable).parent / "kvbroker"
TRACE = Path(__file__).parents[1] / "data" / "mooncake" / "synthetic_trace.jsonl"
# Eight jobs of a few seconds each, one after the other: ^C lands while a later one runs.
SIZES = ",".join(f"{n}000000tok" for n in range(1, 9))
ARGS = ["--trace", str(TRACE), "--format", "mooncake", "--policies", "lru", "--hbm", SIZES]


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_ctrl_c_keeps_the_finished_rows_and_exits_130(tmp_path: Path, jobs: str) -> None:
    """With --jobs 2 the workers get the ^C too, as from a terminal (its process group)."""
    out = tmp_path / "rows.json"
    with out.open("w") as stdout:
        proc = subprocess.Popen(
            [str(KVBROKER), "replay", *ARGS, "--jobs", jobs, "--json"],
            stdout=stdout,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # wait until a job has ended, then ^C (the whole group, as a terminal does)
            seen.append(line)
            if line.startswith("[1/8]") or line.startswith("replay: 1/8"):
                break
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == 130, "".join(seen) + rest
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
    said = [line for line in rest.splitlines() if line.startswith("kvbroker replay: interrupted")]
    assert len(said) == 1, rest
    rows = json.loads(out.read_text())
    assert 1 <= len(rows) < 8
    assert said[0] == f"kvbroker replay: interrupted: {len(rows)} of 8 jobs had ended; their rows follow"
    assert all(row["policy"] == "lru" and row["events"] > 0 for row in rows)
