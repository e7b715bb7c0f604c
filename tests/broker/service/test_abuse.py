"""The service under abuse (issue 33, items 8-11), over real gRPC on a free loopback port
where the service is the subject. Each test failed before its fix."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc

from broker.service.server import start_broker
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import broker_service_pb2_grpc as spb_grpc
from kvbroker.v1 import intent_pb2 as pb
from tests.broker.service.test_security import secured_config, tokens_file
from tests.builders import alloc
from tests.conftest import small_config

# ---- 11: a stream without a token is UNAUTHENTICATED, every time ------------------------------------

TRIES = 50
STREAM = "/kvbroker.v1.BrokerService/Stream"


async def _refusal(port: int, metadata: tuple[tuple[str, str], ...] | None, pipelined: bool) -> str:
    """One Stream call on a new channel (as a client that starts does), refused: its code.
    ``pipelined``: the client sends its hello and two batches back to back and half-closes
    (a request iterator), else it writes the hello and reads (BrokerClient's way)."""
    hello = spb.StreamRequest(hello=spb.Hello(schema_major=1, client_id="e"))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = spb_grpc.BrokerServiceStub(channel)
        try:
            if pipelined:

                async def requests() -> AsyncIterator[spb.StreamRequest]:
                    yield hello
                    for seq in (1, 2):
                        yield spb.StreamRequest(batch=pb.IntentBatch(client_id="e", batch_seq=seq, events=[alloc(f"b{seq}")]))

                async for _ in stub.Stream(requests(), metadata=metadata):
                    pass
            else:
                call = stub.Stream(metadata=metadata)
                # A write that meets the ended call raises; the status is then the read's.
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    await call.write(hello)
                await call.read()
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return "OK"


async def test_a_stream_without_a_token_is_unauthenticated_every_time(tmp_path: Path) -> None:
    """50 tries of each way a client opens a stream, with no token and with two
    authorization headers: every one ends UNAUTHENTICATED. Before, the refusal ended the
    call while the client's hello was still being written, and grpc.aio's client reported
    that write's failure as INTERNAL ("Internal error from Core") in about 1 try in 10."""
    broker = await start_broker(secured_config(tmp_path, f'tokens_file = "{tokens_file(tmp_path)}"'))
    try:
        two = (("authorization", "Bearer x"), ("authorization", "Bearer y"))
        codes: dict[tuple[str, bool, str], int] = {}
        for metadata, name in ((None, "none"), (two, "two headers")):
            for pipelined in (False, True):
                for _ in range(TRIES):
                    code = await _refusal(broker.port, metadata, pipelined)
                    codes[(name, pipelined, code)] = codes.get((name, pipelined, code), 0) + 1
        assert {code for (_, _, code) in codes} == {"UNAUTHENTICATED"}, codes
        assert not broker.service.core.blocks  # and nothing of it was applied
    finally:
        await broker.stop(grace=1)


# ---- 9: tenants one client (and no token) may name ----------------------------------------------


async def _raw_stream(channel: grpc.aio.Channel, client: str) -> grpc.aio.StreamStreamCall:
    """A Stream call that sends raw bytes, its hello exchanged."""
    call = channel.stream_stream(STREAM, request_serializer=None, response_deserializer=spb.StreamResponse.FromString)()
    await call.write(spb.StreamRequest(hello=spb.Hello(schema_major=1, client_id=client)).SerializeToString())
    await call.read()
    return call


def _batch(client: str, seq: int, tenant: str, ts: int) -> bytes:
    b = pb.IntentBatch(client_id=client, batch_seq=seq, tenant=tenant, events=[alloc(f"{tenant}-{client}-{seq}", ts=ts)])
    return spb.StreamRequest(batch=b).SerializeToString()


async def test_tenants_per_client_and_unknown_tenants_are_bounded(tmp_path: Path) -> None:
    """Without authentication, one stream names a new tenant in each batch (the issue sent
    100,000). Past limits.max_tenants_per_client (3 here) its batches naming a new tenant
    are refused whole, field tenant, naming the limit; its known tenants still apply. A
    second client adds tenants until limits.max_tenants (5) is reached; then a third is
    refused a new tenant but not a known one. The core keeps state for 5 tenants, not one
    per batch, and a restarted broker counts the same."""
    url = f"file://{tmp_path}/t.journal"
    config = secured_config(tmp_path, limits="max_tenants_per_client = 3\nmax_tenants = 5", journal_url=url)
    broker = await start_broker(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{broker.port}") as channel:
            call = await _raw_stream(channel, "one")
            answers = []
            seq: dict[str, int] = {}
            for i, tenant in enumerate([f"t{n}" for n in range(10)] + ["t0", "t2"]):
                seq[tenant] = seq.get(tenant, 0) + 1
                await call.write(_batch("one", seq[tenant], tenant, ts=i + 1))
                answers.append((await call.read()).directives)
            accepted = [a.accepted_events for a in answers]
            assert accepted == [1, 1, 1] + [0] * 7 + [1, 1]
            refusal = answers[3].rejections[0]
            assert (refusal.event_index, refusal.field, refusal.code) == (-1, "tenant", "RESOURCE_EXHAUSTED")
            assert "limits.max_tenants_per_client = 3" in refusal.reason
            for client, tenants, expected in (("two", ("t0", "t3", "t4"), [1, 1, 1]), ("three", ("t5", "t4"), [0, 1])):
                call = await _raw_stream(channel, client)
                got = []
                for tenant in tenants:
                    await call.write(_batch(client, 1, tenant, ts=100))
                    got.append((await call.read()).directives)
                assert [a.accepted_events for a in got] == expected, got
            assert "limits.max_tenants = 5" in got[0].rejections[0].reason
        core = broker.service.core
        assert set(core.tenant_clients) == {"t0", "t1", "t2", "t3", "t4"}
        assert set(core.time_anchor) <= {"", "t0", "t1", "t2", "t3", "t4"}
        assert broker.service.stats().refused_batches["tenants"] == 8
        counts = (dict(core.client_tenants), dict(core.tenant_clients))
    finally:
        await broker.stop(grace=1)
    again = await start_broker(config)
    try:
        assert (dict(again.service.core.client_tenants), dict(again.service.core.tenant_clients)) == counts
    finally:
        await again.stop(grace=1)


# ---- 10: a stream that never reads its answers costs only itself --------------------------------


async def _settled(count: Callable[[], int], quiet_s: float = 1.0, limit_s: float = 60.0) -> int:
    """``count()`` once it has not changed for ``quiet_s`` (or ``limit_s`` passed)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    last, since = count(), loop.time()
    while loop.time() < end:
        await asyncio.sleep(0.1)
        now = count()
        if now != last:
            last, since = now, loop.time()
        elif loop.time() - since >= quiet_s:
            break
    return last


async def test_a_stream_that_never_reads_its_answers_stops_being_read_and_costs_only_itself(tmp_path: Path) -> None:
    """A client sends 24 of the largest batches (10,000 events, each rejected: an answer of
    about 0.85 MB) and reads nothing. The broker applies a few (what gRPC's windows take,
    plus limits.max_unread_answer_bytes = 1 MiB of answers) and then stops reading the
    stream: before, it applied 66 and held them all (STREAM_PIPELINE = 64 answers). Another
    client's GetStats is answered at once meanwhile. When the client reads, the rest is
    applied and answered, in order, none lost."""
    broker = await start_broker(small_config())
    total = 24
    events = pb.IntentBatch(
        events=[pb.Event(ts_us=1, accessed=pb.BlocksAccessed(block_ids=[f"no-such-block-{i}"])) for i in range(10_000)]
    ).SerializeToString()
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{broker.port}") as slow,
            grpc.aio.insecure_channel(f"127.0.0.1:{broker.port}") as other,
        ):
            call = await _raw_stream(slow, "slow")

            async def flood() -> None:
                for seq in range(1, total + 1):
                    batch = pb.IntentBatch(client_id="slow", batch_seq=seq).SerializeToString() + events
                    await call.write(b"\x12" + _varint(len(batch)) + batch)  # StreamRequest{batch}

            writer = asyncio.get_running_loop().create_task(flood())
            core = broker.service.core
            applied = await _settled(lambda: core.stats.batches)
            assert 1 <= applied <= 16, applied  # bounded in count; before: 66
            stats = spb_grpc.BrokerServiceStub(other)
            for _ in range(10):
                began = asyncio.get_running_loop().time()
                await stats.GetStats(spb.GetStatsRequest(), timeout=30)
                assert asyncio.get_running_loop().time() - began < 1.0  # about 2 ms; a wide margin
            assert core.stats.batches == applied  # still held back
            answered = []
            for _ in range(total):
                answered.append((await call.read()).directives)
            await writer
            assert [a.batch_seq for a in answered] == list(range(1, total + 1))
            assert all(len(a.rejections) == 10_000 for a in answered)
            assert core.stats.batches == total
    finally:
        await broker.stop(grace=1)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)
