"""The native reader of IntentBatch bytes (broker/model/_wire.c) against the reference reader
(broker/model/wire.py, over the protobuf runtime), which defines what a batch means.

- On well-formed batches with values anywhere in their fields' ranges, the two yield the
  same header and the same event tuples, with and without a block dict.
- On fuzzed bytes (random, truncated, hand-built with wrong wire types, duplicate fields,
  invalid UTF-8, overlong varints), the native reader either refuses with Unsupported or
  agrees with the reference; it never accepts what protobuf rejects.
- The encodings it refuses (a sub-message given twice, which protobuf merges) still read
  right through ``read_batch``, which falls back to the reference reader.
- Block ids are looked up when an event is read, not when the batch is scanned; reading
  leaks no references.

Examples per test: ``KVBROKER_FUZZ_EXAMPLES`` (default 100).
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.model import wire
from kvbroker.v1 import intent_pb2 as pb
from tests.broker.service.test_fuzz_server import FUZZ_EXAMPLES, extreme_event, ld, tag, valid_event, vi, wire_message

pytestmark = pytest.mark.skipif(wire.native is None, reason="the native reader is not built (KVBROKER_PURE_PYTHON=1)")

FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)

# Stand-ins for the core's blocks: the readers only look them up.
BLOCKS = {name: object() for name in ("a", "b", "c")}


def native_read(raw: bytes, blocks: dict[str, Any] | None) -> tuple[tuple[Any, ...], list[tuple[Any, ...]]]:
    assert wire.native is not None
    reader = wire.native.BatchReader(raw)
    return (reader.client_id, reader.batch_seq, reader.tenant, reader.count), list(reader.events(blocks))


def reference_read(raw: bytes, blocks: dict[str, Any] | None) -> tuple[tuple[Any, ...], list[tuple[Any, ...]]]:
    reader = wire.ReferenceReader(pb.IntentBatch.FromString(raw))
    return (reader.client_id, reader.batch_seq, reader.tenant, reader.count), list(reader.events(blocks))


eviction_event = st.builds(
    lambda t, tier, count, ids: pb.Event(ts_us=t, eviction_requested=pb.EvictionRequested(tier=tier, count=count, protected_block_ids=ids)),
    st.integers(0, 2**63 - 1),
    st.sampled_from(["", "hbm", "ünï"]),
    st.one_of(st.integers(0, 10), st.just(2**32 - 1)),
    st.lists(st.sampled_from(["a", "b", "", "zz", "ü"]), max_size=4),
)

# Request-scoped uses: a scope, positions (any uint64), a scope's end, a scoped allocation.
scoped_event = st.one_of(
    st.builds(
        lambda t, ids, scope, at, ends, refresh: pb.Event(
            ts_us=t,
            accessed=pb.BlocksAccessed(block_ids=ids, scope=scope, token_positions=at, ends_scope=ends, refresh_only=refresh),
        ),
        st.integers(0, 2**63 - 1),
        st.lists(st.sampled_from(["a", "b", "zz", "ü"]), max_size=4),
        st.sampled_from(["", "r1", "ünï"]),
        st.lists(st.one_of(st.integers(0, 2**20), st.just(2**64 - 1)), max_size=4),
        st.sampled_from(["", "r1", "r2"]),
        st.booleans(),
    ),
    st.builds(
        lambda t, scope, start: pb.Event(
            ts_us=t,
            allocated=pb.BlockAllocated(intent=pb.MemoryIntent(block_id="a", size_bytes=1, token_start=start), scope=scope),
        ),
        st.integers(0, 2**63 - 1),
        st.sampled_from(["", "r1", "ünï"]),
        st.integers(0, 2**64 - 1),
    ),
)

batches = st.builds(
    lambda client, seq, tenant, events: pb.IntentBatch(client_id=client, batch_seq=seq, tenant=tenant, events=events),
    st.sampled_from(["", "c1", "ünï"]),
    st.one_of(st.integers(0, 10), st.just(2**64 - 1)),
    st.sampled_from(["", "t1"]),
    st.lists(
        st.one_of(
            valid_event(),
            extreme_event(),
            st.just(pb.Event(ts_us=3)),
            st.just(pb.Event(cleared=pb.AllBlocksCleared())),
            eviction_event,
            scoped_event,
        ),
        max_size=12,
    ),
)


@FUZZ
@given(batches, st.booleans())
def test_native_equals_reference_on_well_formed_batches(batch: pb.IntentBatch, with_blocks: bool) -> None:
    raw = batch.SerializeToString()
    blocks = BLOCKS if with_blocks else None
    assert native_read(raw, blocks) == reference_read(raw, blocks)


@FUZZ
@given(st.one_of(wire_message("IntentBatch"), st.binary(max_size=64)), st.booleans())
def test_native_refuses_or_agrees_on_fuzzed_bytes(raw: bytes, with_blocks: bool) -> None:
    assert wire.native is not None
    blocks = BLOCKS if with_blocks else None
    try:
        expected = reference_read(raw, blocks)
    except DecodeError:
        with pytest.raises(wire.native.Unsupported):
            wire.native.BatchReader(raw)
        with pytest.raises(DecodeError):
            wire.read_batch(raw)
        return
    try:
        got = native_read(raw, blocks)
    except wire.native.Unsupported:
        got = None
    assert got is None or got == expected
    # Either way read_batch reads what protobuf reads.
    reader = wire.read_batch(raw)
    assert ((reader.client_id, reader.batch_seq, reader.tenant, reader.count), list(reader.events(blocks))) == expected


def event_bytes(ts: int, field: int, body: bytes) -> bytes:
    return vi(1, ts) + ld(field, body)


def test_token_positions_unpacked_are_refused_natively_and_read_by_the_reference() -> None:
    """Protobuf also reads a repeated uint64 written one varint per value (unpacked). No
    protobuf library writes it so for proto3; the native reader reads only the packed form
    and refuses this one, and read_batch falls back."""
    assert wire.native is not None
    body = ld(1, b"a") + ld(3, b"r1") + vi(4, 7) + vi(4, 300)
    raw = ld(1, b"c1") + vi(2, 1) + ld(3, event_bytes(7, 3, body))
    with pytest.raises(wire.native.Unsupported):
        wire.native.BatchReader(raw)
    (event,) = list(wire.read_batch(raw).events())
    assert event[wire.X_SCOPE] == "r1" and event[wire.X_POSITIONS] == [7, 300]
    packed = ld(1, b"a") + ld(3, b"r1") + ld(4, bytes([7]) + bytes([0xAC, 0x02])) + ld(5, b"r0")
    raw = ld(1, b"c1") + vi(2, 1) + ld(3, event_bytes(7, 3, packed))
    (event,) = list(wire.native.BatchReader(raw).events())
    assert event[wire.X_SCOPE :] == ("r1", [7, 300], "r0", False)


def test_a_merged_encoding_is_refused_natively_and_read_by_the_reference() -> None:
    """The same sub-message twice: protobuf merges the two (the intent gets both block_id
    and size). The native reader refuses it; read_batch falls back and merges."""
    assert wire.native is not None
    allocated_twice = ld(1, ld(1, b"x")) + ld(1, vi(9, 4096))
    raw = ld(1, b"c1") + vi(2, 1) + ld(3, event_bytes(7, 2, allocated_twice))
    with pytest.raises(wire.native.Unsupported):
        wire.native.BatchReader(raw)
    reader = wire.read_batch(raw)
    assert isinstance(reader, wire.ReferenceReader)
    (event,) = list(reader.events())
    assert event[0] == wire.ALLOCATED and event[wire.A_BLOCK_ID] == "x" and event[wire.A_SIZE] == 4096


@pytest.mark.parametrize(
    "raw",
    [
        ld(1, b"c1") + ld(1, b"c2"),  # a scalar given twice: the last wins in protobuf
        ld(3, vi(1, 1) + vi(1, 2)),  # ts_us twice
        ld(3, ld(3, ld(1, b"a")) + ld(6, ld(1, b"a"))),  # two members of the oneof
        ld(3, ld(3, tag(1, 0) + b"\x01")),  # block_ids with a varint wire type
        # A key in 6 bytes (an unknown field's, value small): protobuf takes a key of 5
        # bytes at most and rejects this one as malformed (found by atheris).
        b"\x1a\x00\xf8\xff\xff\xff\x80\x00\x03\xc2\x00\x00",
        ld(1, b"c") + b"\xc8\x80\x80\x80\x80\x00\x01",  # field 25 as a varint, key overlong to 6 bytes
        b"\x1a\x80\x80\x80\x80\x80\x80\x80\x00",  # an event's length (0) in 8 bytes (atheris)
        b"\x0a\x81\x80\x80\x80\x80\x00x",  # client_id's length (1) in 6 bytes
    ],
    ids=[
        "scalar-twice",
        "ts-twice",
        "two-kinds",
        "wrong-wire-type",
        "6-byte-key-atheris",
        "6-byte-key",
        "8-byte-length-atheris",
        "6-byte-length",
    ],
)
def test_encodings_only_protobuf_defines_fall_back(raw: bytes) -> None:
    assert wire.native is not None
    with pytest.raises(wire.native.Unsupported):
        wire.native.BatchReader(raw)
    try:
        expected = reference_read(raw, BLOCKS)
    except DecodeError:
        with pytest.raises(DecodeError):
            wire.read_batch(raw)
        return
    reader = wire.read_batch(raw)
    assert ((reader.client_id, reader.batch_seq, reader.tenant, reader.count), list(reader.events(BLOCKS))) == expected


def test_keys_and_lengths_in_five_bytes_read_as_protobuf_reads_them() -> None:
    """An overlong key or length of 5 bytes is still one (protobuf takes up to 5), and a
    value may take 10: both readers read them."""
    assert wire.native is not None
    raw = ld(1, b"c") + b"\x90\x80\x80\x80\x00\x07" + ld(3, vi(1, 5) + ld(7, b""))  # batch_seq = 7, its key in 5 bytes
    assert native_read(raw, None) == reference_read(raw, None) == (("c", 7, "", 1), [(wire.CLEARED, 5)])
    raw = b"\x0a\x81\x80\x80\x80\x00x" + vi(2, 2)  # client_id's length (1) in 5 bytes, and a value in 10
    raw += b"\x1a\x8b\x80\x80\x80\x00" + b"\x08" + b"\x83\x80\x80\x80\x80\x80\x80\x80\x80\x00"
    assert native_read(raw, None) == reference_read(raw, None) == (("x", 2, "", 1), [(wire.NONE, 3)])


def test_block_ids_are_looked_up_as_each_event_is_read() -> None:
    """A batch may allocate a block and access it: the access sees the block the
    allocation added, because ids resolve when the access is read."""
    assert wire.native is not None
    batch = pb.IntentBatch(
        client_id="c",
        batch_seq=1,
        events=[
            pb.Event(ts_us=1, accessed=pb.BlocksAccessed(block_ids=["a", "new"])),
            pb.Event(ts_us=2, accessed=pb.BlocksAccessed(block_ids=["a", "new"], next_use_us=9)),
        ],
    )
    blocks: dict[str, Any] = {"a": BLOCKS["a"]}
    events = wire.native.BatchReader(batch.SerializeToString()).events(blocks)
    assert next(events) == (wire.ACCESSED, 1, None, None, ["a", "new"], "", [], "", False)  # "new" unknown: the ids, to name it
    blocks["new"] = marker = object()
    assert next(events) == (wire.ACCESSED, 2, 9, [BLOCKS["a"], marker], None, "", [], "", False)
    assert next(events, None) is None


def test_one_scan_reads_again_for_each_core() -> None:
    """Shadow policies and multi-policy replay read a batch once per core."""
    assert wire.native is not None
    batch = pb.IntentBatch(client_id="c", batch_seq=3, events=[pb.Event(ts_us=5, freed=pb.BlocksFreed(block_ids=["b"]))])
    reader = wire.native.BatchReader(batch.SerializeToString())
    first, second = {"b": object()}, {"b": object()}
    assert list(reader.events(first)) == [(wire.FREED, 5, [first["b"]], None)]
    assert list(reader.events(second)) == [(wire.FREED, 5, [second["b"]], None)]
    assert list(reader.events()) == [(wire.FREED, 5, None, ["b"])]
    with pytest.raises(TypeError, match="blocks must be a dict"):
        reader.events(["b"])  # type: ignore[arg-type]


def test_reading_leaks_no_references() -> None:
    """Every event kind, read many times: the blocks, the ids' dict and the bytes keep the
    reference counts they had (a leak in the C code shows here)."""
    assert wire.native is not None
    block = object()
    blocks = {"a": block}
    intent = pb.MemoryIntent(block_id="a", request_id="r", size_bytes=10, deadline_us=5, allowed_tiers=["hbm", "dram"], request_priority=3)
    events = [
        pb.Event(ts_us=1, allocated=pb.BlockAllocated(intent=intent, tier="hbm")),
        pb.Event(ts_us=1, accessed=pb.BlocksAccessed(block_ids=["a", "a"], next_use_us=4)),
        pb.Event(ts_us=1, accessed=pb.BlocksAccessed(block_ids=["a", "missing"])),
        pb.Event(ts_us=1, intent_updated=pb.IntentUpdated(block_id="a", deadline_us=3, pin_requested=True)),
        pb.Event(ts_us=1, released=pb.BlocksReleased(block_ids=["a"])),
        pb.Event(ts_us=1, freed=pb.BlocksFreed(block_ids=["a"])),
        pb.Event(ts_us=1, acked=pb.DirectiveAcked(directive_id=2, status=pb.ACK_STATUS_FAILED, actual_tier="dram")),
        pb.Event(ts_us=1, cleared=pb.AllBlocksCleared()),
        pb.Event(ts_us=1, eviction_requested=pb.EvictionRequested(tier="hbm", count=2, protected_block_ids=["a", "x"])),
        pb.Event(ts_us=1, eviction_requested=pb.EvictionRequested()),
        pb.Event(ts_us=1),
    ]
    raw = pb.IntentBatch(client_id="c", batch_seq=1, events=events).SerializeToString()
    for _ in range(10):  # warm caches (small ints, interned strings)
        list(wire.native.BatchReader(raw).events(blocks))
    gc.collect()
    before = (sys.getrefcount(block), sys.getrefcount(blocks), sys.getrefcount(raw))
    for _ in range(2000):
        list(wire.native.BatchReader(raw).events(blocks))
    gc.collect()
    assert (sys.getrefcount(block), sys.getrefcount(blocks), sys.getrefcount(raw)) == before


def test_the_reference_switch_reads_through_protobuf(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVBROKER_WIRE_REFERENCE (debugging, and the pure Python build) takes the reference
    path for every batch."""
    raw = pb.IntentBatch(client_id="c", batch_seq=1, events=[pb.Event(ts_us=1, cleared=pb.AllBlocksCleared())]).SerializeToString()
    assert not isinstance(wire.read_batch(raw), wire.ReferenceReader)
    monkeypatch.setattr(wire, "use_reference", True)
    reader = wire.read_batch(raw)
    assert isinstance(reader, wire.ReferenceReader)
    assert list(reader.events()) == [(wire.CLEARED, 1)]


def test_integers_read_as_protobuf_reads_them() -> None:
    """Hand-built varints no protobuf library writes for these fields: uint32 fields keep
    their low 32 bits, enums are int32 (and unknown values kept), int64 fields are two's
    complement, a bool is any non-zero value."""
    big = 2**40 + 7
    intent = (
        ld(1, b"a")
        + vi(3, 2**32 + 2)  # phase: int32 2
        + vi(4, 2**64 - 1)  # priority: int32 -1
        + vi(5, 2**64 - 5)  # deadline_us: -5
        + vi(9, 2**64 - 1)  # size_bytes: uint64
        + vi(10, 2)  # pin_requested: True
        + vi(14, big)  # layer: uint32
        + vi(15, 2**32)  # head_group: 0
        + vi(17, big)  # token_count
        + vi(20, big)  # request_priority
        + vi(21, 2**33 + 1)  # expected_reuse_window_tokens
    )
    update = ld(1, b"a") + vi(2, 2**32 + 77) + vi(6, 3) + vi(11, big) + vi(12, big)
    ack = vi(1, 2**64 - 1) + vi(2, 2**32 + 1)
    raw = (
        ld(1, b"c")
        + vi(2, 2**64 - 1)
        + ld(3, event_bytes(2**64 - 1, 2, ld(1, intent) + vi(3, 5)))
        + ld(3, event_bytes(1, 4, update))
        + ld(3, event_bytes(1, 8, ack))
    )
    header, events = native_read(raw, BLOCKS)
    assert (header, events) == reference_read(raw, BLOCKS)
    allocated, updated, acked = events
    assert allocated[1] == -1 and allocated[wire.A_REUSE] is True
    assert (allocated[wire.A_PHASE], allocated[wire.A_PRIORITY], allocated[wire.A_DEADLINE]) == (2, -1, -5)
    assert (allocated[wire.A_LAYER], allocated[wire.A_HEAD_GROUP], allocated[wire.A_TOKEN_COUNT]) == (7, 0, 7)
    assert (allocated[wire.A_REQUEST_PRIORITY], allocated[wire.A_REUSE_WINDOW], allocated[wire.A_SIZE]) == (7, 1, 2**64 - 1)
    assert (updated[wire.U_PHASE], updated[wire.U_PIN_REQUESTED], updated[wire.U_REUSE_WINDOW], updated[wire.U_REQUEST_PRIORITY]) == (
        77,
        True,
        7,
        7,
    )
    assert acked == (wire.ACKED, 1, 2**64 - 1, 1, "")


def test_block_ids_read_again_are_the_same_string_and_always_the_right_one() -> None:
    """The reader hands back the str it already made for the same id bytes (the core's own
    dict key, hash cached); its bounded cache never changes what is read: more distinct
    ids than it holds, ids that differ only in their last byte, non-ASCII ids, long ids."""
    assert wire.native is not None

    def ids_of(names: list[str]) -> list[str]:
        raw = pb.IntentBatch(client_id="c", batch_seq=1, events=[pb.Event(ts_us=1, accessed=pb.BlocksAccessed(block_ids=names))])
        (event,) = wire.native.BatchReader(raw.SerializeToString()).events()  # type: ignore[union-attr]
        ids: list[str] = event[4]
        return ids

    first = ids_of(["req-1/b0", "req-1/b1"])
    again = ids_of(["req-1/b0", "req-1/b1"])
    assert again == first and all(a is b for a, b in zip(again, first, strict=True))
    many = [f"~{i:08x}~block/{i}" for i in range(200_000)] + ["é-1", "é-2", "x" * 300, "x" * 299 + "y", "a", "b"]
    for start in range(0, len(many), 5000):
        chunk = many[start : start + 5000]
        assert ids_of(chunk) == chunk
    assert ids_of(list(reversed(many[-2000:]))) == list(reversed(many[-2000:]))
