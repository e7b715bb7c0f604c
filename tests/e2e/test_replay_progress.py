"""`kvbroker replay --progress`: a bar that ends full on a journal, a count on a trace."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

from broker.replay.replay import ProgressBar

KVBROKER = Path(sys.executable).parent / "kvbroker"


def test_the_bar_fills_with_the_batches_and_estimates_what_is_left() -> None:
    out = io.StringIO()
    bar = ProgressBar("lru", 200, stream=out)
    half = bar.line(100, 51_200, bar.started + 2.0)
    assert "[" + "#" * 15 + "." * 15 + "]" in half and " 50% " in half
    assert "51,200 events" in half and "25,600 events/s" in half and "ETA 2s" in half
    bar.done(200, 102_400)
    assert "[" + "#" * 30 + "]" in out.getvalue() and "100%" in out.getvalue() and out.getvalue().endswith("done\n")
    unknown = ProgressBar("lru", None, stream=io.StringIO()).line(7, 700, 0.0)
    assert "7 batches" in unknown and "%" not in unknown


def test_replay_of_a_journal_draws_a_bar_to_100_percent(tmp_path: Path) -> None:
    journal = f"file://{tmp_path}/trace.journal"
    config = tmp_path / "broker.toml"
    config.write_text('[[tiers]]\nname = "hbm"\ncapacity = "64MiB"\n[[tiers]]\nname = "dram"\ncapacity = "1GiB"\n')
    made = subprocess.run(
        [str(KVBROKER), "import", "--trace", "balanced", "--format", "profile", "--out", journal, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    done = subprocess.run(
        [str(KVBROKER), "replay", "--journal", journal, "--policies", "lru", "--progress", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    final = [line for line in done.stderr.replace("\r", "\n").splitlines() if line.endswith(" done")]
    assert final, done.stderr
    assert re.search(r"lru: \[#{30}\] 100% [\d,]+ events", final[-1]), final[-1]
    events = int(re.search(r"\] 100% ([\d,]+) events", final[-1]).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert events == json.loads(done.stdout)[0]["events"] > 0
