"""The adapter's hand-written event bytes are what protobuf writes and reads: parsed back
with protobuf they give the intended messages, and both batch readers read them alike."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.model import wire
from kvbroker.v1 import intent_pb2 as pb
from vllm_integration.decisions_to_vllm import intent_bytes

ids = st.text(min_size=1, max_size=80)
opt_u32 = st.one_of(st.none(), st.integers(0, 2**32 - 1))


@settings(max_examples=200, deadline=None)
@given(
    ts=st.integers(0, 2**62),
    block=ids,
    request=st.text(max_size=20),
    priority=st.one_of(st.none(), st.integers(1, 3)),
    deadline=st.one_of(st.none(), st.integers(0, 2**62)),
    request_priority=st.one_of(st.none(), st.integers(0, 100)),
    reuse=opt_u32,
    tenant=st.text(max_size=10),
    draft=st.booleans(),
)
def test_allocated_parses_as_the_intended_message(
    ts: int,
    block: str,
    request: str,
    priority: int | None,
    deadline: int | None,
    request_priority: int | None,
    reuse: int | None,
    tenant: str,
    draft: bool,
) -> None:
    rest = intent_bytes.intent_fields(
        request,
        priority=priority,
        deadline_us=deadline,
        request_priority=request_priority,
        reuse_tokens=reuse,
        tenant=tenant,
        is_draft=draft,
    )
    raw = intent_bytes.allocated(intent_bytes.timestamp(ts), intent_bytes.id_field(block), rest)
    intent = pb.MemoryIntent(block_id=block, request_id=request, size_bytes=1, tenant=tenant, is_draft=draft)
    if priority:
        intent.priority = priority  # type: ignore[assignment]
    if deadline is not None:
        intent.deadline_us = deadline
    if request_priority is not None:
        intent.request_priority = request_priority
    if reuse is not None:
        intent.expected_reuse_window_tokens = reuse
    assert pb.Event.FromString(raw) == pb.Event(ts_us=ts, allocated=pb.BlockAllocated(intent=intent))


@settings(max_examples=200, deadline=None)
@given(ts=st.integers(0, 2**62), blocks=st.lists(ids, min_size=1, max_size=5), count=st.integers(0, 2**32 - 1), tier=st.text(max_size=5))
def test_the_other_events_parse_as_intended(ts: int, blocks: list[str], count: int, tier: str) -> None:
    t = intent_bytes.timestamp(ts)
    fields = [intent_bytes.id_field(b) for b in blocks]
    assert pb.Event.FromString(intent_bytes.accessed(t, fields)) == pb.Event(ts_us=ts, accessed=pb.BlocksAccessed(block_ids=blocks))
    assert pb.Event.FromString(intent_bytes.freed(t, fields)) == pb.Event(ts_us=ts, freed=pb.BlocksFreed(block_ids=blocks))
    assert pb.Event.FromString(intent_bytes.cleared(t)) == pb.Event(ts_us=ts, cleared=pb.AllBlocksCleared())
    ask = pb.EvictionRequested(tier=tier, count=count, protected_block_ids=blocks)
    assert pb.Event.FromString(intent_bytes.eviction_requested(t, count, fields, tier)) == pb.Event(ts_us=ts, eviction_requested=ask)
    changes = intent_bytes.update_fields(priority=3, deadline_us=ts, request_priority=7, reuse_tokens=count, is_draft=False)
    update = pb.IntentUpdated(
        block_id=blocks[0], priority=3, deadline_us=ts, request_priority=7, expected_reuse_window_tokens=count, is_draft=False
    )
    assert pb.Event.FromString(intent_bytes.updated(t, fields[0], changes)) == pb.Event(ts_us=ts, intent_updated=update)


@settings(max_examples=100, deadline=None)
@given(
    client=st.text(min_size=1, max_size=10),
    tenant=st.text(max_size=5),
    seq=st.integers(1, 2**63),
    blocks=st.lists(ids, min_size=1, max_size=4),
)
def test_a_batch_parses_and_both_readers_agree(client: str, tenant: str, seq: int, blocks: list[str]) -> None:
    t = intent_bytes.timestamp(5)
    fields = [intent_bytes.id_field(b) for b in blocks]
    evs = [
        intent_bytes.allocated(t, fields[0], intent_bytes.intent_fields("r", tenant="x")),
        intent_bytes.accessed(t, fields),
        intent_bytes.eviction_requested(t, 2, fields),
    ]
    raw = intent_bytes.batch(intent_bytes.batch_head(client, tenant), seq, evs)
    batch = pb.IntentBatch.FromString(raw)
    assert (batch.client_id, batch.batch_seq, batch.tenant, len(batch.events)) == (client, seq, tenant, 3)
    reference = list(wire.ReferenceReader(batch).events())
    assert list(wire.read_batch(raw).events()) == reference
    assert reference[2] == (wire.EVICTION, 5, "", 2, blocks)


@settings(max_examples=200, deadline=None)
@given(
    ts=st.integers(0, 2**62),
    blocks=st.lists(ids, max_size=5),
    request=st.text(min_size=1, max_size=20),
    start=st.one_of(st.just(0), st.integers(0, 2**64 - 1)),
    positions=st.lists(st.integers(0, 2**64 - 1), max_size=5),
)
def test_the_scoped_events_parse_as_intended(ts: int, blocks: list[str], request: str, start: int, positions: list[int]) -> None:
    t = intent_bytes.timestamp(ts)
    fields = [intent_bytes.id_field(b) for b in blocks]
    positions = (positions + [7] * len(blocks))[: len(blocks)]
    rest = intent_bytes.intent_fields(request)
    raw = intent_bytes.scoped_allocated(t, intent_bytes.id_field("k"), rest, intent_bytes.allocation_scope(request), start)
    intent = pb.MemoryIntent(block_id="k", request_id=request, size_bytes=1, token_start=start)
    assert pb.Event.FromString(raw) == pb.Event(ts_us=ts, allocated=pb.BlockAllocated(intent=intent, scope=request))
    # Twice: the second comes from the token_start cache.
    assert intent_bytes.scoped_allocated(t, intent_bytes.id_field("k"), rest, intent_bytes.allocation_scope(request), start) == raw
    scoped = pb.BlocksAccessed(block_ids=blocks, scope=request, token_positions=positions)
    raw = intent_bytes.scoped_accessed(t, fields, intent_bytes.scope(request), positions)
    assert pb.Event.FromString(raw) == pb.Event(ts_us=ts, accessed=scoped)
    # The native reader reads them as the reference does (packed positions).
    assert list(wire.read_batch(intent_bytes.batch(intent_bytes.batch_head("c"), 1, [raw])).events()) == list(
        wire.ReferenceReader(pb.IntentBatch.FromString(intent_bytes.batch(intent_bytes.batch_head("c"), 1, [raw]))).events()
    )
    ending = pb.BlocksAccessed(block_ids=blocks, ends_scope=request)
    assert pb.Event.FromString(intent_bytes.ending_accessed(t, fields, intent_bytes.scope(request))) == pb.Event(ts_us=ts, accessed=ending)
