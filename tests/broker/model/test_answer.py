"""The native writer of answers (broker/model/_answer.c) against the protobuf runtime: the same
DirectiveBatch bytes for any directives, and the same refusals of values protobuf refuses."""

from __future__ import annotations

import math
import struct
import types
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from broker.model import pbwire
from broker.model.apply import BatchOutcome, Rejection
from broker.model.core import Directive, DirectiveKind
from broker.service import broker_service as service
from broker.service.broker_service import answer_bytes, outcome_to_pb
from kvbroker.v1 import directive_pb2 as dpb

native = pytest.importorskip("broker.model._answer", reason="the native writer is not built (KVBROKER_PURE_PYTHON=1)")

U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
# Text protobuf takes (no lone surrogates); ids and tier names may be any of it.
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
SCORES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 5e-324, -1.5]))


class Batch:
    """What answer_bytes reads of a batch (a BatchReader or an IntentBatch)."""

    def __init__(self, client_id: str, batch_seq: int) -> None:
        self.client_id = client_id
        self.batch_seq = batch_seq


@st.composite
def directives(draw: Any) -> Directive:
    return Directive(
        draw(U64),
        draw(st.sampled_from(list(DirectiveKind))),
        draw(TEXT),
        draw(st.sampled_from(["", "hbm", "dram", "nvme", "ténèbres"])),
        draw(st.sampled_from(["", "hbm", "dram", "nvme"])),
        draw(st.sampled_from(["", "deadline_edf", "lru"])),
        draw(SCORES),
        draw(TEXT),
        draw(I64),
        draw(U64),
        draw(U64),
    )


# Edge values: every field at its default (kind has none: 0 is no DirectiveKind); every field at its largest, negative int64s (ten
# bytes), non-ASCII text, lengths and values past one byte.
EMPTY = Directive(0, DirectiveKind.EVICT, "", "", "", "", 0.0, "", 0, 0, 0)
FULL = Directive(2**64 - 1, max(DirectiveKind), "块" * 50, "ténèbres", "nvme", "lru", -0.0, "r" * 200, -(2**63), 2**64 - 1, 2**64 - 1)
NEGATIVE = Directive(128, DirectiveKind.EVICT, "b", "hbm", "dram", "p", -1.5, "", -1, 1, 1)


def protobuf_bytes(batch: Batch, outcome: BatchOutcome, generation: int) -> bytes:
    return outcome_to_pb(batch, outcome, generation).SerializeToString()


@settings(max_examples=300, deadline=None)
@given(
    TEXT,
    U64,
    st.lists(directives(), max_size=20),
    st.integers(0, 2**32 - 1),
    st.booleans(),
    U64,
)
@example("", 0, [], 0, False, 0)
@example("", 0, [EMPTY], 0, False, 0)
@example("ténèbres", 2**64 - 1, [FULL, NEGATIVE, EMPTY], 2**32 - 1, True, 2**64 - 1)
def test_the_native_answer_is_the_bytes_protobuf_writes(
    client_id: str, seq: int, found: list[Directive], accepted: int, duplicate: bool, generation: int
) -> None:
    batch = Batch(client_id, seq)
    outcome = BatchOutcome(found, [], accepted, duplicate)
    written = native.encode_answer(client_id, seq, found, accepted, duplicate, generation)
    assert written == protobuf_bytes(batch, outcome, generation)
    assert answer_bytes(batch, outcome, generation) == written
    # And it reads back as the message (NaN scores compared by their bits).
    parsed = dpb.DirectiveBatch.FromString(written)
    assert [d.block_id for d in parsed.directives] == [d.block_id for d in found]
    bits = [struct.pack("<d", d.score) for d in parsed.directives]
    assert bits == [struct.pack("<d", d.score) for d in found]
    # The C writer mirrors broker.model.pbwire (its wire helpers): the same bytes again.
    assert written == pbwire_answer(client_id, seq, found, accepted, duplicate, generation)


def pbwire_answer(client_id: str, seq: int, found: list[Directive], accepted: int, duplicate: bool, generation: int) -> bytes:
    """The DirectiveBatch written with pbwire, fields in number order, defaults left out."""
    w = pbwire
    out = (w.field_str(1, client_id) if client_id else b"") + (w.field_varint(2, seq) if seq else b"")
    for d in found:
        body = (w.field_varint(1, d.directive_id) if d.directive_id else b"") + (w.field_int64(2, d.kind) if d.kind else b"")
        for number, text in ((3, d.block_id), (4, d.from_tier), (5, d.to_tier), (6, d.policy)):
            body += w.field_str(number, text) if text else b""
        body += w.field_double(7, d.score) if struct.pack("<d", d.score) != bytes(8) else b""
        body += w.field_str(8, d.reason) if d.reason else b""
        body += w.field_int64(9, d.arrive_by_us) if d.arrive_by_us else b""
        body += w.field_varint(10, d.size) if d.size else b""
        body += w.field_varint(11, d.generation) if d.generation else b""
        out += w.field_bytes(3, body)
    out += w.field_varint(5, accepted) if accepted else b""
    out += w.field_bool(6, True) if duplicate else b""
    return out + (w.field_varint(7, generation) if generation else b"")


def test_zero_scores_are_left_out_but_negative_zero_and_nan_are_written() -> None:
    """proto3 leaves a double out only when all its bits are zero."""
    for score, present in ((0.0, False), (-0.0, True), (math.nan, True), (1.0, True)):
        d = Directive(1, DirectiveKind.DEMOTE, "b", "hbm", "dram", "p", score, "r", 0, 1, 1)
        written = native.encode_answer("c", 1, [d], 1, False, 1)
        assert (b"\x39" + struct.pack("<d", score) in written) is present, score
        assert written == protobuf_bytes(Batch("c", 1), BatchOutcome([d], [], 1), 1)


@pytest.mark.parametrize(
    "field, value",
    [("directive_id", -1), ("directive_id", 2**64), ("size", -5), ("generation", 2**64), ("arrive_by_us", 2**63)],
)
def test_values_protobuf_refuses_are_refused_naming_the_field(field: str, value: int) -> None:
    d = Directive(1, DirectiveKind.DEMOTE, "b", "hbm", "dram", "p", 0.5, "r", 0, 1, 1)
    setattr(d, field, value)
    with pytest.raises(ValueError, match=field):
        native.encode_answer("c", 1, [d], 1, False, 1)
    with pytest.raises(ValueError):
        protobuf_bytes(Batch("c", 1), BatchOutcome([d], [], 1), 1)


def test_a_field_of_the_wrong_type_is_a_type_error_as_in_protobuf() -> None:
    """The writer reads attributes, as ``directive_to_pb`` does: an object with a str for an
    int is refused with the TypeError protobuf raises, not written."""
    good = Directive(1, DirectiveKind.DEMOTE, "b", "hbm", "dram", "p", 0.5, "r", 0, 1, 1)
    names = ("directive_id", "kind", "block_id", "from_tier", "to_tier", "policy", "score", "reason", "arrive_by_us", "size", "generation")
    fields = {name: getattr(good, name) for name in names}
    for name, wrong in (("directive_id", "1"), ("size", 1.5), ("block_id", 7), ("score", "high")):
        bad = types.SimpleNamespace(**{**fields, name: wrong})
        with pytest.raises(TypeError):
            native.encode_answer("c", 1, [bad], 1, False, 1)
        with pytest.raises(TypeError):
            protobuf_bytes(Batch("c", 1), BatchOutcome([bad], [], 1), 1)  # type: ignore[list-item]


def test_batch_fields_out_of_range_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="batch_seq"):
        native.encode_answer("c", -1, [], 1, False, 1)
    with pytest.raises(ValueError, match="accepted_events"):
        native.encode_answer("c", 1, [], 2**32, False, 1)
    with pytest.raises(ValueError, match="config_generation"):
        native.encode_answer("c", 1, [], 1, False, -1)
    with pytest.raises(TypeError, match="6 arguments"):
        native.encode_answer("c", 1, [])  # type: ignore[call-arg]
    with pytest.raises(UnicodeEncodeError):
        native.encode_answer("\ud800", 1, [], 1, False, 1)


def test_a_batch_with_rejections_goes_through_protobuf(monkeypatch: pytest.MonkeyPatch) -> None:
    d = Directive(7, DirectiveKind.EVICT, "b", "hbm", "", "p", 1.0, "r", 0, 1, 1)
    outcome = BatchOutcome([d], [Rejection(3, "accessed.block_ids[0]", "unknown block", "NOT_FOUND")], 4)
    batch = Batch("c", 9)
    expected = protobuf_bytes(batch, outcome, 2)
    assert answer_bytes(batch, outcome, 2) == expected
    assert dpb.DirectiveBatch.FromString(expected).rejections[0].field == "accessed.block_ids[0]"
    # Without the native writer every answer goes through protobuf, to the same bytes.
    monkeypatch.setattr(service, "answer_native", None)
    plain = BatchOutcome([d], [], 4)
    assert answer_bytes(batch, plain, 2) == native.encode_answer("c", 9, [d], 4, False, 2)
