"""The performance targets (docs/performance.md) and the lines the benches print for them.

Every bench that measures one of them prints one line per target, whether measured or
not: ``met``/``missed`` with the figure, the target and the ratio of the two, or ``not
measured`` and what to run. So a reader of any one bench's output sees every target it
covers, and a test can check the lines are there (the figures themselves are not test
material). The figures come from records the benches already produce (``kvbroker bench
--json``'s throughput and memory records, ``bench/replay_vs_libcachesim.py`` and
``bench/policy_instructions.py``'s rows).
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Memory: RSS per tracked block at 1M blocks, policy state included, for each of these.
MEMORY_POLICIES = ("lru", "s3fifo", "arc", "prefix_aware", "deadline_edf")
MEMORY_BLOCKS = 1_000_000
MEMORY_BYTES = 300.0
# Full path: events/s over the echo ceiling's, same run, both journals.
FULL_PATH = ((256, 4, 0.5), (64, None, 0.6))  # (batch, streams or None: any, least ratio)
FULL_PATH_JOURNALS = ("file", "redis")
# Latency: the broker's p99 at 50% of its maximum rate over the echo server's at that rate.
P99_RATIO = 3.0
# Replay: kvbroker's replay time over libCacheSim's on the same block sequence.
REPLAY_ALGORITHMS = (("lru", "LRU"), ("fifo", "FIFO"), ("s3fifo", "S3FIFO"), ("arc", "ARC"))
# kvbroker's parameters for libCacheSim's algorithm, where its default differs (s3fifo's
# default is the paper's; policies/s3fifo.py says how libCacheSim's S3FIFO differs).
REPLAY_PARAMS: dict[str, dict[str, Any]] = {"s3fifo": {"variant": "libcachesim", "move_to_main_threshold": 2}}
REPLAY_RATIO = 5.0
# Scaling: instructions per operation at 1M resident blocks over those at 10k.
INSTRUCTION_SIZES = (10_000, 1_000_000)
INSTRUCTION_RATIO = 1.5


@dataclasses.dataclass(frozen=True)
class Line:
    """One target: what, the figure (None: not measured), the bound, and whether lower is better."""

    what: str
    figure: float | None
    bound: float
    at_most: bool = True
    unit: str = ""
    note: str = ""
    # A yes/no target (figure 1.0 or 0.0 against a bound of 1): said as yes/no, no ratio.
    boolean: bool = False

    @property
    def met(self) -> bool | None:
        if self.figure is None:
            return None
        return self.figure <= self.bound if self.at_most else self.figure >= self.bound

    def render(self) -> str:
        sign = "<=" if self.at_most else ">="
        if self.figure is None:
            return f"  not measured {self.what}: target {sign} {self.bound:g}{self.unit}" + (f" ({self.note})" if self.note else "")
        flag = "met   " if self.met else "missed"
        if self.boolean:
            return f"  {flag} {self.what}: {'yes' if self.met else 'no'}" + (f" ({self.note})" if self.note else "")
        ratio = self.figure / self.bound if self.bound else float("inf")
        text = f"  {flag} {self.what}: {self.figure:,.4g}{self.unit}, target {sign} {self.bound:g}{self.unit} ({ratio:.2f} of the bound)"
        return text + (f"; {self.note}" if self.note else "")


def memory_lines(records: list[dict[str, Any]], policies: tuple[str, ...] = MEMORY_POLICIES) -> list[Line]:
    """RSS per block for each policy, at the largest block count measured for it (the target
    is at 1M: a smaller count is said in the line)."""
    out = []
    for policy in policies:
        mine = [r for r in records if r.get("kind") == "memory" and r.get("policy") == policy]
        if not mine:
            out.append(Line(f"memory {policy}: bytes of RSS per block at 1M blocks", None, MEMORY_BYTES, note="kvbroker bench --memory"))
            continue
        r = max(mine, key=lambda r: r["blocks"])
        where = "1M blocks" if r["blocks"] == MEMORY_BLOCKS else f"{r['blocks']:,} blocks (the target is at 1M)"
        out.append(Line(f"memory {policy}: bytes of RSS per block at {where}", r["rss_bytes_per_block"], MEMORY_BYTES, unit=" B"))
    return out


def _throughput(records: list[dict[str, Any]], batch: int, streams: int | None, journal: str) -> list[dict[str, Any]]:
    return [
        r
        for r in records
        if r.get("kind") == "throughput"
        and r["batch"] == batch
        and (streams is None or r["streams"] == streams)
        and r["journal"] == journal
    ]


def full_path_lines(records: list[dict[str, Any]]) -> list[Line]:
    """Ratio to the echo ceiling at batch 256 x 4 streams and at batch 64 (every stream
    count measured), and the p99 ratio at 50% load for the same configurations, each journal."""
    out = []
    for batch, streams, least in FULL_PATH:
        shape = f"batch {batch} x {streams} streams" if streams else f"batch {batch}"
        for journal in FULL_PATH_JOURNALS:
            found = _throughput(records, batch, streams, journal)
            if not found:
                out.append(Line(f"full path {shape}, {journal} journal: events/s over echo's", None, least, at_most=False))
            for r in found:
                label = f"full path batch {batch} x {r['streams']} streams, {journal} journal: events/s over echo's"
                note = f"{r['events_per_s']:,.0f} against {r['echo_events_per_s'] or 0:,.0f} events/s"
                if r.get("cpu_us_per_event") and r.get("echo_cpu_us_per_event"):
                    # Steadier than the rates on a shared host: where CPU bound, the ratio is about its inverse.
                    note += f"; CPU {r['cpu_us_per_event']} against {r['echo_cpu_us_per_event']} us/event"
                out.append(Line(label, r["ratio_to_echo"], least, at_most=False, note=note))
    for batch, streams, _ in FULL_PATH:
        shape = f"batch {batch} x {streams} streams" if streams else f"batch {batch}"
        for journal in FULL_PATH_JOURNALS:
            found = _throughput(records, batch, streams, journal)
            if not found:
                out.append(Line(f"p99 at 50% load, {shape}, {journal} journal, over echo's p99 at that rate", None, P99_RATIO))
            for r in found:
                label = f"p99 at 50% load, batch {batch} x {r['streams']} streams, {journal} journal, over echo's p99 at that rate"
                ratio = r["p99_ms"] / r["echo_p99_ms_at_50"] if r.get("echo_p99_ms_at_50") and r.get("p99_ms") is not None else None
                note = f"{r['p99_ms']} ms against {r.get('echo_p99_ms_at_50')} ms"
                out.append(Line(label, ratio, P99_RATIO, note=note))
    return out


def replay_lines(rows: list[dict[str, Any]]) -> list[Line]:
    """kvbroker's replay time over libCacheSim's, per algorithm, and whether the hits agree."""
    out = []
    for policy, algorithm in REPLAY_ALGORITHMS:
        row = next((r for r in rows if r.get("policy") == policy), None)
        what = f"replay {policy} vs libCacheSim {algorithm}: time over libCacheSim's"
        if row is None:
            out.append(Line(what, None, REPLAY_RATIO, note="bench/replay_vs_libcachesim.py"))
            continue
        same = "identical" if row["kvbroker_hits"] == row["libcachesim_hits"] else "DIFFERENT"
        note = (
            f"{row['kvbroker_seconds']:.3f}s against {row['libcachesim_seconds']:.3f}s; "
            f"hits {row['kvbroker_hits']} vs {row['libcachesim_hits']}: {same}"
        )
        if row.get("params"):
            note += "; kvbroker's " + ", ".join(f"{k}={v}" for k, v in row["params"].items())
        out.append(Line(what, row["kvbroker_seconds"] / row["libcachesim_seconds"], REPLAY_RATIO, note=note))
        hits = f"{row['kvbroker_hits']} and {row['libcachesim_hits']}"
        same_hits = float(row["kvbroker_hits"] == row["libcachesim_hits"])
        out.append(Line(f"replay {policy}: hits equal libCacheSim {algorithm}'s", same_hits, 1.0, at_most=False, note=hits, boolean=True))
    return out


def instruction_lines(rows: list[dict[str, Any]], policies: list[str]) -> list[Line]:
    """Instructions per operation at the largest size over those at the smallest, per policy."""
    out = []
    for policy in policies:
        row = next((r for r in rows if r.get("policy") == policy), None)
        if row is None:
            out.append(Line(f"instructions/op {policy}: 1M blocks over 10k", None, INSTRUCTION_RATIO, note="bench/policy_instructions.py"))
            continue
        sizes, per_op = row["sizes"], row["instructions_per_op"]
        where = (
            "1M blocks over 10k"
            if (sizes[0], sizes[-1]) == INSTRUCTION_SIZES
            else f"{sizes[-1]:,} blocks over {sizes[0]:,} (the target is 1M over 10k)"
        )
        note = f"{per_op[-1]:,.0f} against {per_op[0]:,.0f} instructions/op"
        out.append(Line(f"instructions/op {policy}: {where}", row["ratio"], INSTRUCTION_RATIO, note=note))
    return out


# Said under a quick run's verdicts: its runs are too short and too small for the figures the
# targets are about, and a reader who saw only "0 of 8 met" took the broker for slow.
QUICK_NOTE = "  (a --quick run checks the output on tiny, short runs: its figures are not the targets'; run without --quick to judge)"


def render(title: str, lines: list[Line], quick: bool = False) -> str:
    """The verdicts under one header a user can follow: where the targets are written down
    (docs/performance.md), not the issue that set them."""
    met = sum(1 for line in lines if line.met)
    measured = sum(1 for line in lines if line.met is not None)
    head = f"targets (docs/performance.md): {title}: {met} of {measured} measured met"
    return "\n".join([head, *([QUICK_NOTE] if quick else []), *(line.render() for line in lines)])
