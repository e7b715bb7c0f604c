"""The load generators of `kvbroker bench`: one process per stream, driven over a pipe.

A worker serializes its engine's events once when it starts (broker.bench.workload), then
serves runs: ``prepare`` (cut this run's messages out of the blob, open the stream and
exchange hellos), ``go`` (send from a start time shared with the other workers, with up to
``window`` batches unanswered, optionally paced at a fixed rate; measure each batch's round
trip from the write to its answer), ``cleanup`` (one ``cleared`` batch so the broker holds
nothing of the run, then close). Streams carry raw bytes both ways: nothing is encoded or
decoded while the clock runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import traceback
from array import array
from multiprocessing.connection import Connection
from typing import Any

import grpc

from broker.bench.workload import Encoded, cleared_events, encode_workload, hello_request, stream_request
from kvbroker.v1 import broker_service_pb2 as spb

STREAM_METHOD = "/kvbroker.v1.BrokerService/Stream"
MAX_MESSAGE_BYTES = 64 * 2**20
TIMEOUT_S = 30.0  # hello, and the last answers after the sending stopped


@dataclasses.dataclass(frozen=True)
class RunSpec:
    target: str
    client_id: str
    tag: bytes  # replaces MARK in this run's ids
    batch: int
    events: int  # at most this many events
    seconds: float  # stop sending after this long
    window: int  # batches unanswered at most
    rate: float  # events/s of this stream; 0 = as fast as answers allow
    phase: float = 0.0  # paced: start this fraction of a batch interval late (streams interleave)


@dataclasses.dataclass
class RunResult:
    events: int = 0
    batches: int = 0
    started: float = 0.0  # time.monotonic() of the first write
    finished: float = 0.0  # of the last answer
    rtts: bytes = b""  # array("d") of round trips in seconds, in send order
    cleanup_events: int = 0
    error: str = ""


class _Stream:
    def __init__(self, spec: RunSpec, encoded: Encoded) -> None:
        self.spec = spec
        blob = encoded.tagged(spec.tag)
        cid = spec.client_id.encode()
        offsets = encoded.offsets
        n = min(spec.events, encoded.count)
        self.messages = [
            stream_request(cid, seq, blob[offsets[start] : offsets[min(start + spec.batch, n)]])
            for seq, start in enumerate(range(0, n, spec.batch), start=1)
        ]
        self.sizes = [min(spec.batch, n - start) for start in range(0, n, spec.batch)]
        self.end_us = encoded.end_us
        self.sent = 0  # batches written (seq 1..sent): a run may stop before the last
        self.channel: Any = None
        self.call: Any = None

    async def open(self) -> None:
        from clients.broker_client import ClientSecurity

        security = ClientSecurity.from_env()
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        self.channel = security.aio_channel(self.spec.target, options)
        method = self.channel.stream_stream(STREAM_METHOD, request_serializer=None, response_deserializer=None)
        self.call = method(metadata=security.metadata())
        await asyncio.wait_for(self.call.write(hello_request(self.spec.client_id)), TIMEOUT_S)
        reply = await asyncio.wait_for(self.call.read(), TIMEOUT_S)
        if reply is grpc.aio.EOF or spb.StreamResponse.FromString(reply).WhichOneof("kind") != "hello":
            raise ConnectionError(f"no hello reply from {self.spec.target}: {await self.call.code()}: {await self.call.details()}")

    async def run(self, start_at: float) -> RunResult:
        spec, call = self.spec, self.call
        window = asyncio.Semaphore(spec.window)
        progress = asyncio.Event()  # a write, or the end of the writes
        sent_at: list[float] = []
        rtts = array("d")
        result = RunResult()
        interval = spec.batch / spec.rate if spec.rate > 0 else 0.0
        done_writing = False

        async def reader() -> None:
            try:
                await read_answers()
            finally:
                for _ in range(spec.window):  # a writer waiting for room wakes and sees the end
                    window.release()

        async def read_answers() -> None:
            received = 0
            while True:
                # Read only when an answer is due: a read never waits on a finished run.
                while received >= len(sent_at):
                    if done_writing:
                        return
                    progress.clear()
                    await progress.wait()
                answer = await call.read()
                now = time.monotonic()
                if answer is grpc.aio.EOF:
                    raise ConnectionError(f"stream ended: {await call.code()}: {await call.details()}")
                rtts.append(now - sent_at[received])
                received += 1
                result.finished = now
                window.release()

        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        task = asyncio.create_task(reader())
        t0 = time.monotonic()
        deadline = t0 + spec.seconds
        t0 += spec.phase * interval
        result.started = t0
        for i, message in enumerate(self.messages):
            if interval:
                delay = t0 + i * interval - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            if time.monotonic() >= deadline or task.done():
                break
            await window.acquire()
            if task.done():
                break
            sent_at.append(time.monotonic())
            await call.write(message)
            result.events += self.sizes[i]
            progress.set()
        done_writing = True
        progress.set()
        await asyncio.wait_for(task, TIMEOUT_S)  # raises what the reader raised
        result.batches = self.sent = len(sent_at)
        result.rtts = rtts.tobytes()
        result.finished = result.finished or time.monotonic()
        return result

    async def cleanup(self) -> int:
        """One ``cleared`` batch: the run leaves nothing behind in the broker."""
        # The next number: the broker refuses a batch_seq that jumps (limits.max_batch_seq_gap).
        seq = self.sent + 1
        await self.call.write(stream_request(self.spec.client_id.encode(), seq, cleared_events(self.end_us)))
        answer = await asyncio.wait_for(self.call.read(), TIMEOUT_S)
        if answer is grpc.aio.EOF:
            raise ConnectionError("stream ended before the cleanup batch was answered")
        await self.call.done_writing()
        return 1

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


async def _serve_run(conn: Connection, encoded: Encoded, spec: RunSpec) -> None:
    loop = asyncio.get_running_loop()
    stream = _Stream(spec, encoded)
    try:
        await stream.open()
        conn.send(("prepared", len(stream.messages)))
        command, start_at = await loop.run_in_executor(None, conn.recv)
        if command != "go":
            return
        result = await stream.run(start_at)
        conn.send(("timed", result))
        command, _ = await loop.run_in_executor(None, conn.recv)
        if command == "cleanup":
            result.cleanup_events = await stream.cleanup()
            conn.send(("done", result.cleanup_events))
    finally:
        await stream.close()


def worker_main(conn: Connection, client: int, events: int, seed: int, prefix_cache: bool = False) -> None:
    """A worker process: encode once, then serve runs until told to stop."""
    import uvloop

    try:
        encoded = encode_workload(client, events, seed, prefix_cache=prefix_cache)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    info = {
        "events": encoded.count,
        "bytes": len(encoded.blob),
        "mix": encoded.mix,
        "block_ids_per_event": encoded.block_ids / max(1, encoded.count),
    }
    conn.send(("ready", info))
    while True:
        try:
            command, arg = conn.recv()
        except EOFError:
            return
        if command == "stop":
            return
        try:
            uvloop.run(_serve_run(conn, encoded, arg))
        except Exception as exc:
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else ""
            conn.send(("error", f"{type(exc).__name__}: {exc} {detail}".strip()))
