"""The performance target lines: every target has a line, measured or not, with the right verdict."""

from __future__ import annotations

from typing import Any

from broker.bench.targets import (
    MEMORY_POLICIES,
    REPLAY_ALGORITHMS,
    Line,
    full_path_lines,
    instruction_lines,
    memory_lines,
    render,
    replay_lines,
)


def throughput(batch: int, journal: str, ratio: float, p99: float, echo_p99: float) -> dict[str, Any]:
    return {
        "kind": "throughput",
        "batch": batch,
        "streams": 4,
        "journal": journal,
        "ratio_to_echo": ratio,
        "events_per_s": 1000.0 * ratio,
        "echo_events_per_s": 1000.0,
        "p99_ms": p99,
        "echo_p99_ms_at_50": echo_p99,
    }


def test_a_line_is_met_missed_or_not_measured_by_its_bound_and_direction() -> None:
    assert Line("x", 300.0, 300.0).met is True
    assert Line("x", 301.0, 300.0).met is False
    assert Line("x", 0.5, 0.5, at_most=False).met is True
    assert Line("x", 0.49, 0.5, at_most=False).met is False
    assert Line("x", None, 1.0).met is None
    assert Line("x", 450.0, 300.0, unit=" B").render().startswith("  missed x: 450 B, target <= 300 B (1.50 of the bound)")
    assert "not measured x" in Line("x", None, 1.0).render()


def test_full_path_has_a_ratio_and_a_p99_line_for_each_shape_and_journal() -> None:
    records = [
        throughput(256, "file", 0.55, 9.0, 3.0),  # ratio met, p99 exactly 3x: met
        throughput(256, "redis", 0.2, 10.0, 2.0),  # both missed
        throughput(64, "redis", 0.7, 1.0, 1.0),
        throughput(256, "none", 0.9, 1.0, 1.0),  # no journal: no target names it
    ]
    lines = full_path_lines(records)
    text = [line.render() for line in lines]
    assert len(lines) == 8
    verdicts = {line.what: line.met for line in lines}
    assert verdicts["full path batch 256 x 4 streams, file journal: events/s over echo's"] is True
    assert verdicts["full path batch 256 x 4 streams, redis journal: events/s over echo's"] is False
    assert verdicts["full path batch 64 x 4 streams, redis journal: events/s over echo's"] is True
    assert verdicts["full path batch 64, file journal: events/s over echo's"] is None  # not measured, still said
    p99 = {line.what: line for line in lines if line.what.startswith("p99")}
    assert p99["p99 at 50% load, batch 256 x 4 streams, file journal, over echo's p99 at that rate"].figure == 3.0
    assert p99["p99 at 50% load, batch 256 x 4 streams, redis journal, over echo's p99 at that rate"].met is False
    assert not any("none journal" in t for t in text)
    with_cpu = full_path_lines([{**records[0], "cpu_us_per_event": 3.0, "echo_cpu_us_per_event": 0.5}])
    assert with_cpu[0].note.endswith("; CPU 3.0 against 0.5 us/event")


def test_memory_has_a_line_per_policy_at_its_largest_count() -> None:
    records = [
        {"kind": "memory", "policy": "lru", "blocks": 100_000, "rss_bytes_per_block": 900.0},
        {"kind": "memory", "policy": "lru", "blocks": 1_000_000, "rss_bytes_per_block": 280.0},
        {"kind": "memory", "policy": "arc", "blocks": 20_000, "rss_bytes_per_block": 350.0},
    ]
    lines = {line.what.split(":")[0]: line for line in memory_lines(records)}
    assert list(lines) == [f"memory {p}" for p in MEMORY_POLICIES]
    assert lines["memory lru"].figure == 280.0 and lines["memory lru"].met is True and "at 1M blocks" in lines["memory lru"].what
    assert lines["memory arc"].met is False and "20,000 blocks (the target is at 1M)" in lines["memory arc"].what
    assert lines["memory s3fifo"].met is None


def test_replay_lines_compare_time_and_hits() -> None:
    rows = [
        {"policy": "lru", "kvbroker_seconds": 4.0, "libcachesim_seconds": 1.0, "kvbroker_hits": 7, "libcachesim_hits": 7},
        {"policy": "arc", "kvbroker_seconds": 6.0, "libcachesim_seconds": 1.0, "kvbroker_hits": 7, "libcachesim_hits": 8},
    ]
    lines = replay_lines(rows)
    assert len(lines) == 2 + 2 + 1 + 1  # two lines per measured algorithm, one per missing
    by = {line.what: line for line in lines}
    assert by["replay lru vs libCacheSim LRU: time over libCacheSim's"].figure == 4.0
    assert by["replay lru: hits equal libCacheSim LRU's"].met is True
    assert by["replay arc vs libCacheSim ARC: time over libCacheSim's"].met is False
    assert by["replay arc: hits equal libCacheSim ARC's"].met is False
    assert by["replay arc: hits equal libCacheSim ARC's"].render() == "  missed replay arc: hits equal libCacheSim ARC's: no (7 and 8)"
    assert {p for p, _ in REPLAY_ALGORITHMS} == {"lru", "fifo", "s3fifo", "arc"}


def test_instruction_lines_and_the_summary_count() -> None:
    rows = [{"policy": "lru", "sizes": [10_000, 1_000_000], "instructions_per_op": [1000, 1400], "ratio": 1.4}]
    lines = instruction_lines(rows, ["lru", "arc"])
    assert lines[0].met is True and "1M blocks over 10k" in lines[0].what
    assert lines[1].met is None
    assert render("t", lines).splitlines()[0] == "targets (docs/performance.md): t: 1 of 1 measured met"


def test_the_output_names_where_the_targets_are_written_not_an_internal_issue() -> None:
    """A user reads the targets where they are written down (docs/performance.md); an issue
    number of this project's tracker means nothing to them. A quick run says its figures
    are not the targets' (its runs are too short to judge them)."""
    lines = full_path_lines([throughput(256, "file", 0.2, 10.0, 2.0)])
    for quick in (False, True):
        text = render("full path", lines, quick=quick)
        assert "issue" not in text
        assert "docs/performance.md" in text.splitlines()[0]
        assert ("--quick" in text.splitlines()[1]) is quick
