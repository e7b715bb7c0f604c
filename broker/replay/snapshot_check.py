"""``replay --verify`` of a journal's snapshots (broker.journal.snapshots): replaying the
journal as a restart from its first record does, the state at each mark must be the state
its snapshot holds (their ``fingerprint``s equal)."""

from __future__ import annotations

import dataclasses

from broker.config import ConfigError, core_from_json
from broker.journal import JournalSource, file_path, is_file_url
from broker.journal.records import JournalError, RecordKind
from broker.journal.snapshots import MARK, fingerprint, load_state, parse
from broker.journal.stream import last_snapshot, stream_records
from broker.model.apply import apply_batch
from broker.model.arms import Driving
from broker.model.wire import read_batch


@dataclasses.dataclass(frozen=True)
class SnapshotCheck:
    checked: int = 0
    wrong: int = 0
    # The first wrong one: which, where, and why.
    message: str = ""


def check_snapshots(source: JournalSource) -> SnapshotCheck:
    """Check every complete snapshot of a file journal (Redis journals hold none)."""
    if not is_file_url(source.url):
        return SnapshotCheck()
    path = file_path(source.url)
    if last_snapshot(path) is None:
        return SnapshotCheck()
    driving: Driving | None = None
    at_mark: dict[int, str] = {}
    checked = wrong = 0
    message = ""
    for offset, record in stream_records(path):
        if record.kind == RecordKind.CONFIG:
            try:
                config = core_from_json(record.payload.decode())
            except (ConfigError, UnicodeDecodeError):
                return SnapshotCheck(checked, wrong, message)  # the replay itself names it
            if driving is None:
                driving = Driving(config, record.generation)
            else:
                driving.follow(config, record.generation)
        elif record.kind == RecordKind.BATCH and driving is not None:
            batch = read_batch(record.payload)
            core = driving.core_for(batch.client_id)
            core.generation = record.generation
            apply_batch(core, batch)
            core.take_directives()
        elif record.kind == RecordKind.SNAPSHOT and driving is not None:
            try:
                number, part = parse(record.payload)
            except JournalError:
                continue  # repair names it
            if part == MARK:
                at_mark[number] = fingerprint(driving)
                continue
            expected = at_mark.pop(number, None)
            if expected is None:
                continue
            checked += 1
            try:
                same = fingerprint(load_state(record.payload)) == expected
                why = "its state differs from the replay's at its mark"
            except JournalError as exc:
                same, why = False, str(exc)
            if not same:
                wrong += 1
                message = message or f"snapshot {number} (the state record at byte offset {offset} of {path}): {why}"
    return SnapshotCheck(checked, wrong, message)
