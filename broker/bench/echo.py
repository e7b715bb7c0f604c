"""The ceiling of `kvbroker bench`: the broker's Stream method with nothing behind it.

Same service and method name, same raw-bytes requests, same grpc.aio server on uvloop: it
answers the hello with a HelloReply and every batch with an empty DirectiveBatch, without
decoding, applying or journaling anything. What the broker reaches against what this
reaches is the share of the transport's ceiling the broker's own work leaves.

    python -m broker.bench.echo --listen 127.0.0.1:0   # prints {"event": "listening", "port": N}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from collections.abc import AsyncIterator

import grpc

from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import directive_pb2 as dpb

SERVICE_NAME = "kvbroker.v1.BrokerService"
MAX_MESSAGE_BYTES = 64 * 2**20
HELLO = spb.StreamResponse(hello=spb.HelloReply(served_majors=[1], broker_id="echo", policy="echo", config_generation=1))
EMPTY = spb.StreamResponse(directives=dpb.DirectiveBatch())


async def echo_stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[spb.StreamResponse]:
    if await anext(aiter(requests), None) is None:
        return
    yield HELLO
    async for _raw in requests:
        yield EMPTY


async def serve(listen: str) -> None:
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    )
    handler = grpc.stream_stream_rpc_method_handler(
        echo_stream, request_deserializer=None, response_serializer=spb.StreamResponse.SerializeToString
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {"Stream": handler}),))
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(json.dumps({"event": "listening", "port": port, "policy": "echo"}), flush=True)
    await stop.wait()
    await server.stop(1.0)


def main() -> None:
    import uvloop

    parser = argparse.ArgumentParser(description="the echo ceiling of kvbroker bench")
    parser.add_argument("--listen", default="127.0.0.1:0")
    uvloop.run(serve(parser.parse_args().listen))


if __name__ == "__main__":
    main()
