"""Fuzzing the wire: hypothesis-made bytes on the Stream and Submit RPCs of one real broker.

One ``kvbroker serve`` process takes every example of this module, so a crash of the process
is seen at once: policy priority_lru (it prefetches) with every other live policy as a
shadow, so each example runs through all of them, and a file journal in a temporary folder. The bytes are sent through a raw
channel (identity serializers), because protobuf-python refuses to serialize most of what is
tried here: random bytes, valid StreamRequests with bit flips and truncations, hand-built
wire bytes with invalid UTF-8 in string fields, varints up to 2^64-1 and int64 negatives in
every integer field, unknown enum values, unknown fields, wrong wire types, overlong
varints, and (bounded) huge repeated fields.

After each example: the process is alive, a healthy stream opened at the start still gets
correct answers, GetStats answers, and the bad input got a clear error: a gRPC status with a
message (INVALID_ARGUMENT, FAILED_PRECONDITION) for a bad first message or Submit, or a
per-batch rejection that names a field with a reason and a known code. At the end the broker
stops cleanly on SIGTERM and a new one recovers from the fuzzed journal.

Examples per test: ``KVBROKER_FUZZ_EXAMPLES`` (default 100, a few seconds a test here); set it
to thousands for a long run, e.g. ``KVBROKER_FUZZ_EXAMPLES=5000 pytest -n 0 -p no:cacheprovider
tests/broker/service/test_fuzz_server.py``.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import intent_pb2 as pb
from policies import registry
from policies.registry import policy_class
from tests.e2e.test_cli import start_serve

pytestmark = pytest.mark.e2e

# A settings profile for every fuzz test of this module: bounded in CI, raised for long runs.
FUZZ_EXAMPLES = int(os.environ.get("KVBROKER_FUZZ_EXAMPLES", "100"))
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)

STREAM = "/kvbroker.v1.BrokerService/Stream"
SUBMIT = "/kvbroker.v1.BrokerService/Submit"
STATS = "/kvbroker.v1.BrokerService/GetStats"
CODES = {"INVALID_ARGUMENT", "FAILED_PRECONDITION", "ALREADY_EXISTS", "RESOURCE_EXHAUSTED", "PERMISSION_DENIED"}
# Statuses a bad first message or Submit may end with; each must carry a message.
CLEAR_STATUSES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
U64 = 2**64 - 1
TIMEOUT = 30.0

# The primary prefetches; every other live policy runs as a shadow on the same fuzzed events.
PRIMARY = "priority_lru"
SHADOWS = [n for n in registry.names() if n != PRIMARY and not policy_class(n).offline]
CONFIG = f"""
[policy]
name = "{PRIMARY}"
shadows = {SHADOWS!r}
[[tiers]]
name = "hbm"
capacity = 1000
[[tiers]]
name = "dram"
capacity = 3000
[[tiers]]
name = "nvme"
capacity = 20000
""".replace("'", '"')

# ---- protobuf wire bytes by hand -------------------------------------------------------------


def varint(n: int) -> bytes:
    """Base-128 varint; a negative n is written as its 64-bit two's complement (int64 on the wire)."""
    n &= U64
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def tag(number: int, wire: int) -> bytes:
    return varint((number << 3) | wire)


def ld(number: int, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes, sub-message)."""
    return tag(number, 2) + varint(len(payload)) + payload


def vi(number: int, value: int) -> bytes:
    return tag(number, 0) + varint(value)


def hello_bytes(client_id: str, major: int = 1) -> bytes:
    return spb.Hello(schema_major=major, client_id=client_id).SerializeToString()


# Field kinds: s string, u unsigned varint, i int64, e enum, b bool, m sub-message.
SCHEMA: dict[str, dict[int, tuple[str, str]]] = {
    "IntentBatch": {1: ("s", ""), 2: ("u", ""), 3: ("m", "Event"), 4: ("s", "")},
    "Event": {
        1: ("i", ""),
        2: ("m", "BlockAllocated"),
        3: ("m", "BlocksAccessed"),
        4: ("m", "IntentUpdated"),
        5: ("m", "BlockIds"),
        6: ("m", "BlockIds"),
        7: ("m", "Empty"),
        8: ("m", "DirectiveAcked"),
    },
    "BlockAllocated": {1: ("m", "MemoryIntent"), 2: ("s", ""), 3: ("b", "")},
    "MemoryIntent": {
        **{n: ("s", "") for n in (1, 2, 13, 18, 19)},
        3: ("e", ""),
        4: ("e", ""),
        **{n: ("i", "") for n in (5, 6, 7, 8)},
        **{n: ("u", "") for n in (9, 14, 15, 16, 17, 20, 21)},
        **{n: ("b", "") for n in (10, 11, 12, 22, 23, 24)},
    },
    "BlocksAccessed": {1: ("s", ""), 2: ("i", "")},
    "IntentUpdated": {
        1: ("s", ""),
        2: ("e", ""),
        3: ("e", ""),
        **{n: ("i", "") for n in (4, 5, 9)},
        **{n: ("b", "") for n in (6, 7, 8, 10)},
        **{n: ("u", "") for n in (11, 12)},
    },
    "BlockIds": {1: ("s", "")},
    "Empty": {},
    "DirectiveAcked": {1: ("u", ""), 2: ("e", ""), 3: ("s", ""), 4: ("s", "")},
}

# Required fields, set first (fuzzed fields after them may override them).
BASE: dict[str, Callable[[bytes, int], bytes]] = {
    "MemoryIntent": lambda name, size: ld(1, name) + vi(9, size),
    "IntentUpdated": lambda name, _: ld(1, name),
    "BlockIds": lambda name, _: ld(1, name),
    "BlocksAccessed": lambda name, _: ld(1, name),
    "Event": lambda _, ts: vi(1, ts),
}

# Few block and tier names, so allocations, accesses, updates and frees meet the same blocks.
NAMES = ["a", "b", "c", "a", "b", "c", "", "hbm", "dram", "nvme"]
INVALID_UTF8 = [b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"a\x80b", b"\xf4\x90\x80\x80", b"\xe2\x82"]
EDGE_INTS = [0, 1, 2, 100, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, U64, -1, -(2**31), -(2**63)]

# Mostly well-formed values (so that most batches reach the core), often at the edges.
names = st.sampled_from(NAMES).map(str.encode)


@st.composite
def strings(draw: st.DrawFn) -> bytes:
    """A known name mostly; any text; now and then invalid UTF-8 (one in a message fails it all)."""
    r = draw(st.integers(0, 39))  # hypothesis favours the ends: 0 is the plain case
    if r == 39:
        return draw(st.sampled_from(INVALID_UTF8))
    if r == 38:
        return draw(names) + draw(st.sampled_from(INVALID_UTF8))
    if r > 32:
        return draw(st.text(max_size=12)).encode()
    return draw(names)


small = st.integers(0, 300)
integers = st.one_of(small, small, st.sampled_from(EDGE_INTS), st.integers(-(2**63), U64))
enums = st.one_of(st.integers(0, 6), st.integers(0, 6), st.sampled_from(EDGE_INTS))
bools = st.sampled_from([0, 1, 0, 1, 2, 255, U64])


@st.composite
def wire_message(draw: st.DrawFn, name: str, depth: int = 0) -> bytes:
    """Wire bytes of message ``name``: known fields with valid and invalid values, plus
    unknown fields, wrong wire types, and malformed tails now and then."""
    fields = SCHEMA[name]
    out = bytearray()
    if name in BASE and draw(st.integers(0, 3)):  # mostly: the fields without which nothing applies
        out += BASE[name](draw(names), draw(st.integers(1, 300)))
    for _ in range(draw(st.integers(0, 6 if depth < 3 else 2))):
        choice = draw(st.integers(0, 39))
        if choice == 39 or not fields:  # an unknown field, of any wire type
            number = draw(st.integers(25, 2**29 - 1))
            wire = draw(st.sampled_from([0, 1, 2, 5]))
            body = {0: varint(draw(integers)), 1: draw(st.binary(min_size=8, max_size=8)), 5: draw(st.binary(min_size=4, max_size=4))}
            out += tag(number, wire) + body[wire] if wire != 2 else ld(number, draw(st.binary(max_size=16)))
            continue
        number = draw(st.sampled_from(sorted(fields)))
        kind, sub = fields[number]
        if choice == 38:  # a known field with a wrong wire type
            wire = draw(st.sampled_from([w for w in (0, 1, 2, 5) if w != (2 if kind in "sm" else 0)]))
            body = {0: varint(draw(integers)), 1: draw(st.binary(min_size=8, max_size=8)), 5: draw(st.binary(min_size=4, max_size=4))}
            out += tag(number, wire) + body[wire] if wire != 2 else ld(number, draw(st.binary(max_size=16)))
        elif kind == "s":
            out += ld(number, draw(strings()))
        elif kind in "ui":
            out += vi(number, draw(integers))
        elif kind == "e":
            out += vi(number, draw(enums))
        elif kind == "b":
            out += vi(number, draw(bools))
        elif depth < 4:
            body = draw(st.one_of(wire_message(sub, depth + 1), st.binary(max_size=24)) if choice == 37 else wire_message(sub, depth + 1))
            out += ld(number, body)
    tail = draw(st.integers(0, 40)) if depth == 0 else 0
    if tail == 40:  # an overlong varint: 11 bytes
        out += tag(1, 0) + b"\xff" * 10 + b"\x01"
    elif tail == 39:  # a length past the end
        out += tag(1, 2) + varint(1000) + b"x"
    elif tail == 38:  # an invalid wire type (6, 7) or a group start
        out += tag(draw(st.integers(1, 30)), draw(st.sampled_from([3, 4, 6, 7])))
    return bytes(out)


# ---- valid messages and mutations ------------------------------------------------------------

block_ids = st.sampled_from(["a", "b", "c", "d"])


def valid_event() -> st.SearchStrategy[pb.Event]:
    ts = st.integers(0, 10_000)
    allocated = st.builds(
        lambda t, b, size, pri, dl, tier: pb.Event(
            ts_us=t,
            allocated=pb.BlockAllocated(intent=pb.MemoryIntent(block_id=b, size_bytes=size, priority=pri, deadline_us=dl), tier=tier),
        ),
        ts,
        block_ids,
        st.integers(1, 400),
        st.integers(0, 4),
        st.integers(0, 20_000),
        st.sampled_from(["", "hbm", "dram"]),
    )
    ids = st.lists(block_ids, min_size=1, max_size=3)
    return st.one_of(
        allocated,
        st.builds(lambda t, b: pb.Event(ts_us=t, accessed=pb.BlocksAccessed(block_ids=b)), ts, ids),
        st.builds(
            lambda t, b, p: pb.Event(ts_us=t, intent_updated=pb.IntentUpdated(block_id=b, priority=p)), ts, block_ids, st.integers(0, 4)
        ),
        st.builds(lambda t, b: pb.Event(ts_us=t, released=pb.BlocksReleased(block_ids=b)), ts, ids),
        st.builds(lambda t, b: pb.Event(ts_us=t, freed=pb.BlocksFreed(block_ids=b)), ts, ids),
        st.builds(
            lambda t, d: pb.Event(ts_us=t, acked=pb.DirectiveAcked(directive_id=d, status=pb.ACK_STATUS_DONE)), ts, st.integers(0, 50)
        ),
    )


I64 = st.one_of(st.integers(0, 5000), st.sampled_from([0, 2**62, 2**63 - 1, -1, -(2**63)]), st.integers(-(2**63), 2**63 - 1))
U64S = st.one_of(st.integers(1, 500), st.sampled_from([2**32 - 1, 2**63 - 1, U64]), st.integers(0, U64))
U32 = st.one_of(st.integers(0, 100), st.sampled_from([101, 2**31, 2**32 - 1]))


@st.composite
def extreme_event(draw: st.DrawFn) -> pb.Event:
    """A well-typed event with values anywhere in their field's range (time near 2^63, sizes
    near 2^64, deadlines in the past and far future, any enum number)."""
    ts = draw(st.one_of(st.integers(0, 5000), st.sampled_from([2**62, 2**63 - 1])))
    kind = draw(st.sampled_from(["allocated", "accessed", "intent_updated", "acked", "released", "freed"]))
    block = draw(block_ids)
    if kind == "allocated":
        intent = pb.MemoryIntent(
            block_id=block,
            size_bytes=draw(U64S),
            phase=draw(st.integers(-(2**31), 2**31 - 1)) if draw(st.booleans()) else pb.PHASE_DECODE,
            priority=draw(st.sampled_from([0, 1, 2, 3, 4, 4, 5, -1, 2**31 - 1])),
            pin_requested=draw(st.booleans()),
            request_id=draw(st.sampled_from(["", "r1", "r2"])),
            parent_block_id=draw(st.sampled_from(["", "a", "b"])),
            allowed_tiers=draw(st.lists(st.sampled_from(["hbm", "dram", "nvme"]), max_size=3)),
            recompute_ok=draw(st.booleans()),
            prefetch_ok=draw(st.booleans()),
            is_draft=draw(st.booleans()),
            token_start=draw(st.integers(0, U64)),
            token_count=draw(U32),
        )
        for name in ("deadline_us", "slack_us", "recompute_cost_us", "spill_cost_us"):
            if draw(st.booleans()):
                setattr(intent, name, draw(I64))
        for name in ("request_priority", "expected_reuse_window_tokens"):
            if draw(st.booleans()):
                setattr(intent, name, draw(U32))
        tier = draw(st.sampled_from(["", "hbm", "dram", "nvme"]))
        return pb.Event(ts_us=ts, allocated=pb.BlockAllocated(intent=intent, tier=tier, reuse=draw(st.booleans())))
    if kind == "accessed":
        accessed = pb.BlocksAccessed(block_ids=draw(st.lists(block_ids, min_size=1, max_size=4)))
        if draw(st.booleans()):
            accessed.next_use_us = draw(I64)
        return pb.Event(ts_us=ts, accessed=accessed)
    if kind == "intent_updated":
        upd = pb.IntentUpdated(block_id=block, clear_deadline=draw(st.booleans()))
        for name in ("deadline_us", "slack_us", "recompute_cost_us"):
            if draw(st.booleans()):
                setattr(upd, name, draw(I64))
        for name in ("pin_requested", "is_committed", "is_draft"):
            if draw(st.booleans()):
                setattr(upd, name, draw(st.booleans()))
        if draw(st.booleans()):
            upd.priority = draw(st.sampled_from([0, 1, 3, 4, 9]))
        if draw(st.booleans()):
            upd.phase = draw(st.sampled_from([0, 2, 5, 6, 77]))
        for name in ("request_priority", "expected_reuse_window_tokens"):
            if draw(st.booleans()):
                setattr(upd, name, draw(U32))
        return pb.Event(ts_us=ts, intent_updated=upd)
    if kind == "acked":
        status = draw(st.sampled_from([pb.ACK_STATUS_DONE, pb.ACK_STATUS_FAILED, 0, 7]))
        tier = draw(st.sampled_from(["", "hbm", "dram", "nvme", "tape"]))
        return pb.Event(ts_us=ts, acked=pb.DirectiveAcked(directive_id=draw(st.integers(0, 200)), status=status, actual_tier=tier))  # type: ignore[arg-type]
    ids = draw(st.lists(block_ids, min_size=1, max_size=3))
    if kind == "released":
        return pb.Event(ts_us=ts, released=pb.BlocksReleased(block_ids=ids))
    return pb.Event(ts_us=ts, freed=pb.BlocksFreed(block_ids=ids))


@st.composite
def mutated(draw: st.DrawFn, raw: bytes) -> bytes:
    """``raw`` with bit flips, a truncation, an inserted or a duplicated run of bytes."""
    data = bytearray(raw)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "duplicate", "set"]))
        if not data:
            data += draw(st.binary(min_size=1, max_size=8))
            continue
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "duplicate":
            j = draw(st.integers(i, len(data)))
            data[j:j] = data[i:j]
        else:
            data[i] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF]))
    return bytes(data)


@st.composite
def batch_payloads(draw: st.DrawFn, client_id: str, seq: int) -> bytes:
    """IntentBatch wire bytes for ``client_id``: fuzzed fields after a correct client_id and
    batch_seq (so most reach the core), a mutated valid batch, or any bytes."""
    how = draw(st.sampled_from(["wire", "extreme", "wire", "extreme", "mutated", "random"]))
    if how == "random":
        return draw(st.binary(max_size=256))
    if how == "extreme":
        events = draw(st.lists(extreme_event(), min_size=1, max_size=12))
        return pb.IntentBatch(client_id=client_id, batch_seq=seq, events=events).SerializeToString()
    head = ld(1, client_id.encode()) + vi(2, seq)
    if how == "wire":
        return head + draw(wire_message("IntentBatch"))
    events = draw(st.lists(valid_event(), max_size=6))
    valid = pb.IntentBatch(client_id=client_id, batch_seq=seq, events=events).SerializeToString()
    return draw(mutated(valid))


@st.composite
def stream_messages(draw: st.DrawFn, client_id: str, seq: int) -> bytes:
    """One StreamRequest after the hello: mostly a batch, sometimes a hello again or junk."""
    how = draw(st.integers(0, 9))
    if how == 0:
        return draw(st.binary(max_size=64))
    if how == 1:
        return ld(1, hello_bytes(client_id))
    if how == 2:
        return draw(mutated(ld(2, draw(batch_payloads(client_id, seq)))))
    return ld(2, draw(batch_payloads(client_id, seq)))


# ---- the broker and its clients --------------------------------------------------------------


class Broker:
    """A `kvbroker serve` process whose output is drained (a full pipe would stall it)."""

    def __init__(self, folder: Path, config_text: str = CONFIG) -> None:
        self.folder = folder
        self.journal = folder / "fuzz.journal"
        self.proc, self.port = start_serve(folder, "--journal", f"file://{self.journal}", "--log-level", "warning", config_text=config_text)
        self.output: list[str] = []
        for pipe in (self.proc.stdout, self.proc.stderr):
            threading.Thread(target=self._drain, args=(pipe,), daemon=True).start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def _drain(self, pipe: Any) -> None:
        for line in pipe:
            self.output.append(line)

    def rss_kib(self) -> int:
        """Resident memory of the broker process (VmRSS), KiB."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    def alive(self) -> None:
        assert self.proc.poll() is None, f"the broker died (exit {self.proc.returncode}):\n{''.join(self.output[-60:])}"

    def stop(self) -> int:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("the broker did not stop on SIGTERM") from None
        return self.proc.returncode

    def stream(self, messages: list[bytes]) -> tuple[list[bytes], grpc.RpcError | None]:
        """Send ``messages`` on one Stream and half-close; the raw answers and the error status, if any."""
        call = self.channel.stream_stream(STREAM, request_serializer=None, response_deserializer=None)
        answers: list[bytes] = []
        try:
            for answer in call(iter(messages), timeout=TIMEOUT):
                answers.append(answer)
        except grpc.RpcError as exc:
            assert exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "the broker hung on the stream"
            return answers, exc
        return answers, None

    def submit(self, raw: bytes) -> tuple[bytes | None, grpc.RpcError | None]:
        call = self.channel.unary_unary(SUBMIT, request_serializer=None, response_deserializer=None)
        try:
            return call(raw, timeout=TIMEOUT), None
        except grpc.RpcError as exc:
            assert exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "the broker hung on Submit"
            return None, exc

    def stats(self) -> spb.GetStatsResponse:
        call = self.channel.unary_unary(STATS, request_serializer=None, response_deserializer=spb.GetStatsResponse.FromString)
        response: spb.GetStatsResponse = call(b"", timeout=TIMEOUT)
        return response


class HealthyStream:
    """A stream opened before the fuzzing that must keep getting correct answers."""

    def __init__(self, broker: Broker) -> None:
        self.requests: queue.Queue[bytes | None] = queue.Queue()
        call = broker.channel.stream_stream(STREAM, request_serializer=None, response_deserializer=spb.StreamResponse.FromString)
        self.responses = call(iter(self.requests.get, None))
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.seq = 0
        self.ts = 0
        hello = self._send(ld(1, hello_bytes("healthy")))
        assert hello.WhichOneof("kind") == "hello"
        first = self.batch(
            pb.Event(ts_us=0, allocated=pb.BlockAllocated(intent=pb.MemoryIntent(block_id="healthy-0", size_bytes=10), tier="dram"))
        )
        assert first.accepted_events == 1 and not first.rejections, first

    def _send(self, raw: bytes) -> spb.StreamResponse:
        self.requests.put(raw)
        response: spb.StreamResponse = self.pool.submit(next, self.responses).result(timeout=TIMEOUT)
        return response

    def batch(self, *events: pb.Event) -> Any:
        self.seq += 1
        batch = pb.IntentBatch(client_id="healthy", batch_seq=self.seq, events=events)
        response = self._send(spb.StreamRequest(batch=batch).SerializeToString())
        assert response.WhichOneof("kind") == "directives"
        assert (response.directives.client_id, response.directives.batch_seq) == ("healthy", self.seq)
        return response.directives

    def check(self) -> None:
        """An access and an update of its own block: both accepted, whatever the fuzz did."""
        self.ts += 1
        result = self.batch(
            pb.Event(ts_us=self.ts, accessed=pb.BlocksAccessed(block_ids=["healthy-0"])),
            pb.Event(ts_us=self.ts, intent_updated=pb.IntentUpdated(block_id="healthy-0", deadline_us=self.ts + 1000)),
        )
        assert result.accepted_events == 2 and not result.rejections, result

    def close(self) -> None:
        self.requests.put(None)
        self.pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    b = Broker(tmp_path_factory.mktemp("fuzz-broker"))
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture(scope="module")
def healthy(broker: Broker) -> Iterator[HealthyStream]:
    stream = HealthyStream(broker)
    yield stream
    stream.close()


_ids = itertools.count()


def fresh_client() -> str:
    return f"fuzz-{next(_ids):08d}"  # one width: what is drawn from it must not depend on the count


def still_serving(broker: Broker, healthy: HealthyStream) -> None:
    broker.alive()
    healthy.check()
    stats = broker.stats()
    assert stats.policy == PRIMARY and len(stats.arms) == 1 + len(SHADOWS)


def clean_up(broker: Broker, client_id: str) -> None:
    """Free what a fuzz client left (its blocks would fill the tiers over many examples)."""
    answers, error = broker.stream([ld(1, hello_bytes(client_id))])
    assert error is None and len(answers) == 1, error
    last = spb.StreamResponse.FromString(answers[0]).hello.last_batch_seq
    if last < U64:
        clear = pb.IntentBatch(client_id=client_id, batch_seq=last + 1, events=[pb.Event(cleared=pb.AllBlocksCleared())])
        answers, error = broker.stream([ld(1, hello_bytes(client_id)), ld(2, clear.SerializeToString())])
        assert error is None and len(answers) == 2, error


def clear_status(error: grpc.RpcError, allowed: set[grpc.StatusCode] = CLEAR_STATUSES) -> None:
    assert error.code() in allowed, (error.code(), error.details())
    assert error.details(), f"{error.code()} without a message"


def check_batch_answer(raw_request: bytes, raw_answer: bytes, client_id: str, applied: set[int]) -> None:
    """One answer to one StreamRequest after the hello: a clear rejection or an outcome that
    adds up, decided from what the bytes decode to (the same parser as the broker's)."""
    answer = spb.StreamResponse.FromString(raw_answer)
    assert answer.WhichOneof("kind") == "directives", answer
    result = answer.directives
    for rejection in result.rejections:
        assert rejection.field and rejection.reason and rejection.code in CODES, rejection
    try:
        request = spb.StreamRequest.FromString(raw_request)
    except DecodeError:
        assert [(r.event_index, r.field) for r in result.rejections] == [(-1, "batch")], result
        assert "malformed" in result.rejections[0].reason
        return
    if request.WhichOneof("kind") is None:  # an empty StreamRequest: said so (it was "hello already received")
        assert [(r.event_index, r.field) for r in result.rejections] == [(-1, "batch")], result
        assert "empty StreamRequest" in result.rejections[0].reason
        return
    if request.WhichOneof("kind") != "batch":
        assert [(r.event_index, r.field) for r in result.rejections] == [(-1, "hello")], result
        return
    batch = request.batch
    if batch.client_id != client_id:
        assert [(r.event_index, r.field) for r in result.rejections] == [(-1, "client_id")], result
        return
    if result.duplicate:
        assert batch.batch_seq <= max(applied, default=0) and not result.rejections
        return
    batch_level = [r for r in result.rejections if r.event_index == -1]
    if batch_level:
        assert len(result.rejections) == 1 and result.accepted_events == 0, result
        return
    applied.add(batch.batch_seq)
    assert result.batch_seq == batch.batch_seq
    assert result.accepted_events + len(result.rejections) == len(batch.events), result
    indexes = [r.event_index for r in result.rejections]
    assert indexes == sorted(set(indexes)) and all(0 <= i < len(batch.events) for i in indexes), result


# ---- the fuzz tests --------------------------------------------------------------------------


@FUZZ
@given(
    first=st.one_of(
        st.binary(max_size=200), st.builds(ld, st.just(1), wire_message("IntentBatch")), st.builds(ld, st.just(2), st.binary(max_size=64))
    )
)
@example(first=ld(1, ld(3, b"\xff\xfe")))  # a hello whose client_id is invalid UTF-8
@example(first=ld(1, vi(1, U64) + ld(3, b"x")))  # schema_major past uint32
@example(first=b"")
def test_a_bad_first_message_ends_its_stream_with_a_clear_status(broker: Broker, healthy: HealthyStream, first: bytes) -> None:
    answers, error = broker.stream([first])
    if error is not None:
        clear_status(error)
    else:  # it decoded to a valid hello after all
        assert len(answers) == 1 and spb.StreamResponse.FromString(answers[0]).WhichOneof("kind") == "hello"
    still_serving(broker, healthy)


@FUZZ
@given(data=st.data(), count=st.integers(1, 4))
@example(data=None, count=0)  # a hello, then nothing: the broker answers the hello only
def test_bad_batches_get_per_batch_errors_and_the_stream_lives(broker: Broker, healthy: HealthyStream, data: Any, count: int) -> None:
    client_id = fresh_client()
    messages = [data.draw(stream_messages(client_id, seq)) for seq in range(1, count + 1)] if data is not None else []
    answers, error = broker.stream([ld(1, hello_bytes(client_id)), *messages])
    assert error is None, f"the stream died: {error.code()} {error.details()}"
    assert len(answers) == 1 + len(messages), "every message after the hello is answered"
    assert spb.StreamResponse.FromString(answers[0]).WhichOneof("kind") == "hello"
    applied: set[int] = set()
    for request, answer in zip(messages, answers[1:], strict=True):
        check_batch_answer(request, answer, client_id, applied)
    clean_up(broker, client_id)
    still_serving(broker, healthy)


@FUZZ
@given(
    data=st.data(),
    hello=st.one_of(
        st.none(),  # a valid hello
        st.binary(max_size=32),
        st.sampled_from([ld(3, b"\xff"), vi(1, 2) + ld(3, b"x"), vi(1, U64), b""]),
    ),
    how=st.sampled_from(["fields", "mutated", "random"]),
)
def test_bad_submits_get_a_clear_status_or_rejection(
    broker: Broker, healthy: HealthyStream, data: Any, hello: bytes | None, how: str
) -> None:
    client_id = fresh_client()
    hello_raw = hello_bytes(client_id) if hello is None else hello
    batch = data.draw(batch_payloads(client_id, 1))
    raw = ld(1, hello_raw) + ld(2, batch)
    if how == "mutated":
        raw = data.draw(mutated(raw))
    elif how == "random":
        raw = data.draw(st.binary(max_size=300))
    answer, error = broker.submit(raw)
    try:
        request = spb.SubmitRequest.FromString(raw)
    except DecodeError:
        assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert "malformed SubmitRequest" in (error.details() or "")
        request = None
    if request is not None:
        if error is not None:
            clear_status(error)
        else:
            assert answer is not None
            result = spb.SubmitResponse.FromString(answer).directives
            for rejection in result.rejections:
                assert rejection.field and rejection.reason and rejection.code in CODES, rejection
            if not result.duplicate and not any(r.event_index == -1 for r in result.rejections):
                assert result.accepted_events + len(result.rejections) == len(request.batch.events), result
        if request.hello.client_id:
            clean_up(broker, request.hello.client_id)
    still_serving(broker, healthy)


def accessed_many(n: int) -> pb.Event:
    return pb.Event(ts_us=1, accessed=pb.BlocksAccessed(block_ids=[f"blk-{i}" for i in range(n)]))


HUGE: dict[str, Callable[[str], pb.IntentBatch]] = {
    # 10^5 block ids in one access (about 1 MB): unknown blocks, named by index.
    "access 1e5 ids": lambda c: pb.IntentBatch(client_id=c, batch_seq=1, events=[accessed_many(100_000)]),
    # One event over limits.max_events_per_batch (10,000): refused as a whole.
    "10001 events": lambda c: pb.IntentBatch(client_id=c, batch_seq=1, events=[pb.Event(ts_us=1, cleared=pb.AllBlocksCleared())] * 10_001),
    # 10^4 allowed tiers on one intent, and a 1 MiB block id.
    "1e4 tiers": lambda c: pb.IntentBatch(
        client_id=c,
        batch_seq=1,
        events=[
            pb.Event(allocated=pb.BlockAllocated(intent=pb.MemoryIntent(block_id="t", size_bytes=1, allowed_tiers=["hbm", "dram"] * 5000)))
        ],
    ),
    "1 MiB block id": lambda c: pb.IntentBatch(
        client_id=c, batch_seq=1, events=[pb.Event(allocated=pb.BlockAllocated(intent=pb.MemoryIntent(block_id="x" * 2**20, size_bytes=1)))]
    ),
    # 10^5 ids in a free, all the same unknown one.
    "free 1e5 same id": lambda c: pb.IntentBatch(
        client_id=c, batch_seq=1, events=[pb.Event(freed=pb.BlocksFreed(block_ids=["nope"] * 100_000))]
    ),
}


@pytest.mark.parametrize("case", sorted(HUGE))
def test_huge_repeated_fields_get_clear_answers(broker: Broker, healthy: HealthyStream, case: str) -> None:
    client_id = fresh_client()
    batch = HUGE[case](client_id)
    request = spb.StreamRequest(batch=batch).SerializeToString()
    assert len(request) < 64 * 2**20
    answers, error = broker.stream([ld(1, hello_bytes(client_id)), request])
    assert error is None and len(answers) == 2, error
    check_batch_answer(request, answers[1], client_id, set())
    result = spb.StreamResponse.FromString(answers[1]).directives
    if case == "10001 events":
        assert result.rejections[0].field == "events" and "max_events_per_batch" in result.rejections[0].reason
    clean_up(broker, client_id)
    still_serving(broker, healthy)


def test_the_fuzzed_broker_stops_cleanly_and_its_journal_recovers(broker: Broker, healthy: HealthyStream, tmp_path: Path) -> None:
    """Last in the module: whatever the fuzz journaled, a restarted broker rebuilds from it."""
    still_serving(broker, healthy)
    before = broker.stats()
    healthy.close()
    assert broker.stop() == 0, "".join(broker.output[-60:])
    again = Broker(broker.folder)
    try:
        stats = again.stats()
        assert stats.batches == before.batches, (stats.batches, before.batches)
        answers, error = again.stream([ld(1, hello_bytes("healthy"))])
        assert error is None and spb.StreamResponse.FromString(answers[0]).hello.last_batch_seq == healthy.seq
    finally:
        assert again.stop() == 0, "".join(again.output[-60:])
