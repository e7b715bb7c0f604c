"""`kvbroker replay --progress`: a bar that ends full on a journal, a count on a trace; a
parallel sweep's overall progress, a bar on a terminal and plain lines elsewhere."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from broker.replay.progress import SweepProgress
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


def test_a_sweeps_progress_counts_jobs_and_events_and_estimates_what_is_left() -> None:
    """Two sources, two jobs each; the total is known per source once one of its jobs ended,
    and a source not yet seen counts as the mean of those seen."""
    out = io.StringIO()
    now = [0.0]
    progress = SweepProgress(["a", "a", "b", "b"], stream=out, tty=False, interval=10.0, clock=lambda: now[0])
    now[0] = 2.0
    progress.update(600)
    assert out.getvalue() == ""  # within the interval: no line yet
    assert progress.eta(now[0]) is None and progress.total_events() is None
    now[0] = 3.0
    progress.job_done(0, {"events": 1000, "seconds": 2.9}, 1500, "lru on a")
    lines = out.getvalue().splitlines()
    assert lines[0] == "[1/4] lru on a done in 2.9s"
    # total 4 x 1000 events; 1500 done at 500 events/s: 5 s left.
    assert lines[1] == "replay: 1/4 jobs done, 1,500 events (38%), 500 events/s, 3s elapsed, ETA 5s"
    now[0] = 13.5
    progress.update(6000)
    assert out.getvalue().splitlines()[-1].startswith("replay: 1/4 jobs done, 6,000 events")  # the periodic line
    now[0] = 14.0
    progress.job_done(2, {"events": 3000, "seconds": 5.0}, 8000, "lru on b")
    assert progress.total_events() == 2 * 1000 + 2 * 3000


def replay_two_policies(*extra: str, stderr: Any = subprocess.PIPE) -> subprocess.Popen[str]:
    trace = Path(__file__).parents[1] / "data" / "mooncake" / "synthetic_trace.jsonl"
    args = ["replay", "--trace", str(trace), "--format", "mooncake", "--no-decode", "--hbm", "1000000tok", "--policies", "lru,fifo"]
    return subprocess.Popen(
        [str(KVBROKER), *args, "--jobs", "2", "--json", *extra],
        stdout=subprocess.PIPE,
        stderr=stderr,
        stdin=subprocess.DEVNULL,
        text=True,
    )


def test_a_parallel_sweep_with_progress_off_a_terminal_writes_plain_lines() -> None:
    proc = replay_two_policies("--progress")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert "\r" not in stderr  # a log stays readable: no bar redrawn in place
    events = sum(r["events"] for r in json.loads(stdout))
    overall = [line for line in stderr.splitlines() if line.startswith("replay: ")]
    assert overall and overall[-1].startswith(f"replay: 2/2 jobs done, {events:,} events (100%), ")
    assert re.search(r", [\d,]+ events/s, [\d,]+s elapsed, ETA 0s$", overall[-1]), overall[-1]


def test_a_parallel_sweep_on_a_terminal_draws_one_overall_bar() -> None:
    primary, secondary = pty.openpty()
    proc = replay_two_policies(stderr=secondary)  # no --progress: a terminal is enough
    os.close(secondary)
    seen = b""
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    stdout, _ = proc.communicate(timeout=300)
    os.close(primary)
    assert proc.returncode == 0
    drawn = seen.decode(errors="replace")
    events = sum(r["events"] for r in json.loads(stdout))
    assert "replay 2/2 jobs: 100%" in drawn, drawn[-2000:]
    assert "events/s" in drawn and "\r" in drawn  # redrawn in place
    total = tqdm.format_sizeof(events)  # as the bar writes it (unit_scale: 252k)
    assert f"| {total}/{total} [" in drawn, drawn[-500:]


def test_the_share_done_and_the_time_left_follow_events_when_their_total_is_known() -> None:
    """A journal's batches differ a thousandfold in events (a prompt's allocations, one
    decode access): 90% of the batches done may be 10% of the work. Before, the bar said
    90% and ETA 0s here."""
    bar = ProgressBar("lru", 10, stream=io.StringIO(), total_events=1_000)
    line = bar.line(9, 100, bar.started + 1.0)
    assert " 10% " in line and "ETA 9s" in line, line
    assert "[" + "#" * 3 + "." * 27 + "]" in line, line
    # A Redis journal's events are not known beforehand: batches, as before.
    assert " 90% " in ProgressBar("lru", 10, stream=io.StringIO()).line(9, 100, 1.0)


def test_a_file_journal_is_measured_in_batches_and_events(tmp_path: Path) -> None:
    from broker.replay.sweep import Source, count_journal

    journal = f"file://{tmp_path}/t.journal"
    argv = [str(KVBROKER), "import", "--trace", "balanced", "--format", "profile", "--out", journal]
    made = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    summary = json.loads(made.stdout)
    assert count_journal(Source(journal=journal)) == (summary["batches"], summary["events"])
    assert count_journal(Source(trace="balanced", fmt="profile")) == (None, None)


def test_progress_lines_name_sizes_as_the_table_does(tmp_path: Path) -> None:
    """The table says hbm=100,000tok for a trace swept in tokens; the progress lines said
    hbm=12.21GiB-like bytes for the same job."""
    mooncake = Path(__file__).parents[1] / "data" / "mooncake" / "synthetic_trace.jsonl"
    trace = tmp_path / "t.jsonl"
    with mooncake.open() as f:
        trace.write_text("".join(next(f) for _ in range(20)))
    done = subprocess.run(
        [str(KVBROKER), "replay", "--trace", str(trace), "--format", "mooncake", "--hbm", "100000tok,200000tok", "--policies", "lru"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    progress = [line for line in done.stderr.splitlines() if " done in " in line]
    assert len(progress) == 2, done.stderr
    for size in ("hbm=100,000tok", "hbm=200,000tok"):
        assert any(size in line for line in progress), progress
        assert size in done.stdout, done.stdout
    assert "GiB" not in "".join(progress) and "MiB" not in "".join(progress), progress


def test_a_single_jobs_progress_off_a_terminal_is_whole_lines() -> None:
    """`--progress 2>log` with one job: each update a line of its own, as the sweep's lines
    are; before, updates were joined by \\r into one line thousands of columns wide."""
    out = io.StringIO()  # not a terminal
    bar = ProgressBar("lru", 200, stream=out)
    for batches in (50, 100, 150):
        bar.next_draw = 0.0  # the update is due
        bar.show(batches, batches * 10)
    bar.done(200, 2_000)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 4 and all(line.startswith("lru: [") for line in lines), lines
    assert lines[-1].endswith(" done")


TRACE = Path(__file__).parents[1] / "data" / "mooncake" / "synthetic_trace.jsonl"


def test_a_mooncake_traces_events_are_known_before_its_replay() -> None:
    """Counted from its requests, as many as the import makes, in both modes: a trace's
    share done and time left from the start (a single job showed a count only)."""
    from broker.replay.sweep import Job, Source, count_journal, run_job, single_tier
    from broker.replay.traces import TraceOptions

    for decode in (True, False):
        source = Source(trace=str(TRACE), fmt="mooncake", options=TraceOptions(decode=decode))
        record = run_job(Job(source, "lru", single_tier(10**12)))
        assert count_journal(source) == (None, record["events"])


def test_a_single_job_of_a_trace_shows_its_share_and_time_left() -> None:
    bar = ProgressBar("lru", None, stream=io.StringIO(), total_events=1_000)
    line = bar.line(3, 250, bar.started + 1.0)
    assert " 25% " in line and "ETA 3s" in line, line


def test_a_sweep_whose_sources_are_counted_has_a_share_and_eta_before_any_job_ends() -> None:
    out = io.StringIO()
    now = [0.0]
    progress = SweepProgress(["a", "a"], stream=out, tty=False, interval=10.0, clock=lambda: now[0], known={"a": 1000})
    now[0] = 10.0
    progress.update(500)
    assert out.getvalue().splitlines()[-1] == "replay: 0/2 jobs done, 500 events (25%), 50 events/s, 10s elapsed, ETA 30s"


def test_a_long_decode_run_is_said_before_it_starts_with_the_quick_modes() -> None:
    from broker.replay.progress import long_run_note

    note = long_run_note(60_000_000, 2_000_000, jobs=5, workers=2)  # three rounds of 20 minutes
    assert note is not None and "about 60 min" in note, note
    assert "--no-decode (prompt blocks only, 2,000,000 events a job)" in note and "--engine vllm" in note
    assert long_run_note(729_495, 125_870, jobs=5, workers=2) is None  # half a minute: nothing said


def test_replay_says_so_before_a_long_decode_run() -> None:
    sizes = ",".join(f"{n}000000tok" for n in range(1, 9))
    proc = subprocess.Popen(
        [str(KVBROKER), "replay", "--trace", str(TRACE), "--format", "mooncake", "--policies", "lru", "--hbm", sizes, "--jobs", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # before any job has ended
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert first.startswith("kvbroker replay: note: decode mode replays 729,495 events in each of 8 job(s), about "), first
    assert "--no-decode (prompt blocks only, 125,870 events a job)" in first and "--engine vllm" in first
