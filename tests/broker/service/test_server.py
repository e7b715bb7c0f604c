"""The service over real gRPC on a free loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.config import JournalConfig
from broker.journal.records import JournalRecord
from broker.service.broker_service import Answer
from broker.service.server import (
    STREAM_PIPELINE,
    RunningBroker,
    field_slice,
    sole_batch,
    start_broker,
    stream_response_bytes,
    submit_response_bytes,
)
from clients.broker_client import BrokerClient, BrokerError
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import broker_service_pb2_grpc as spb_grpc
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb
from tests.builders import access, alloc, free
from tests.conftest import small_config

DC = pb.PRIORITY_DECODE_CRITICAL


def target(broker: RunningBroker) -> str:
    return f"127.0.0.1:{broker.port}"


async def residency(broker: RunningBroker, **query: object) -> spb.GetResidencyResponse:
    async with grpc.aio.insecure_channel(target(broker)) as channel:
        stub = spb_grpc.BrokerServiceStub(channel)
        response: spb.GetResidencyResponse = await stub.GetResidency(spb.GetResidencyRequest(**query))  # type: ignore[arg-type]
        return response


async def test_allocations_past_hbm_get_demote_and_evict_directives_and_pins_hold(running_broker: RunningBroker) -> None:
    directives: list[dpb.Directive] = []
    async with BrokerClient(target(running_broker), "engine", max_batch_events=7) as client:
        # Two blocks that must never move: decode-critical, and pinned on request.
        await client.allocate("dc", 100, ts_us=0, priority=DC, request_id="r0")
        await client.allocate("pin", 100, ts_us=0, pin_requested=True, request_id="r0")
        for i in range(80):  # 8,000 bytes into tiers of 1,000 + 2,000 + 4,000
            await client.allocate(f"b{i}", 100, ts_us=1 + i, request_id=f"r{i % 5}")
            if i % 10 == 9:
                await client.flush()
                directives.extend(client.drain_directives())
                totals = await residency(running_broker, totals=True)
                for tier in totals.tiers:
                    assert tier.bytes <= tier.capacity_bytes, tier
        await client.flush()
        directives.extend(client.drain_directives())
    kinds = {d.kind for d in directives}
    assert {dpb.DIRECTIVE_KIND_DEMOTE, dpb.DIRECTIVE_KIND_EVICT} <= kinds
    assert not {"dc", "pin"} & {d.block_id for d in directives}
    assert all(d.policy == "lru" and d.config_generation == 1 for d in directives)
    ids = [d.directive_id for d in directives]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    one = await residency(running_broker, block_id="dc")
    assert (one.blocks[0].tier, one.blocks[0].pinned) == ("hbm", True)
    request = await residency(running_broker, request_id="r0")
    assert {"dc", "pin"} <= {b.block_id for b in request.blocks}
    totals = await residency(running_broker, totals=True)
    assert sum(t.bytes for t in totals.tiers) + 100 * totals.dropped_blocks == 8200


async def test_an_unknown_schema_major_is_refused_naming_the_served_versions(running_broker: RunningBroker) -> None:
    client = BrokerClient(target(running_broker), "future-engine", schema_major=2)
    with pytest.raises(BrokerError) as info:
        await client.connect()
    assert "FAILED_PRECONDITION" in str(info.value)
    assert "kvbroker.v1" in str(info.value) and "2" in str(info.value)
    # The unary path refuses it the same way.
    async with grpc.aio.insecure_channel(target(running_broker)) as channel:
        stub = spb_grpc.BrokerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Submit(spb.SubmitRequest(hello=spb.Hello(schema_major=3, client_id="x")))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "kvbroker.v1" in (err.value.details() or "")


async def test_bad_events_are_rejected_and_the_stream_goes_on(running_broker: RunningBroker) -> None:
    async with BrokerClient(target(running_broker), "engine", max_batch_events=1000) as client:
        await client.allocate("a", 100, ts_us=0)
        await client.allocate("", 100, ts_us=1)  # missing block id
        await client.allocate("b", 0, ts_us=2)  # size 0
        await client.allocate("c", 100, ts_us=3, deadline_us=-1)  # negative deadline
        await client.allocate("d", 100, ts_us=4, phase=99)  # unknown enum value
        await client.access(["a", "nobody"], ts_us=5)  # unknown block
        await client.allocate("a", 100, ts_us=6)  # duplicate allocation
        await client.allocate("e", 100, ts_us=7)
        result = await client.flush()
        assert result is not None
        got = [(r.event_index, r.field) for r in result.rejections]
        assert got == [
            (1, "allocated.intent.block_id"),
            (2, "allocated.intent.size_bytes"),
            (3, "allocated.intent.deadline_us"),
            (4, "allocated.intent.phase"),
            (5, "accessed.block_ids[1]"),
            (6, "allocated.intent.block_id"),
        ]
        assert all(r.reason for r in result.rejections)
        assert result.accepted_events == 2
        # The same stream keeps working.
        await client.free(["a", "e"], ts_us=8)
        second = await client.flush()
        assert second is not None and second.rejections == [] and second.accepted_events == 1
    stats = running_broker.service.stats()
    assert stats.rejected_events == 6 and stats.events["freed"] == 1


async def test_malformed_bytes_get_an_error_answer_and_the_stream_lives(running_broker: RunningBroker) -> None:
    async with grpc.aio.insecure_channel(target(running_broker)) as channel:
        raw = channel.stream_stream("/kvbroker.v1.BrokerService/Stream")  # bytes in, bytes out
        call = raw()
        await call.write(spb.StreamRequest(hello=spb.Hello(schema_major=1, client_id="raw")).SerializeToString())
        hello = spb.StreamResponse.FromString(await call.read())
        assert hello.hello.served_majors == [1]
        await call.write(b"\x12\xff\xff\xff\xff\x0f garbage")
        bad = spb.StreamResponse.FromString(await call.read())
        assert bad.directives.rejections[0].event_index == -1
        assert "malformed" in bad.directives.rejections[0].reason
        good = pb.IntentBatch(client_id="raw", batch_seq=1, events=[alloc("x", ts=1)])
        await call.write(spb.StreamRequest(batch=good).SerializeToString())
        ok = spb.StreamResponse.FromString(await call.read())
        assert ok.directives.accepted_events == 1 and not ok.directives.rejections
        # A batch claiming another client id is refused, not applied.
        other = pb.IntentBatch(client_id="someone-else", batch_seq=1, events=[alloc("y", ts=1)])
        await call.write(spb.StreamRequest(batch=other).SerializeToString())
        refused = spb.StreamResponse.FromString(await call.read())
        assert refused.directives.rejections[0].field == "client_id"
        await call.done_writing()
    assert "y" not in running_broker.service.core.blocks


async def test_a_stream_must_open_with_a_hello(running_broker: RunningBroker) -> None:
    async with grpc.aio.insecure_channel(target(running_broker)) as channel:
        stub = spb_grpc.BrokerServiceStub(channel)
        call = stub.Stream()
        await call.write(spb.StreamRequest(batch=pb.IntentBatch(client_id="x", batch_seq=1)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_unary_submit_and_stats(running_broker: RunningBroker) -> None:
    async with grpc.aio.insecure_channel(target(running_broker)) as channel:
        stub = spb_grpc.BrokerServiceStub(channel)
        hello = spb.Hello(schema_major=1, client_id="simple")
        batch = pb.IntentBatch(client_id="simple", batch_seq=1, events=[alloc(f"u{i}", ts=i) for i in range(12)])
        response = await stub.Submit(spb.SubmitRequest(hello=hello, batch=batch))
        assert response.directives.accepted_events == 12
        assert [d.block_id for d in response.directives.directives][:1] == ["u0"]
        # Resending the same batch_seq is recognised, not applied twice.
        again = await stub.Submit(spb.SubmitRequest(hello=hello, batch=batch))
        assert again.directives.duplicate
        batch2 = pb.IntentBatch(client_id="simple", batch_seq=2, events=[free("u5", ts=20)])
        await stub.Submit(spb.SubmitRequest(hello=hello, batch=batch2))
        stats = await stub.GetStats(spb.GetStatsRequest())
    assert stats.policy == "lru" and stats.config_generation == 1
    assert stats.events["allocated"] == 12 and stats.events["freed"] == 1
    assert stats.batches == 2 and stats.duplicate_batches == 1
    assert [t.name for t in stats.tiers] == ["hbm", "dram", "nvme"]
    assert sum(t.blocks for t in stats.tiers) == 11


async def test_residency_of_an_unknown_block_is_not_found(running_broker: RunningBroker) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await residency(running_broker, block_id="nope")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_reconnecting_client_resumes_after_its_last_applied_batch() -> None:
    broker = await start_broker(small_config())
    try:
        async with BrokerClient(target(broker), "engine") as client:
            await client.allocate("a", 100, ts_us=0)
            await client.flush()
            await client.allocate("b", 100, ts_us=1)
            await client.flush()
        again = BrokerClient(target(broker), "engine")
        reply = await again.connect()
        assert reply.last_batch_seq == 2 and again.batch_seq == 2
        await again.allocate("c", 100, ts_us=2)
        result = await again.flush()
        assert result is not None and result.batch_seq == 3 and not result.duplicate
        await again.close()
    finally:
        await broker.stop(grace=1)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.text(max_size=8), max_size=5),
    st.integers(0, 2**40),
    st.booleans(),
)
def test_field_slice_gives_the_exact_bytes_of_the_batch(ids: list[str], seq: int, with_hello: bool) -> None:
    batch = pb.IntentBatch(client_id="c", batch_seq=seq, events=[pb.Event(ts_us=1, accessed=pb.BlocksAccessed(block_ids=ids))])
    request = spb.SubmitRequest(batch=batch)
    if with_hello:
        request.hello.CopyFrom(spb.Hello(schema_major=1, client_id="c"))
    raw = request.SerializeToString()
    sliced = field_slice(raw, 2)
    assert sliced == batch.SerializeToString()
    assert field_slice(raw + b"\x12", 2) is None  # truncated trailing field: not well formed


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=40), max_size=30), st.booleans())
def test_sole_batch_takes_only_a_request_that_holds_just_a_batch(ids: list[str], with_hello: bool) -> None:
    batch = pb.IntentBatch(client_id="c", batch_seq=1, events=[pb.Event(ts_us=1, accessed=pb.BlocksAccessed(block_ids=ids))])
    raw = spb.StreamRequest(batch=batch).SerializeToString()
    assert sole_batch(raw) == batch.SerializeToString()
    assert sole_batch(raw[:-1]) is None  # truncated
    assert sole_batch(raw + raw) is None  # the batch twice: protobuf merges, so protobuf reads it
    hello = spb.StreamRequest(hello=spb.Hello(schema_major=1, client_id="c")).SerializeToString()
    assert sole_batch(hello) is None and sole_batch(b"") is None
    if with_hello:
        assert sole_batch(hello + raw) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=30), max_size=12), st.integers(0, 2**64 - 1))
def test_answers_on_the_wire_equal_the_messages_protobuf_writes(block_ids: list[str], seq: int) -> None:
    """The answer bytes are built around the DirectiveBatch's own (no copy into a
    StreamResponse or SubmitResponse); they parse to the same message, at every length."""
    batch = dpb.DirectiveBatch(
        client_id="c", batch_seq=seq, directives=[dpb.Directive(directive_id=i, block_id=b) for i, b in enumerate(block_ids)]
    )
    answer = Answer(batch.SerializeToString(), len(block_ids), 0, False)
    assert spb.StreamResponse.FromString(stream_response_bytes(answer)) == spb.StreamResponse(directives=batch)
    assert spb.SubmitResponse.FromString(submit_response_bytes(answer)) == spb.SubmitResponse(directives=batch)
    hello = spb.StreamResponse(hello=spb.HelloReply(broker_id="b"))
    assert stream_response_bytes(hello) == hello.SerializeToString()


@contextlib.asynccontextmanager
async def held_journal_broker(tmp_path: Path) -> AsyncIterator[tuple[RunningBroker, asyncio.Event]]:
    """A broker on a file journal whose writes wait until the yielded event is set."""
    config = dataclasses.replace(small_config(), journal=JournalConfig(url=f"file://{tmp_path / 'journal.log'}"))
    broker = await start_broker(config)
    journal = broker.service.journal
    gate = asyncio.Event()
    write = journal._write

    async def held_write(group: list[JournalRecord]) -> None:
        await gate.wait()
        await write(group)

    journal._write = held_write  # type: ignore[method-assign]
    try:
        yield broker, gate
    finally:
        gate.set()
        await broker.stop(grace=1)


async def open_stream(channel: grpc.aio.Channel, client_id: str) -> Any:
    stream = spb_grpc.BrokerServiceStub(channel).Stream()
    await stream.write(spb.StreamRequest(hello=spb.Hello(schema_major=1, client_id=client_id)))
    assert (await stream.read()).WhichOneof("kind") == "hello"
    return stream


async def test_a_stream_applies_batches_in_flight_and_answers_each_only_once_journaled(tmp_path: Path) -> None:
    """Batches in flight on one stream are applied as they arrive (they share journal
    writes, not one round trip each), and none is answered before its record is written."""
    async with held_journal_broker(tmp_path) as (broker, gate), grpc.aio.insecure_channel(target(broker)) as channel:
        journal = broker.service.journal
        stream = await open_stream(channel, "e")
        for seq in range(1, 6):
            batch = pb.IntentBatch(client_id="e", batch_seq=seq, events=[alloc(f"b{seq}", ts=seq)])
            await stream.write(spb.StreamRequest(batch=batch))
        for _ in range(200):  # all five applied while the first still waits for its write
            if len(broker.service.core.blocks) == 5:
                break
            await asyncio.sleep(0.01)
        assert sorted(broker.service.core.blocks) == ["b1", "b2", "b3", "b4", "b5"]
        assert journal.written == 1  # the config record; no batch is written yet
        reading = asyncio.ensure_future(stream.read())
        done, _ = await asyncio.wait({reading}, timeout=0.3)
        assert not done, "a batch was answered before its journal record was written"
        gate.set()
        answers = [await reading] + [await stream.read() for _ in range(4)]
        assert [a.directives.batch_seq for a in answers] == [1, 2, 3, 4, 5]
        assert all(a.directives.accepted_events == 1 for a in answers)
        assert journal.written == 6
        await stream.done_writing()


async def test_a_stream_reads_no_further_than_the_pipeline_bound(tmp_path: Path) -> None:
    """With its journal writes held, a stream applies at most STREAM_PIPELINE batches (plus
    the one being read); the rest wait in gRPC flow control, and all arrive once it opens."""
    total = STREAM_PIPELINE + 20
    async with held_journal_broker(tmp_path) as (broker, gate), grpc.aio.insecure_channel(target(broker)) as channel:
        stream = await open_stream(channel, "e")
        for seq in range(1, total + 1):
            batch = pb.IntentBatch(client_id="e", batch_seq=seq, events=[access("nothing", ts=seq)])
            await stream.write(spb.StreamRequest(batch=batch))
        await asyncio.sleep(0.5)
        assert broker.service.core.stats.batches == STREAM_PIPELINE + 1
        gate.set()
        answers = [await stream.read() for _ in range(total)]
        assert [a.directives.batch_seq for a in answers] == list(range(1, total + 1))
        assert broker.service.core.stats.batches == total
        await stream.done_writing()
