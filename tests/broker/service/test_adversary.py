"""What one client must not be able to do to the broker or to the others (issue 19, items
6-9 and 11-13), over real gRPC on a free loopback port. Each test failed before its fix."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from broker.journal import JournalSource
from broker.model.apply import apply_batch
from broker.model.core import Core
from broker.service.server import RunningBroker, start_broker
from clients.broker_client import BrokerClient, BrokerError
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import broker_service_pb2_grpc as spb_grpc
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb
from tests.broker.service.test_security import ACME, ADMIN, auth, secured_config, tokens_file
from tests.builders import access, alloc
from tests.conftest import small_config

STREAM = "/kvbroker.v1.BrokerService/Stream"
KVBROKER = Path(sys.executable).parent / "kvbroker"


def target(broker: RunningBroker) -> str:
    return f"127.0.0.1:{broker.port}"


class RawStream:
    """One Stream call that sends raw bytes: hello first, then whatever the test says."""

    def __init__(self, channel: grpc.aio.Channel, metadata: Any = None) -> None:
        self.call = channel.stream_stream(STREAM, request_serializer=None, response_deserializer=spb.StreamResponse.FromString)(
            metadata=metadata
        )

    async def hello(self, client_id: str, tenant: str = "") -> spb.HelloReply:
        hello = spb.StreamRequest(hello=spb.Hello(schema_major=1, client_id=client_id, tenant=tenant))
        await self.call.write(hello.SerializeToString())
        reply = await self.call.read()
        return reply.hello

    async def send(self, raw: bytes) -> dpb.DirectiveBatch:
        await self.call.write(raw)
        reply = await self.call.read()
        assert reply is not grpc.aio.EOF, await self.call.details()
        return reply.directives

    async def batch(self, client_id: str, seq: int, *events: pb.Event, tenant: str = "") -> dpb.DirectiveBatch:
        b = pb.IntentBatch(client_id=client_id, batch_seq=seq, events=list(events), tenant=tenant)
        return await self.send(spb.StreamRequest(batch=b).SerializeToString())


@pytest.fixture
async def channel(running_broker: RunningBroker) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(target(running_broker)) as ch:
        yield ch


def batch_refusal(answer: dpb.DirectiveBatch) -> tuple[str, str, str]:
    assert len(answer.rejections) == 1 and answer.rejections[0].event_index == -1, answer
    r = answer.rejections[0]
    return r.field, r.code, r.reason


# ---- 6: the shared clock ---------------------------------------------------------------------------


@pytest.mark.parametrize("running_broker", [small_config(policy="deadline_edf")], indirect=True)
async def test_another_tenants_far_future_or_rejected_event_does_not_move_the_clock(
    running_broker: RunningBroker, channel: grpc.aio.Channel
) -> None:
    """Tenant a streams at its own pace; tenant b sends an event at ts 2**63-1 and one that
    is rejected for an unknown block: neither moves the broker's clock, and the far one is
    rejected naming ts_us and the limit."""
    core = running_broker.service.core
    a = RawStream(channel)
    await a.hello("a")
    answer = await a.batch("a", 1, alloc("a0", ts=1_000), alloc("a1", ts=2_000), tenant="ta")
    assert answer.accepted_events == 2
    assert core.clock.now_us == 2_000
    b = RawStream(channel)
    await b.hello("b")
    far = await b.batch("b", 1, alloc("b0", ts=2**63 - 1), tenant="tb")
    assert [(r.event_index, r.field) for r in far.rejections] == [(0, "ts_us")]
    assert "limits.max_clock_skew_us" in far.rejections[0].reason
    unknown = await b.batch("b", 2, access("nope", ts=5_000_000), tenant="tb")
    assert [r.code for r in unknown.rejections] == ["FAILED_PRECONDITION"]
    assert core.clock.now_us == 2_000  # neither event moved it
    assert (await a.batch("a", 2, access("a0", ts=3_000), tenant="ta")).accepted_events == 1
    assert core.clock.now_us == 3_000


async def test_the_skew_decisions_replay_exactly_from_the_journal(tmp_path: Path) -> None:
    """The bound is decided from the receive time stamped in each journaled batch: a replay
    of the journal rejects the same events and ends on the same clock."""
    url = f"file://{tmp_path}/skew.journal"
    broker = await start_broker(small_config(journal_url=url))
    try:
        async with grpc.aio.insecure_channel(target(broker)) as ch:
            s = RawStream(ch)
            await s.hello("e")
            assert (await s.batch("e", 1, alloc("x", ts=10))).accepted_events == 1
            far = await s.batch("e", 2, alloc("y", ts=10 + 3_600_000_000), alloc("z", ts=20))
            assert [(r.event_index, r.field) for r in far.rejections] == [(0, "ts_us")]
        live_clock = broker.service.core.clock.now_us
    finally:
        await broker.stop(grace=1)
    core = Core(small_config().core)
    outcomes = [apply_batch(core, r.payload) for r in JournalSource(url).batches()]
    assert [[(r.index, r.field) for r in o.rejections] for o in outcomes] == [[], [(0, "ts_us")]]
    assert core.clock.now_us == live_clock == 20
    assert sorted(core.blocks) == ["x", "z"]


async def test_a_client_cannot_set_the_brokers_receive_stamp(channel: grpc.aio.Channel) -> None:
    s = RawStream(channel)
    await s.hello("f")
    forged = pb.IntentBatch(client_id="f", batch_seq=1, events=[alloc("x", ts=2**62)], broker_received_us=2**62)
    field, _, reason = batch_refusal(await s.send(spb.StreamRequest(batch=forged).SerializeToString()))
    assert field == "broker_received_us" and "set by the broker" in reason
    assert (await s.batch("f", 1, alloc("x", ts=5))).accepted_events == 1


# ---- 7: batch_seq jumps ---------------------------------------------------------------------------


async def test_a_batch_seq_jump_is_refused_and_the_next_number_still_applies(channel: grpc.aio.Channel) -> None:
    s = RawStream(channel)
    await s.hello("j")
    refused = await s.batch("j", 2**64 - 1, alloc("x"))
    field, code, reason = batch_refusal(refused)
    assert (field, code) == ("batch_seq", "INVALID_ARGUMENT")
    assert "limits.max_batch_seq_gap = 1" in reason and "next: 1" in reason
    ok = await s.batch("j", 1, alloc("x"))
    assert ok.accepted_events == 1 and not ok.duplicate
    assert batch_refusal(await s.batch("j", 3, alloc("y")))[0] == "batch_seq"
    assert (await s.batch("j", 2, alloc("y"))).accepted_events == 1


async def test_broker_client_at_the_last_batch_seq_fails_loudly_instead_of_looping(running_broker: RunningBroker) -> None:
    client = BrokerClient(target(running_broker), "full", backoff_initial_s=0.01, backoff_max_s=0.05)
    await client.connect()
    try:
        client.batch_seq = 2**64 - 1  # as if the broker had applied the last number
        await client.allocate("x", 100, ts_us=1)
        with pytest.raises(BrokerError, match="batch_seq"):
            await asyncio.wait_for(client.flush(), 10)
        assert client.failed is not None and client.counters.connects == 1
    finally:
        await client.close(timeout=2)


# ---- 8: streams overall and memory ---------------------------------------------------------------


async def _refused_stream(ch: grpc.aio.Channel, client_id: str) -> grpc.aio.AioRpcError:
    s = RawStream(ch)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        reply = await s.hello(client_id)
        if reply.broker_id:  # answered: the stream was let in
            pytest.fail("the stream was let in")
    return info.value


@pytest.mark.parametrize("running_broker", [small_config(extra="[limits]\nmax_streams = 2\n")], indirect=True)
async def test_max_streams_caps_the_streams_of_the_whole_broker(running_broker: RunningBroker, channel: grpc.aio.Channel) -> None:
    first, second = RawStream(channel), RawStream(channel)
    await first.hello("one")
    await second.hello("two")
    refused = await _refused_stream(channel, "three")
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limits.max_streams = 2" in (refused.details() or "")
    await first.call.done_writing()
    assert await first.call.read() is grpc.aio.EOF
    await asyncio.sleep(0.2)
    await RawStream(channel).hello("four")  # a slot is free again
    stats = running_broker.service.stats()
    assert stats.refused_streams["max_streams"] == 1


@pytest.mark.parametrize("running_broker", [small_config(extra='[limits]\nmax_rss_bytes = "1MiB"\n')], indirect=True)
async def test_max_rss_bytes_refuses_new_streams_over_the_memory_bound(channel: grpc.aio.Channel) -> None:
    refused = await _refused_stream(channel, "any")
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limits.max_rss_bytes" in (refused.details() or "")


# ---- 9: revoked tokens end open streams ----------------------------------------------------------


@pytest.mark.parametrize("how", ["rewritten", "deleted"])
async def test_a_token_revoked_while_its_stream_is_open_ends_the_stream(tmp_path: Path, how: str) -> None:
    path = tokens_file(tmp_path)
    broker = await start_broker(secured_config(tmp_path, f'tokens_file = "{path}"'))
    try:
        async with grpc.aio.insecure_channel(target(broker)) as ch:
            s = RawStream(ch, metadata=auth(ACME))
            await s.hello("e")
            assert (await s.batch("e", 1, alloc("a"))).accepted_events == 1
            if how == "rewritten":
                path.write_text(f"{ADMIN} * admin\n")
            else:
                path.unlink()
            await asyncio.sleep(1.2)  # the file is looked at again at most once a second
            await s.call.write(spb.StreamRequest(batch=pb.IntentBatch(client_id="e", batch_seq=2, events=[alloc("b")])).SerializeToString())
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await s.call.read()
            assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "revoked" in (ended.value.details() or "")
            assert broker.service.residency(spb.GetResidencyRequest(block_id="b")) is None  # not applied
            assert broker.service.revoked_streams == 1
            # A new call with a token of the deleted file is refused too.
            stub = spb_grpc.BrokerServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                hello = spb.Hello(schema_major=1, client_id="e")
                await stub.Submit(spb.SubmitRequest(hello=hello, batch=pb.IntentBatch(client_id="e", batch_seq=2)), metadata=auth(ACME))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await broker.stop(grace=1)


# ---- 11: unacknowledged directives -----------------------------------------------------------------


@pytest.mark.parametrize("running_broker", [small_config(extra="[limits]\nmax_outstanding_directives = 3\n")], indirect=True)
async def test_max_outstanding_directives_is_a_config_key_and_status_counts_them(running_broker: RunningBroker) -> None:
    async with BrokerClient(target(running_broker), "d", max_batch_events=10) as client:
        for i in range(60):  # 6,000 bytes into 1,000 + 2,000 + 4,000: demotions and evictions
            await client.allocate(f"b{i}", 100, ts_us=i, request_id="r")
        await client.flush()
        sent = client.counters.directives
    assert sent > 3
    stats = running_broker.service.stats()
    assert (stats.outstanding_directives, stats.max_outstanding_directives) == (3, 3)
    out = await asyncio.to_thread(
        subprocess.run, [str(KVBROKER), "status", "--target", target(running_broker), "--json"], capture_output=True, text=True, timeout=60
    )
    record = json.loads(out.stdout)
    assert (record["outstanding_directives"], record["max_outstanding_directives"]) == (3, 3)


# ---- 12: the resume point of a tenant without authentication ------------------------------------------


async def test_without_auth_the_hello_reports_the_resume_point_of_the_tenant_the_batches_carry(channel: grpc.aio.Channel) -> None:
    s = RawStream(channel)
    await s.hello("engine", tenant="acme")
    assert (await s.batch("engine", 1, alloc("x"), tenant="acme")).accepted_events == 1
    assert (await s.batch("engine", 2, alloc("y"), tenant="acme")).accepted_events == 1
    await s.call.done_writing()
    again = RawStream(channel)
    reply = await again.hello("engine", tenant="acme")
    assert reply.last_batch_seq == 2
    other = await RawStream(channel).hello("engine")  # the tenant-less "engine" is another client
    assert other.last_batch_seq == 0


# ---- 13: the two misleading messages ----------------------------------------------------------------


async def test_an_empty_message_after_the_hello_is_called_empty(channel: grpc.aio.Channel) -> None:
    s = RawStream(channel)
    await s.hello("e")
    field, _, reason = batch_refusal(await s.send(b""))
    assert field == "batch" and "empty StreamRequest" in reason and "hello already" not in reason
    assert (await s.batch("e", 1, alloc("x"))).accepted_events == 1  # the stream lives


async def test_a_submit_without_a_hello_is_told_the_hello_is_missing(channel: grpc.aio.Channel) -> None:
    stub = spb_grpc.BrokerServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Submit(spb.SubmitRequest(batch=pb.IntentBatch(client_id="e", batch_seq=1, events=[alloc("x")])))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hello: required" in (info.value.details() or "")
    assert "schema major" not in (info.value.details() or "")


def test_limits_keys_are_validated_by_name() -> None:
    from broker.config import ConfigError, parse_config

    for text, key in (
        ("max_streams = -1", "limits.max_streams"),
        ("max_batch_seq_gap = true", "limits.max_batch_seq_gap"),
        ('max_rss_bytes = "lots"', "limits.max_rss_bytes"),
        ("max_outstanding_directives = 0", "limits.max_outstanding_directives"),
        ("max_clock_skew_us = 1.5", "limits.max_clock_skew_us"),
    ):
        with pytest.raises(ConfigError, match=key):
            parse_config(f"[limits]\n{text}\n")
    config = parse_config("[limits]\nmax_clock_skew_us = 5\nmax_outstanding_directives = 7\n")
    assert (config.core.max_clock_skew_us, config.core.max_outstanding_directives) == (5, 7)
    assert dataclasses.replace(config.limits).max_streams == 256
