"""``serve``'s snapshots (broker.journal.snapshots): every ``journal.snapshot_batches``
batches, a mark in the journal and a forked copy of the driving cores; their state record
once the copy has arrived. The event loop pays the fork (a few ms) and the append, never
the pickling (broker.service.forked_copy)."""

from __future__ import annotations

import logging

from broker.journal.base import Journal
from broker.journal.records import BODY, MAX_RECORD
from broker.journal.snapshots import HEAD, dump_state, mark_record, state_record
from broker.model.arms import Driving
from broker.service.forked_copy import ForkedCopy, forking_available

log = logging.getLogger("kvbroker.service")


class SnapshotWriter:
    def __init__(self, journal: Journal, every: int, schema_major: int) -> None:
        self.journal = journal
        self.every = every
        self.schema_major = schema_major
        self.since = 0
        self.number = 0
        self.written = 0
        self.copy: ForkedCopy | None = None
        self._generation = 0

    def after_batch(self, driving: Driving, generation: int) -> None:
        """One batch was journaled: write the state that has arrived, and mark (and start
        copying) a new snapshot when one is due."""
        if self.copy is not None and self.copy.done():
            self._write_state()
        self.since += 1
        if not self.every or self.since < self.every or self.copy is not None or not forking_available():
            return
        self.since = 0
        self.number += 1
        self._generation = generation
        self.journal.append(mark_record(self.number, self.schema_major, generation))
        try:
            self.copy = ForkedCopy(lambda: dump_state(driving))
        except OSError as exc:  # no memory or process left to fork: no snapshot this time
            log.warning("snapshot %d not taken: cannot fork (%s)", self.number, exc)

    def _write_state(self) -> None:
        copy, self.copy = self.copy, None
        assert copy is not None
        if copy.error is not None:
            log.warning("snapshot %d not written: %s", self.number, copy.error)
            return
        state: bytes = copy.result
        if BODY.size + HEAD.size + len(state) > MAX_RECORD:
            log.warning("snapshot %d not written: its %d bytes exceed a record's %d", self.number, len(state), MAX_RECORD)
            return
        self.journal.append(state_record(self.number, self.schema_major, self._generation, state))
        self.written += 1
        log.info("snapshot %d written: %d bytes", self.number, len(state))
