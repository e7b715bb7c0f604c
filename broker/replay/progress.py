"""The progress of a parallel sweep, over all its jobs: jobs done, events replayed, events/s
and the time left.

Workers add the events they replay to one shared counter (every few batches, so it costs
nothing measurable); the parent reads it while it waits for the jobs. On a terminal that is
a tqdm bar, redrawn in place; elsewhere (a log, CI) one plain line each time a job ends and
every ``interval`` seconds between, so the file stays readable.

The time left is estimated from events: every job of a source replays the same events, so
a source's total is known before its jobs start where it can be counted (a file journal, a
Mooncake trace), else once one of its jobs has ended (and sources not yet known count as
the mean of those known); until then it is unknown.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

# Set in a worker process by ``count_into``: the sweep's shared events counter.
_counter: Any = None


def count_into(counter: Any) -> None:
    """Worker initializer: replays in this process add their events to ``counter``."""
    global _counter
    _counter = counter


def add_events(n: int) -> None:
    """Called by the replay loop of a worker (a no-op outside a counted sweep)."""
    if _counter is not None and n:
        with _counter.get_lock():
            _counter.value += n


def counting() -> bool:
    return _counter is not None


def events_in(payload: bytes) -> int:
    """Events in one IntentBatch's bytes. For a journal replay's time left: its batches
    differ a thousandfold in events (a prompt's allocations, a decode step's one access),
    so a share of batches done says little of the time a share of events does."""
    from kvbroker.v1 import intent_pb2 as pb

    return len(pb.IntentBatch.FromString(payload).events)


# Events a process replays per second in decode mode, for the warning of a long run: a
# low figure of those measured on the shared 2-core host (the Mooncake trace, 729k events:
# lru 200k/s, arc and history_arc 70k/s of CPU, 22k/s of wall clock under load).
DECODE_EVENTS_PER_S = 50_000
# A run expected to take longer than this is said before it starts.
LONG_RUN_S = 60.0


def long_run_note(events: int, prompt_events: int, jobs: int, workers: int) -> str | None:
    """What a decode-mode trace replay will cost, said before it starts when it is long,
    with the quick modes: a conversation trace through 5 policies ran about an hour with no
    word of it, where --no-decode took 39 s and --engine vllm 23 s."""
    rounds = -(-jobs // max(1, min(workers, jobs)))  # jobs one after another in each process
    seconds = events * rounds / DECODE_EVENTS_PER_S
    if seconds < LONG_RUN_S:
        return None
    return (
        f"note: decode mode replays {events:,} events in each of {jobs} job(s), about {_duration(seconds)} here "
        f"(at ~{DECODE_EVENTS_PER_S:,} events/s a process); the quick modes: --no-decode (prompt blocks only, "
        f"{prompt_events:,} events a job) or --engine vllm --hbm SIZE (vLLM's CPU tier, requests as vLLM runs them)"
    )


def _duration(seconds: float) -> str:
    return f"{seconds / 60:,.0f} min" if seconds >= 90 else f"{seconds:,.0f} s"


class SweepProgress:
    """Overall progress of ``len(sources)`` jobs; ``sources[i]``: the source label of job i."""

    def __init__(
        self,
        sources: Sequence[str],
        *,
        stream: TextIO | None = None,
        tty: bool | None = None,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        known: dict[str, int] | None = None,
    ) -> None:
        self.sources = list(sources)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval = interval
        self.clock = clock
        self.started = clock()
        self.next_line = self.started + interval
        self.done = 0
        self.events = 0
        # Events of one job of the source (all its jobs replay the same): ``known`` before
        # any job ends (a file journal counted, a Mooncake trace's requests read), else once one has.
        self.per_source: dict[str, int] = dict(known or {})
        self.bar: Any = None
        if self.tty:
            from tqdm import tqdm

            width = _width(self.stream)
            self.bar = tqdm(
                total=None,
                file=self.stream,
                unit=" events",
                unit_scale=True,
                # A terminal that reports no width (some ptys, CI consoles): 100 columns.
                dynamic_ncols=width > 0,
                ncols=None if width > 0 else 100,
                nrows=None if width > 0 else 24,
                desc=f"replay 0/{len(self.sources)} jobs",
                mininterval=0.5,
            )

    def total_events(self) -> int | None:
        """The sweep's events, as far as they can be known now (None: not yet)."""
        if not self.per_source:
            return None
        mean = sum(self.per_source.values()) / len(self.per_source)
        return int(sum(self.per_source.get(source, mean) for source in self.sources))

    def eta(self, now: float) -> float | None:
        total = self.total_events()
        elapsed = now - self.started
        if total is None or self.events <= 0 or elapsed <= 0:
            return None
        return max(total - self.events, 0) / (self.events / elapsed)

    def line(self, now: float) -> str:
        """The plain line: jobs done, events (and their share when the total is known),
        events/s, elapsed, time left."""
        elapsed = max(now - self.started, 1e-9)
        eta = self.eta(now)
        left = "ETA --" if eta is None else f"ETA {eta:,.0f}s"
        total = self.total_events()
        share = f" ({min(self.events / total, 1.0):.0%})" if total else ""
        return (
            f"replay: {self.done}/{len(self.sources)} jobs done, {self.events:,} events{share}, "
            f"{self.events / elapsed:,.0f} events/s, {elapsed:,.0f}s elapsed, {left}"
        )

    def update(self, events: int) -> None:
        """The shared counter read now."""
        self.events = max(self.events, events)
        now = self.clock()
        if self.bar is not None and self.bar.total is None and self.total_events() is not None:
            self.bar.total = self.total_events()  # a share done from the start
        if self.bar is not None:
            total = self.total_events()
            if total is not None and self.bar.total != max(total, self.events):
                self.bar.total = max(total, self.events)
            self.bar.n = self.events
            self.bar.refresh()
        elif now >= self.next_line:
            self.say(now)

    def job_done(self, index: int, record: dict[str, Any], events: int, label: str) -> None:
        """Job ``index`` ended with ``record``; ``events``: the shared counter now."""
        self.done += 1
        self.per_source.setdefault(self.sources[index], int(record["events"]))
        note = f"[{self.done}/{len(self.sources)}] {label} done in {record['seconds']:.1f}s"
        if self.bar is not None:
            self.bar.write(note, file=self.stream)
            self.bar.set_description_str(f"replay {self.done}/{len(self.sources)} jobs", refresh=False)
            self.update(events)
        else:
            print(note, file=self.stream, flush=True)
            self.events = max(self.events, events)
            self.say(self.clock())

    def say(self, now: float) -> None:
        self.next_line = now + self.interval
        print(self.line(now), file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _width(stream: TextIO) -> int:
    import os

    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0
