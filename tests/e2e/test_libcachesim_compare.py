"""bench/libcachesim_compare.py: "best kvbroker" is the best online policy, as "best
libCacheSim" is; the offline prefetch_oracle (it reads the future, as Belady does) has a
column of its own. Before, it led "best kvbroker" at 100% of Belady's hits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]
ARGS = ["--sizes", "1000000tok", "--kvbroker", "lru,fifo,prefetch_oracle,belady", "--libcachesim", "LRU,FIFO"]


def run(*extra: str) -> str:
    done = subprocess.run(
        [sys.executable, "bench/libcachesim_compare.py", *ARGS, *extra], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_best_kvbroker_is_online_and_the_oracle_has_its_own_column() -> None:
    rows = json.loads(run("--json"))["rows"]
    online = {r["algorithm"]: r["online"] for r in rows}
    assert online == {"Belady": False, "lru": True, "fifo": True, "prefetch_oracle": False, "belady": False, "LRU": True, "FIFO": True}
    oracle = next(r for r in rows if r["algorithm"] == "prefetch_oracle")
    best = max((r for r in rows if r["source"] == "kvbroker" and r["online"]), key=lambda r: r["hits"])
    assert oracle["hits"] > best["hits"]  # what made the oracle "best" before

    table = [line for line in run().splitlines() if line.startswith("|")]
    head = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert head[1:3] == ["best kvbroker (online)", "best libCacheSim (online)"]
    assert "prefetch_oracle (offline)" in head and "belady (offline)" not in head
    cells = [cell.strip() for cell in table[2].strip("|").split("|")]
    assert cells[1].startswith(f"{best['algorithm']} {100 * best['share_of_belady']:.1f}%"), cells
    assert cells[head.index("prefetch_oracle (offline)")].startswith(f"{100 * oracle['share_of_belady']:.1f}%"), cells
