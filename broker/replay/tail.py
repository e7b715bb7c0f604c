"""Whether a journal holds every batch its writers counted: the check behind ``replay
--verify`` beside the directives' (a journal whose tail was lost must not verify as whole).

A writer that closes appends a trailer (broker.journal.trailer) counting the batches it
appended, by client and batch seq (a client of a tenant named as the cores name it,
``client_key``: tenants number their batches apart). Each trailer's batches are looked up in the journal:
fewer than counted is a cut journal. Batches no trailer covers come from a writer that
left none (killed, or its last records, the trailer among them, could not be written):
whether their tail is whole cannot be told.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator
from typing import Literal

from broker.journal import JournalError, JournalSource, RecordKind
from broker.journal.trailer import Trailer
from broker.model.apply import client_key
from broker.model.wire import read_batch

TailState = Literal["complete", "cut", "unknown"]


@dataclasses.dataclass(frozen=True)
class TailCheck:
    state: TailState
    # Batches the trailers counted that the journal lacks.
    missing: int
    # One line saying what was found ("" when complete).
    message: str


def check_tail(source: JournalSource) -> TailCheck:
    seqs: dict[str, list[int]] = {}
    for record in source.batches():
        batch = read_batch(record.payload)
        seqs.setdefault(client_key(batch.tenant, batch.client_id), []).append(batch.batch_seq)
    for found in seqs.values():
        found.sort()
    covered: dict[str, int] = {}
    missing = 0
    cuts: list[str] = []
    for trailer in _trailers(source):
        found = seqs.get(trailer.client_id, [])
        lo = bisect.bisect_left(found, trailer.first_seq)
        hi = bisect.bisect_right(found, trailer.last_seq)
        covered[trailer.client_id] = covered.get(trailer.client_id, 0) + hi - lo
        lacking = trailer.batches - (hi - lo)
        if lacking > 0:
            missing += lacking
            cuts.append(f"client {_named(trailer.client_id)}: {hi - lo} of {trailer.batches}{_first_missing(trailer, found[lo:hi])}")
    if missing:
        return TailCheck("cut", missing, f"the journal lacks {missing} batches its writer counted ({'; '.join(cuts)})")
    uncounted = {client: len(found) - covered.get(client, 0) for client, found in seqs.items()}
    uncounted = {client: n for client, n in uncounted.items() if n > 0}
    if uncounted:
        which = ", ".join(f"{n} batches of client {_named(client)}" for client, n in sorted(uncounted.items()))
        return TailCheck(
            "unknown",
            0,
            f"cannot tell whether the journal's tail is whole: {which} have no writer's trailer counting them "
            "(a writer that was killed, or whose last records were lost, leaves none: kvbroker serve writes its "
            "trailers at a clean stop, SIGTERM or SIGINT, not when killed)",
        )
    return TailCheck("complete", 0, "")


def _trailers(source: JournalSource) -> Iterator[Trailer]:
    """The journal's trailers; a record that is none (forged, damaged) is a JournalError
    naming where it is."""
    for index, record in enumerate(source.trailers()):
        try:
            yield Trailer.from_record(record)
        except JournalError as exc:
            raise JournalError(f"{source.where(index, RecordKind.TRAILER)}: {exc}") from None


def _named(key: str) -> str:
    """A client key as a person reads it: "engine-0" or "engine-0 (tenant acme)"."""
    tenant, sep, client = key.partition("\x00")
    return f"{client} (tenant {tenant})" if sep else key


def _first_missing(trailer: Trailer, found: list[int]) -> str:
    """The first batch seq the journal lacks, as ", first missing batch seq S", when the
    writer numbered its batches one by one (the embedded core does); else nothing."""
    if trailer.last_seq - trailer.first_seq + 1 != trailer.batches:
        return ""
    for expected, seq in enumerate(found, trailer.first_seq):
        if seq != expected:
            return f", first missing batch seq {expected}"
    return f", first missing batch seq {trailer.first_seq + len(found)}"
