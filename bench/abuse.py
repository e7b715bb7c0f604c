"""The service under abuse (issue 33, items 8-10), against a real ``kvbroker serve``.

Each case starts a broker (this checkout, or ``--root`` another checkout's tree, run with
this interpreter) on a fresh file journal, abuses it over loopback gRPC, and prints one
JSON line of what it cost:

- ``cleared``: one client opens 65,536 request scopes, another sends one batch of 10,000
  ``cleared``; that batch's round trip, the slowest GetStats of a third client meanwhile,
  and the restart time on the journal (the broker replays it).
- ``tenants``: one unauthenticated stream names a new tenant in each of N batches;
  batches/s over the first and the last 10% of them, the broker's RSS before and after,
  and the restart time.
- ``refused``: with bearer tokens on, streams without a token (and with two authorization
  headers), each on a new channel, write their hello and read: the codes they end with.
- ``unread``: S streams send the largest batches allowed (10,000 events, each rejected,
  so each answer is large) and never read their answers, for 2T seconds; the broker's RSS
  growth, the slowest GetStats of another client (over all, and over the second T), and
  the batches the broker applied.

    python bench/abuse.py cleared|tenants|unread|refused [--root DIR] [--tenants N] [--streams S] [--seconds T] [--limits TOML]

Wall-clock figures: noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from kvbroker.v1 import broker_service_pb2 as spb  # noqa: E402
from kvbroker.v1 import intent_pb2 as pb  # noqa: E402

STREAM = "/kvbroker.v1.BrokerService/Stream"
STATS = "/kvbroker.v1.BrokerService/GetStats"
TOKEN = "acme-token-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Broker:
    """A ``kvbroker serve`` of ``root`` on ``journal``; ``start`` returns the seconds it took
    to answer GetStats (a restart replays the journal first)."""

    def __init__(self, root: Path, journal: Path, port: int, limits: str = "", tokens: bool = False) -> None:
        self.root, self.journal, self.port, self.limits = root, journal, port, limits
        self.tokens = journal.with_suffix(".tokens") if tokens else None
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> float:
        config = self.journal.with_suffix(".toml")
        limits = f"[limits]\n{self.limits}\n" if self.limits else ""
        if self.tokens is not None:
            self.tokens.write_text(f"{TOKEN} acme\n")
            limits += f'[security]\ntokens_file = "{self.tokens}"\n'
        config.write_text(f'[broker]\nlisten = "127.0.0.1:{self.port}"\n[journal]\nurl = "file://{self.journal}"\n{limits}')
        code = "import sys; from broker.cli.main import main; sys.argv[0] = 'kvbroker'; sys.exit(main())"
        env = {**os.environ, "PYTHONPATH": str(self.root)}
        began = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, "serve", "--config", str(config), "--log-level", "warning"],
            cwd=self.root,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.journal.with_suffix(".log").open("ab"),
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as ch:
            while True:
                try:
                    metadata = (("authorization", f"Bearer {TOKEN}"),) if self.tokens is not None else None
                    await ch.unary_unary(STATS, request_serializer=None, response_deserializer=None)(b"", timeout=5, metadata=metadata)
                    return time.perf_counter() - began
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.PERMISSION_DENIED:  # up, and GetStats needs an admin token
                        return time.perf_counter() - began
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"the broker exited with {self.proc.returncode}") from None
                    await asyncio.sleep(0.1)

    def rss(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


async def open_stream(ch: grpc.aio.Channel, client: str, tenant: str = "") -> grpc.aio.StreamStreamCall:
    call = ch.stream_stream(STREAM, request_serializer=None, response_deserializer=spb.StreamResponse.FromString)()
    await call.write(spb.StreamRequest(hello=spb.Hello(schema_major=1, client_id=client, tenant=tenant)).SerializeToString())
    await call.read()
    return call


def _wrap(batch: bytes) -> bytes:
    """StreamRequest{batch} around serialized IntentBatch bytes (field 2, length-delimited)."""
    n, varint = len(batch), bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        varint.append(byte | (0x80 if n else 0))
        if not n:
            return b"\x12" + bytes(varint) + batch


def batch_bytes(client: str, seq: int, events: list[pb.Event], tenant: str = "") -> bytes:
    b = pb.IntentBatch(client_id=client, batch_seq=seq, tenant=tenant, events=events)
    return spb.StreamRequest(batch=b).SerializeToString()


async def stats_watch(ch: grpc.aio.Channel, stop: asyncio.Event, worst: list[float]) -> None:
    """GetStats in a loop until ``stop``: the slowest round trip into ``worst[0]``."""
    call = ch.unary_unary(STATS, request_serializer=None, response_deserializer=None)
    while not stop.is_set():
        began = time.perf_counter()
        try:
            await call(b"", timeout=120)
        except grpc.aio.AioRpcError as exc:  # counted as the time it took, and said
            print(f"GetStats failed: {exc.code().name} {exc.details()}", file=sys.stderr)
        worst[0] = max(worst[0], time.perf_counter() - began)
        await asyncio.sleep(0.05)


async def case_cleared(broker: Broker) -> dict[str, object]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{broker.port}") as ch:
        big = await open_stream(ch, "big")
        for n in range(7):  # 70,000 scopes named: 65,536 stay open (the cap per client)
            events = [pb.Event(ts_us=1, accessed=pb.BlocksAccessed(scope=f"r{n * 10_000 + i}")) for i in range(10_000)]
            await big.write(batch_bytes("big", n + 1, events))
            await big.read()
        small = await open_stream(ch, "small")
        stop, worst = asyncio.Event(), [0.0]
        watcher = asyncio.get_running_loop().create_task(stats_watch(ch, stop, worst))
        await asyncio.sleep(0.3)
        began = time.perf_counter()
        await small.write(batch_bytes("small", 1, [pb.Event(ts_us=2, cleared=pb.AllBlocksCleared()) for _ in range(10_000)]))
        answer = (await small.read()).directives
        took = time.perf_counter() - began
        await asyncio.sleep(0.3)
        stop.set()
        await watcher
    broker.stop()
    restart = await broker.start()
    return {
        "clears_batch_s": round(took, 3),
        "accepted": answer.accepted_events,
        "getstats_worst_s": round(worst[0], 3),
        "restart_s": round(restart, 2),
    }


async def case_tenants(broker: Broker, n: int) -> dict[str, object]:
    rss0 = broker.rss()
    tenth = max(1, n // 10)
    marks: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{broker.port}") as ch:
        call = await open_stream(ch, "many")

        async def reader() -> None:
            for i in range(n):
                await call.read()
                if i % tenth == 0 or i == n - 1:
                    marks.append(time.perf_counter())

        task = asyncio.get_running_loop().create_task(reader())
        for i in range(n):
            alloc = pb.Event(ts_us=1 + i, allocated=pb.BlockAllocated(intent=pb.MemoryIntent(block_id=f"b{i}", size_bytes=1)))
            await call.write(batch_bytes("many", 1, [alloc], tenant=f"tenant-{i}"))
        await task
    rss1 = broker.rss()
    first = tenth / (marks[1] - marks[0])
    last = tenth / (marks[-1] - marks[-2]) if len(marks) > 2 else first
    broker.stop()
    restart = await broker.start()
    return {
        "tenants": n,
        "first_batches_per_s": round(first),
        "last_batches_per_s": round(last),
        "rss_growth_mib": round((rss1 - rss0) / 2**20, 1),
        "restart_s": round(restart, 2),
    }


async def case_unread(broker: Broker, streams: int, seconds: float) -> dict[str, object]:
    rss0 = broker.rss()
    peak = rss0
    # 10,000 accesses of unknown blocks: the batch is within max_batch_work, each event is
    # rejected with its field and reason, so each answer is large (about 0.8 MB).
    # The events serialized once; a batch is its header then them (fields in any order), so
    # that the floods cost this process little and its GetStats figures are the broker's.
    events = pb.IntentBatch(
        events=[pb.Event(ts_us=1, accessed=pb.BlocksAccessed(block_ids=[f"no-such-block-{i}"])) for i in range(10_000)]
    ).SerializeToString()

    def flood_batch(client: str, seq: int) -> bytes:
        batch = pb.IntentBatch(client_id=client, batch_seq=seq).SerializeToString() + events
        return _wrap(batch)

    async with grpc.aio.insecure_channel(f"127.0.0.1:{broker.port}") as ch, grpc.aio.insecure_channel(f"127.0.0.1:{broker.port}") as other:
        sent = [0] * streams

        async def flood(k: int) -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{broker.port}") as own:
                call = await open_stream(own, f"slow{k}")
                seq = 0
                while True:
                    seq += 1
                    await call.write(flood_batch(f"slow{k}", seq))
                    sent[k] = seq

        del ch
        floods = [asyncio.get_running_loop().create_task(flood(k)) for k in range(streams)]
        stop, worst = asyncio.Event(), [0.0]
        watcher = asyncio.get_running_loop().create_task(stats_watch(other, stop, worst))
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            await asyncio.sleep(0.5)
            peak = max(peak, broker.rss())
        stop.set()
        await watcher
        # Then as long again: the slowest GetStats once the floods had their first seconds.
        rss_mid = broker.rss()
        stop, late = asyncio.Event(), [0.0]
        watcher = asyncio.get_running_loop().create_task(stats_watch(other, stop, late))
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            await asyncio.sleep(0.5)
            peak = max(peak, broker.rss())
        stop.set()
        await watcher
        stats = spb.GetStatsResponse.FromString(
            await other.unary_unary(STATS, request_serializer=None, response_deserializer=None)(b"", timeout=120)
        )
        rss1 = broker.rss()
        for task in floods:
            task.cancel()
        await asyncio.gather(*floods, return_exceptions=True)
    return {
        "streams": streams,
        "seconds": seconds,
        "batches_applied": stats.batches,
        "rss_growth_mib": round((rss1 - rss0) / 2**20, 1),
        "rss_peak_growth_mib": round((peak - rss0) / 2**20, 1),
        "rss_growth_at_half_mib": round((rss_mid - rss0) / 2**20, 1),
        "getstats_worst_s": round(worst[0], 3),
        "getstats_worst_second_half_s": round(late[0], 3),
    }


async def case_refused(broker: Broker, tries: int) -> dict[str, object]:
    """Streams without a token (and with two authorization headers), each on a new channel
    as a client that starts: write the hello, then read. The codes they end with."""
    codes: dict[str, dict[str, int]] = {}
    two = (("authorization", "Bearer x"), ("authorization", "Bearer y"))
    for name, metadata in (("no_token", None), ("two_headers", two)):
        seen = codes[name] = {}
        for _ in range(tries):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{broker.port}") as ch:
                call = ch.stream_stream(STREAM, request_serializer=None, response_deserializer=None)(metadata=metadata)
                try:
                    await call.write(spb.StreamRequest(hello=spb.Hello(schema_major=1, client_id="e")).SerializeToString())
                    await call.read()
                    code = "OK"
                except grpc.aio.AioRpcError as exc:
                    code = exc.code().name
                except asyncio.InvalidStateError:  # the write met the ended call: its status counts
                    code = (await call.code()).name
            seen[code] = seen.get(code, 0) + 1
    return {"tries": tries, "codes": codes}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", choices=("cleared", "tenants", "unread", "refused"))
    parser.add_argument("--root", type=Path, default=HERE, help="the checkout whose broker runs (default: this one)")
    parser.add_argument("--tenants", type=int, default=30_000)
    parser.add_argument("--tries", type=int, default=50)
    parser.add_argument("--streams", type=int, default=30)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--limits", default="", help='lines of the [limits] table, e.g. "max_tenants_per_client = 0"')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        broker = Broker(
            args.root.resolve(), Path(tmp) / "abuse.journal", free_port(), args.limits.replace("\\n", "\n"), args.case == "refused"
        )
        await broker.start()
        try:
            if args.case == "cleared":
                result = await case_cleared(broker)
            elif args.case == "refused":
                result = await case_refused(broker, args.tries)
            elif args.case == "tenants":
                result = await case_tenants(broker, args.tenants)
            else:
                result = await case_unread(broker, args.streams, args.seconds)
        finally:
            exited = broker.proc.poll() if broker.proc is not None else None
            broker.stop()
            if exited is not None:
                print(f"the broker had exited ({exited}):", (Path(tmp) / "abuse.log").read_text()[-2000:], file=sys.stderr)
    print(json.dumps({"case": args.case, "root": str(args.root), **result}))


if __name__ == "__main__":
    asyncio.run(main())
