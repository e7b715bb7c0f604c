"""The progress of a parallel sweep, over all its jobs: jobs done, events replayed, events/s
and the time left.

Workers add the events they replay to one shared counter (every few batches, so it costs
nothing measurable); the parent reads it while it waits for the jobs. On a terminal that is
a tqdm bar, redrawn in place; elsewhere (a log, CI) one plain line each time a job ends and
every ``interval`` seconds between, so the file stays readable.

The time left is estimated from events: every job of a source replays the same events, so
once one job of a source has ended the sweep's total is known for that source (and sources
no job has finished yet count as the mean of those known); until then it is unknown.
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
        self.per_source: dict[str, int] = {}  # events of one job of the source (all its jobs replay the same)
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
        """The plain line: jobs done, events, events/s, elapsed, time left."""
        elapsed = max(now - self.started, 1e-9)
        eta = self.eta(now)
        left = "ETA --" if eta is None else f"ETA {eta:,.0f}s"
        return (
            f"replay: {self.done}/{len(self.sources)} jobs done, {self.events:,} events, "
            f"{self.events / elapsed:,.0f} events/s, {elapsed:,.0f}s elapsed, {left}"
        )

    def update(self, events: int) -> None:
        """The shared counter read now."""
        self.events = max(self.events, events)
        now = self.clock()
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
