"""A writer's closing count (RecordKind.TRAILER): what it appended since it opened the
journal, so that a reader can tell a whole journal from one whose tail was lost.

The payload is JSON: the writer's ``client_id``, the ``first_seq`` and ``last_seq`` of the
batches it appended (its own batch numbering) and their number, ``batches``. A writer that
was killed, or whose last records could not be written, leaves none: its batches then have
no count to be checked against, and a reader says it cannot tell whether the tail is whole.
"""

from __future__ import annotations

import dataclasses
import json

from broker.journal.records import JournalError, JournalRecord, RecordKind


@dataclasses.dataclass(frozen=True)
class Trailer:
    client_id: str
    first_seq: int
    last_seq: int
    batches: int

    def record(self, schema_major: int, generation: int) -> JournalRecord:
        return JournalRecord(RecordKind.TRAILER, schema_major, generation, json.dumps(dataclasses.asdict(self)).encode())

    @classmethod
    def from_record(cls, record: JournalRecord) -> Trailer:
        try:
            data = json.loads(record.payload)
            trailer = cls(str(data["client_id"]), int(data["first_seq"]), int(data["last_seq"]), int(data["batches"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise JournalError(f"malformed trailer record ({type(exc).__name__}: {exc})") from None
        return trailer
