"""A replay source read once into memory, so that many jobs elsewhere replay it without
reading the journal or importing the trace again (broker.replay.ray_runner puts one in
Ray's object store per source: each node fetches it once, whatever the number of jobs).

What a job replays from it is exactly what it would have read itself: a journal's batches
as the bytes the broker journaled, its later config changes in place; a trace's imported
batches serialized (the replay reads both the same way, broker.model.wire).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

from broker.config import CoreConfig
from broker.journal.records import JournalRecord
from broker.replay.replay import BatchSource
from broker.replay.traces import SkipCounter


@dataclasses.dataclass(frozen=True)
class SourceData:
    """(config generation, batch bytes or a later CoreConfig) in replay order, the lines an
    importer skipped (--skip-bad), and the journaled directives when a job verifies."""

    items: tuple[tuple[int, bytes | CoreConfig], ...]
    skipped_lines: int = 0
    expected: tuple[JournalRecord, ...] | None = None

    @property
    def batch_count(self) -> int:
        return sum(1 for _, item in self.items if not isinstance(item, CoreConfig))

    @property
    def event_count(self) -> int:
        from broker.replay.progress import events_in

        return sum(events_in(item) for _, item in self.items if isinstance(item, bytes))

    def batches(self) -> BatchSource:
        items = self.items

        def source() -> Iterator[tuple[int, Any]]:
            return iter(items)

        return source

    def directives(self) -> Iterator[JournalRecord]:
        if self.expected is None:
            raise ValueError("this source was read without its directives (no job of it verifies)")
        return iter(self.expected)


def preread(batches: BatchSource, skips: SkipCounter, expected: Iterable[JournalRecord] | None = None) -> SourceData:
    """Read a source's batches (``Source.batches()``) once, and its directives if given."""
    items: list[tuple[int, bytes | CoreConfig]] = []
    for generation, batch in batches():
        if isinstance(batch, (bytes, CoreConfig)):
            items.append((generation, batch))
        else:  # an imported trace's IntentBatch
            items.append((generation, batch.SerializeToString()))
    return SourceData(tuple(items), skips.skipped, None if expected is None else tuple(expected))
