"""The service under abuse (issue 33, items 8-11), over real gRPC on a free loopback port
where the service is the subject. Each test failed before its fix."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from broker.service.server import start_broker
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import broker_service_pb2_grpc as spb_grpc
from kvbroker.v1 import intent_pb2 as pb
from tests.broker.service.test_security import secured_config, tokens_file
from tests.builders import alloc

# ---- 11: a stream without a token is UNAUTHENTICATED, every time ------------------------------------

TRIES = 50


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
