"""Is a journal record's payload what its kind says?

A record's checksum proves its bytes are the ones written, not that they are a batch: a
writer with a bug, or a file made by hand, can frame garbage with a right CRC. Readers do
not parse every payload up front (a batch is parsed once, where it is applied: checking
first would cost replay about 15%); ``repair`` checks every one, and the readers name the
record when its payload fails where it is applied (``BadRecord``).
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from broker.config import ConfigError, core_from_json
from broker.journal.records import JournalError, JournalRecord, RecordKind
from broker.journal.trailer import Trailer
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb


class BadRecord(JournalError):
    """A record with a sound frame and checksum whose payload is not what its kind says.
    ``index``: its place in the records read (0-based), for the reader to say where it is."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"record {index}: {reason}")
        self.index = index
        self.reason = reason

    def __reduce__(self) -> tuple[type[BadRecord], tuple[int, str]]:
        return (type(self), (self.index, self.reason))  # crosses from a replay worker by pickle


def payload_problem(record: JournalRecord) -> str | None:
    """Why the payload is not a valid record of its kind, or None."""
    if record.kind == RecordKind.SNAPSHOT:
        return snapshot_problem(record)
    try:
        if record.kind == RecordKind.BATCH:
            pb.IntentBatch.FromString(record.payload)
        elif record.kind == RecordKind.DIRECTIVES:
            dpb.DirectiveBatch.FromString(record.payload)
        elif record.kind == RecordKind.TRAILER:
            Trailer.from_record(record)  # a writer's closing count: kept, as replay --verify reads it
        else:
            core_from_json(record.payload.decode())
    except DecodeError as exc:
        kind = "IntentBatch" if record.kind == RecordKind.BATCH else "DirectiveBatch"
        return f"its payload ({len(record.payload)} bytes) is not a valid {kind} ({exc})"
    except UnicodeDecodeError as exc:
        return f"its config payload is not UTF-8 ({exc.reason} at byte {exc.start})"
    except JournalError as exc:  # only a trailer's check raises it
        return f"its trailer payload is not a trailer ({str(exc).removeprefix('malformed trailer record').lstrip(': ')})"
    except ConfigError as exc:
        return f"its config payload is not a config ({str(exc).removeprefix('journaled config is not readable: ')})"
    return None


def snapshot_problem(record: JournalRecord) -> str | None:
    """A SNAPSHOT record's header is checked; a state's body is read only where a restart
    starts from it (it falls back to the journal's first record) and by ``replay --verify``."""
    from broker.journal.snapshots import parse

    try:
        parse(record.payload)
    except JournalError as exc:
        return str(exc)
    return None


def batch_problem(exc: Exception) -> str:
    """The reason of a batch payload that failed to parse where it was applied."""
    return f"its payload is not a valid IntentBatch ({exc})"


def config_problem(exc: Exception) -> str:
    return f"its config payload is not a config ({str(exc).removeprefix('journaled config is not readable: ')})"
