"""broker.model.pbwire against protobuf's own encoding: each function writes the bytes
SerializeToString writes for the same field, on random and edge values, and the places
that write wire bytes by hand with it give messages that parse to the intended fields."""

from __future__ import annotations

import functools
import math
import struct
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from hypothesis import example, given, settings
from hypothesis import strategies as st

from broker.bench import workload
from broker.model import pbwire
from broker.service import security, server
from broker.service.broker_service import Answer
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb
from vllm_integration.decisions_to_vllm import intent_bytes as adapter_bytes

U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
# Text protobuf takes (no lone surrogates), non-ASCII included.
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=300)
# Field numbers protobuf allows, but not its reserved 19000..19999, with room for the
# probe's ten consecutive fields; small numbers (one-byte keys) drawn often.
FIELDS = st.one_of(st.integers(1, 30), st.integers(1, 2**29 - 10)).filter(lambda n: not 18_990 <= n <= 19_999)

_PROBE = (  # name, offset from the base number, type, label
    ("u64", 0, descriptor_pb2.FieldDescriptorProto.TYPE_UINT64),
    ("i64", 1, descriptor_pb2.FieldDescriptorProto.TYPE_INT64),
    ("flag", 2, descriptor_pb2.FieldDescriptorProto.TYPE_BOOL),
    ("raw", 3, descriptor_pb2.FieldDescriptorProto.TYPE_BYTES),
    ("text", 4, descriptor_pb2.FieldDescriptorProto.TYPE_STRING),
    ("real", 5, descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE),
    ("fixed", 6, descriptor_pb2.FieldDescriptorProto.TYPE_FIXED64),
    ("packed", 7, descriptor_pb2.FieldDescriptorProto.TYPE_UINT64),
    ("i32", 8, descriptor_pb2.FieldDescriptorProto.TYPE_INT32),
    ("f32", 9, descriptor_pb2.FieldDescriptorProto.TYPE_FIXED32),
)


@functools.cache
def probe(base: int) -> Any:
    """A proto2 message with one field of each kind, numbered from ``base``: proto2 fields
    have presence, so a zero, "" or false set is written (what ``field_*`` always write)."""
    file = descriptor_pb2.FileDescriptorProto(name=f"probe_{base}.proto", package="probe", syntax="proto2")
    message = file.message_type.add(name="Probe")
    for name, offset, kind in _PROBE:
        field = message.field.add(name=name, number=base + offset, type=kind)
        if name == "packed":
            field.label = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
            field.options.packed = True
        else:
            field.label = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("probe.Probe"))


def protobuf(base: int, **fields: Any) -> bytes:
    msg = probe(base)()
    for name, value in fields.items():
        if name == "packed":
            msg.packed.extend(value)
        else:
            setattr(msg, name, value)
    return bytes(msg.SerializeToString())


@settings(max_examples=300, deadline=None)
@given(FIELDS, U64)
@example(1, 0)
@example(1, 127)
@example(1, 128)
@example(2**29 - 10, 2**63 - 1)
@example(15, 2**64 - 1)
def test_field_varint_is_protobufs_uint64(base: int, value: int) -> None:
    written = pbwire.field_varint(base, value)
    assert written == protobuf(base, u64=value)
    assert probe(base).FromString(written).u64 == value


@settings(max_examples=300, deadline=None)
@given(FIELDS, I64)
@example(1, 0)
@example(1, -1)
@example(3, -(2**63))
@example(3, 2**63 - 1)
def test_field_int64_is_protobufs_int64_negative_in_ten_bytes(base: int, value: int) -> None:
    written = pbwire.field_int64(base + 1, value)
    assert written == protobuf(base, i64=value)
    assert probe(base).FromString(written).i64 == value
    if value < 0:
        assert len(pbwire.int64(value)) == 10


@settings(max_examples=100, deadline=None)
@given(FIELDS, st.integers(-(2**31), 2**31 - 1))
@example(1, -1)
def test_field_int64_writes_int32_as_protobuf_does(base: int, value: int) -> None:
    # An int32 (or an enum) is sign-extended to 64 bits on the wire, like an int64.
    assert pbwire.field_int64(base + 8, value) == protobuf(base, i32=value)


@settings(max_examples=50, deadline=None)
@given(FIELDS, st.booleans())
def test_field_bool_is_protobufs_bool(base: int, value: bool) -> None:
    assert pbwire.field_bool(base + 2, value) == protobuf(base, flag=value)


@settings(max_examples=200, deadline=None)
@given(FIELDS, st.binary(max_size=20_000))
@example(1, b"")
@example(1, b"x" * 127)
@example(1, b"x" * 128)
@example(1, b"x" * 16_384)
def test_field_bytes_is_protobufs_bytes(base: int, data: bytes) -> None:
    written = pbwire.field_bytes(base + 3, data)
    assert written == protobuf(base, raw=data)
    assert probe(base).FromString(written).raw == data


@settings(max_examples=300, deadline=None)
@given(FIELDS, TEXT)
@example(1, "")
@example(1, "ténèbres")
@example(1, "块" * 43)  # 129 bytes of UTF-8 from 43 characters: a two-byte length
@example(1, "\U0001f600")
def test_field_str_is_protobufs_string(base: int, text: str) -> None:
    written = pbwire.field_str(base + 4, text)
    assert written == protobuf(base, text=text)
    assert probe(base).FromString(written).text == text


@settings(max_examples=200, deadline=None)
@given(FIELDS, st.floats(allow_nan=False) | st.sampled_from([0.0, -0.0, math.inf, -math.inf, 5e-324]))
def test_field_double_is_protobufs_double(base: int, value: float) -> None:
    written = pbwire.field_double(base + 5, value)
    assert written == protobuf(base, real=value)
    assert struct.pack("<d", probe(base).FromString(written).real) == struct.pack("<d", value)


def test_field_double_keeps_a_nans_bits() -> None:
    # NaN != NaN: compared by bits, as the C writer's test does.
    written = pbwire.field_double(6, math.nan)
    assert written == protobuf(1, real=math.nan)


@settings(max_examples=100, deadline=None)
@given(FIELDS, U64)
@example(1, 0)
@example(1, 2**64 - 1)
def test_field_fixed64_is_protobufs_fixed64(base: int, value: int) -> None:
    written = pbwire.field_fixed64(base + 6, value)
    assert written == protobuf(base, fixed=value)
    assert probe(base).FromString(written).fixed == value


@settings(max_examples=200, deadline=None)
@given(FIELDS, st.lists(U64, max_size=100))
@example(1, [])
@example(1, [0])
@example(1, [2**64 - 1] * 13)  # 130 bytes: a two-byte length
def test_field_packed_is_protobufs_packed_repeated_uint64(base: int, values: list[int]) -> None:
    written = pbwire.field_packed(base + 7, values)
    assert written == protobuf(base, packed=values)
    assert list(probe(base).FromString(written).packed) == values


@settings(max_examples=200, deadline=None)
@given(FIELDS, st.sampled_from([("u64", 0, 1), ("real", 1, 1.0), ("raw", 2, b"x"), ("f32", 5, 1)]))
@example(2**29 - 10, ("f32", 5, 1))  # the largest field number
def test_tag_is_the_key_protobuf_writes(base: int, case: tuple[str, int, Any]) -> None:
    # The probe's field of that wire type: its serialization starts with exactly this key.
    name, wire_type, value = case
    number = base + {n: o for n, o, _ in _PROBE}[name]
    assert protobuf(base, **{name: value}).startswith(pbwire.tag(number, wire_type))


@pytest.mark.parametrize(("value", "reason"), [(-1, "varint"), (-(2**70), "varint"), (2**64, "varint")])
def test_varint_refuses_what_a_uint64_does_not_hold(value: int, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        pbwire.varint(value)
    with pytest.raises(ValueError, match=reason):
        pbwire.field_varint(1, value)


@pytest.mark.parametrize("value", [-(2**63) - 1, 2**63])
def test_int64_refuses_what_an_int64_does_not_hold(value: int) -> None:
    with pytest.raises(ValueError, match="int64"):
        pbwire.int64(value)


def test_fixed64_refuses_what_it_does_not_hold() -> None:
    with pytest.raises(ValueError, match="fixed64"):
        pbwire.field_fixed64(1, -1)


@pytest.mark.parametrize(
    ("field", "wire_type", "reason"), [(0, 0, "field number"), (2**29, 0, "field number"), (1, 3, "wire type"), (1, 7, "wire type")]
)
def test_tag_refuses_bad_numbers_and_wire_types(field: int, wire_type: int, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        pbwire.tag(field, wire_type)


def _messages() -> list[Any]:
    out = []
    for module in (pb, dpb, spb):
        for descriptor in module.DESCRIPTOR.message_types_by_name.values():
            out.append(getattr(module, descriptor.name))
    return out


def _set_one(message: Any, name: str) -> None:
    field = message.DESCRIPTOR.fields_by_name[name]
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        entry = field.message_type.fields_by_name
        container = getattr(message, name)
        if entry["value"].type == field.TYPE_MESSAGE:
            container[entry["key"].default_value].SetInParent()
        else:
            container[entry["key"].default_value] = entry["value"].default_value
        return
    if field.type == field.TYPE_MESSAGE:
        (getattr(message, name).add() if field.is_repeated else getattr(message, name)).SetInParent()
        return
    value: Any = {field.TYPE_STRING: "x", field.TYPE_BYTES: b"x", field.TYPE_BOOL: True}.get(field.type, 1)
    if field.type in (field.TYPE_DOUBLE, field.TYPE_FLOAT):
        value = 1.0
    if field.is_repeated:
        getattr(message, name).append(value)
    else:
        setattr(message, name, value)


@pytest.mark.parametrize("message", _messages(), ids=lambda m: m.DESCRIPTOR.name)
def test_key_is_the_key_protobuf_writes_for_every_field_of_the_schema(message: Any) -> None:
    for field in message.DESCRIPTOR.fields:
        one = message()
        _set_one(one, field.name)
        assert one.SerializeToString().startswith(pbwire.key(message, field.name)), field.full_name


def test_key_names_a_field_the_message_does_not_have() -> None:
    with pytest.raises(ValueError, match=r"kvbroker\.v1\.IntentBatch has no field 'tenants'"):
        pbwire.key(pb.IntentBatch, "tenants")


# A whole MemoryIntent and IntentBatch written with the field functions, as protobuf writes
# them: fields in number order, proto3 defaults left out, optional ones written when set.
INTENTS = st.fixed_dictionaries(
    {
        "block_id": TEXT,
        "request_id": TEXT,
        "phase": st.integers(0, 6),
        "priority": st.integers(-5, 4),
        "deadline_us": st.none() | I64,
        "size_bytes": U64,
        "is_draft": st.booleans(),
        "tenant": TEXT,
        "token_start": U64,
        "allowed_tiers": st.lists(TEXT, max_size=3),
        "request_priority": st.none() | st.integers(0, 2**32 - 1),
    }
)


def intent_bytes(f: dict[str, Any]) -> bytes:
    out = b""
    if f["block_id"]:
        out += pbwire.field_str(1, f["block_id"])
    if f["request_id"]:
        out += pbwire.field_str(2, f["request_id"])
    if f["phase"]:
        out += pbwire.field_int64(3, f["phase"])
    if f["priority"]:
        out += pbwire.field_int64(4, f["priority"])
    if f["deadline_us"] is not None:
        out += pbwire.field_int64(5, f["deadline_us"])
    if f["size_bytes"]:
        out += pbwire.field_varint(9, f["size_bytes"])
    if f["is_draft"]:
        out += pbwire.field_bool(11, True)
    if f["tenant"]:
        out += pbwire.field_str(13, f["tenant"])
    if f["token_start"]:
        out += pbwire.field_varint(16, f["token_start"])
    for tier in f["allowed_tiers"]:
        out += pbwire.field_str(18, tier)
    if f["request_priority"] is not None:
        out += pbwire.field_varint(20, f["request_priority"])
    return out


@settings(max_examples=300, deadline=None)
@given(INTENTS, TEXT, U64, st.lists(I64, max_size=4), st.lists(U64, max_size=5))
def test_a_batch_written_with_pbwire_is_the_batch_protobuf_writes(
    f: dict[str, Any], client: str, seq: int, stamps: list[int], positions: list[int]
) -> None:
    intent = pb.MemoryIntent(**f)
    raw_intent = intent_bytes(f)
    assert raw_intent == intent.SerializeToString()
    assert pb.MemoryIntent.FromString(raw_intent) == intent

    events_pb = [pb.Event(ts_us=ts, allocated=pb.BlockAllocated(intent=intent)) for ts in stamps]
    events_pb.append(pb.Event(accessed=pb.BlocksAccessed(token_positions=positions)))
    batch_pb = pb.IntentBatch(client_id=client, batch_seq=seq, events=events_pb)
    allocated = pbwire.field_bytes(2, pbwire.field_bytes(1, raw_intent))
    raw_events = [(pbwire.field_int64(1, ts) if ts else b"") + allocated for ts in stamps]
    raw_events.append(pbwire.field_bytes(3, pbwire.field_packed(4, positions)))
    raw = (pbwire.field_str(1, client) if client else b"") + (pbwire.field_varint(2, seq) if seq else b"")
    raw += b"".join(pbwire.length_delimited(pbwire.key(pb.IntentBatch, "events"), e) for e in raw_events)
    assert raw == batch_pb.SerializeToString()
    assert pb.IntentBatch.FromString(raw) == batch_pb


# The places that write wire bytes by hand with pbwire (vllm_integration/decisions_to_vllm/intent_bytes.py has its own
# test, tests/vllm_integration/decisions_to_vllm/test_intent_bytes.py; the C answer writer tests/broker/model/test_answer.py).


@settings(max_examples=100, deadline=None)
@given(TEXT, U64, TEXT)
def test_the_servers_hand_written_fields_parse_as_intended(client: str, seq: int, tenant: str) -> None:
    batch = pb.IntentBatch(client_id=client, batch_seq=seq, events=[pb.Event(ts_us=1, cleared=pb.AllBlocksCleared())])
    stamped, now = server.stamped(batch.SerializeToString())
    assert now > 0
    expected = pb.IntentBatch()
    expected.CopyFrom(batch)
    expected.broker_received_us = now
    assert pb.IntentBatch.FromString(stamped) == expected
    # The tenant the broker decides, appended, is the tenant read (the last value wins).
    expected.tenant = tenant
    assert pb.IntentBatch.FromString(stamped + security.tenant_field(tenant)) == expected
    answer = dpb.DirectiveBatch(client_id=client, batch_seq=seq, directives=[dpb.Directive(directive_id=seq, block_id=tenant)])
    wrapped = Answer(answer.SerializeToString(), 1, 0, False)
    assert server.stream_response_bytes(wrapped) == spb.StreamResponse(directives=answer).SerializeToString()
    assert server.submit_response_bytes(wrapped) == spb.SubmitResponse(directives=answer).SerializeToString()


@settings(max_examples=100, deadline=None)
@given(TEXT, U64, st.lists(st.integers(0, 2**62), min_size=1, max_size=5))
def test_the_bench_workloads_requests_parse_as_intended(client: str, seq: int, stamps: list[int]) -> None:
    blob = b"".join(workload.cleared_events(ts) for ts in stamps)
    raw = workload.stream_request(client.encode(), seq, blob)
    batch = pb.IntentBatch(client_id=client, batch_seq=seq, events=[pb.Event(ts_us=ts, cleared=pb.AllBlocksCleared()) for ts in stamps])
    # client_id is written even when empty (protobuf leaves it out): the same message.
    assert spb.StreamRequest.FromString(raw) == spb.StreamRequest(batch=batch)


@settings(max_examples=100, deadline=None)
@given(TEXT, TEXT, U64, st.lists(st.integers(0, 2**63 - 1), max_size=5))
def test_the_adapters_batches_parse_as_intended(client: str, tenant: str, seq: int, stamps: list[int]) -> None:
    head = adapter_bytes.batch_head(client, tenant)
    raw = adapter_bytes.batch(head, seq, [adapter_bytes.cleared(adapter_bytes.timestamp(ts)) for ts in stamps])
    expected = pb.IntentBatch(
        client_id=client, batch_seq=seq, tenant=tenant, events=[pb.Event(ts_us=ts, cleared=pb.AllBlocksCleared()) for ts in stamps]
    )
    assert pb.IntentBatch.FromString(raw) == expected
