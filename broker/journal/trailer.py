"""A writer's closing count (RecordKind.TRAILER): what it appended since it opened the
journal, so that a reader can tell a whole journal from one whose tail was lost.

The payload is JSON: the writer's ``client_id``, the ``first_seq`` and ``last_seq`` of the
batches it appended (its own batch numbering) and their number, ``batches``. A writer that
was killed, or whose last records could not be written, leaves none: its batches then have
no count to be checked against, and a reader says it cannot tell whether the tail is whole.

A writer serving many clients (``kvbroker serve``) writes one trailer per client, each
numbering its own batches (``TrailerTally``); the embedded core writes one, its own.
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
        """The trailer a record holds; JournalError naming what is wrong with a payload that
        is not one (a forged or damaged record: numbers like 1e400, nesting 100k deep)."""
        try:
            data = json.loads(record.payload)
        except RecursionError:  # nested deeper than the parser's stack
            raise JournalError("malformed trailer record: nested too deep") from None
        except ValueError as exc:  # not UTF-8, not JSON
            raise JournalError(f"malformed trailer record ({type(exc).__name__}: {exc})") from None
        if not isinstance(data, dict):
            raise JournalError(f"malformed trailer record: expected a JSON object, got {type(data).__name__}")
        client_id = data.get("client_id")
        if not isinstance(client_id, str):
            raise JournalError(f"malformed trailer record: client_id: expected a string, got {type(client_id).__name__}")
        counts: list[int] = []
        for key in COUNTS:
            value = data.get(key)
            # Exact ints only: 1e400 is a float (inf) that int() cannot take, and a float
            # count is no count.
            if type(value) is not int or not 0 <= value < 2**64:
                raise JournalError(f"malformed trailer record: {key}: expected an integer in 0..2^64-1, got {_shown(value)}")
            counts.append(value)
        return cls(client_id, *counts)


COUNTS = ("first_seq", "last_seq", "batches")


def _shown(value: object) -> str:
    text = json.dumps(value) if isinstance(value, int | float) and not isinstance(value, bool) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


class TrailerTally:
    """The batches one writer journaled, client by client: the trailers it writes as it
    closes. One dict entry per client (as the cores' ``client_seq``), updated in O(1) per
    batch on the request path."""

    def __init__(self) -> None:
        # client id -> [lowest batch seq, highest batch seq, batches]. Lowest and highest,
        # not first and last: one client id under two tenants numbers its batches twice,
        # and the reader counts the client's batches between the two (broker.replay.tail).
        self._clients: dict[str, list[int]] = {}

    def add(self, client_id: str, seq: int) -> None:
        counts = self._clients.get(client_id)
        if counts is None:
            self._clients[client_id] = [seq, seq, 1]
            return
        if seq < counts[0]:
            counts[0] = seq
        elif seq > counts[1]:
            counts[1] = seq
        counts[2] += 1

    def trailers(self) -> list[Trailer]:
        return [Trailer(client, low, high, batches) for client, (low, high, batches) in self._clients.items()]
