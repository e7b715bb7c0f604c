"""The test publisher (tests/vllm_integration/events_from_vllm/vllm_wire.py) writes exactly what vLLM 0.33 writes.

Needs vLLM installed (marker ``vllm``; .ci/run runs these in a venv of their own): the same
events through vLLM's own msgspec structs and encoder, and the same batches through vLLM's
own ZmqEventPublisher (PUB + replay ROUTER) and through VllmPublisher, must give the same
bytes, frame for frame, live and replayed.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import zmq

from tests.vllm_integration.events_from_vllm.vllm_wire import (
    VllmPublisher,
    WireEvent,
    all_blocks_cleared,
    block_removed,
    block_stored,
    encode_batch,
    encode_event,
    offloaded,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]


def sample_events() -> list[WireEvent]:
    """Every shape the bridge reads: GPU stores (bytes and int hashes past 2^63, negative,
    adapters, groups, extra keys with tuples, sessions, lookahead), offloaded placeholders,
    self-describing offloaded stores, removals of every medium, a clear."""
    sha = bytes(range(32))
    return [
        block_stored([sha, 2**64 - 1, -(2**63), 200, -100], None),
        block_stored([b"\x01" * 32], sha, block_size=32, lora_id=3, lora_name="sql", group_idx=1, extra_keys=[("sql",), None]),
        block_stored([7], 5, session_id="session-1", lookahead_token_ids=[[1, 2, 3]]),
        block_stored([8], None, medium=None, group_idx=None),
        offloaded(sha, "CPU"),
        offloaded(12345, "STORAGE", group_idx=2, locality="REMOTE", ownership="kvcr"),
        offloaded(9, "CPU", kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4096),
        block_stored([10, 11], 9, medium="CPU", locality="LOCAL", ownership="kvcr", kv_cache_spec_kind="full_attention"),
        block_removed([sha, 200]),
        block_removed([12345], "STORAGE", group_idx=2, locality="REMOTE", ownership="kvcr"),
        block_removed([8], None, group_idx=None),
        all_blocks_cleared(),
    ]


def as_vllm(event: WireEvent) -> Any:
    from vllm.distributed import kv_events

    cls = getattr(kv_events, event.kind)
    return cls(**dict(event.values))


def vllm_batch(ts: float, events: list[WireEvent], rank: int | None) -> Any:
    from vllm.distributed.kv_events import KVEventBatch

    return KVEventBatch(ts=ts, events=[as_vllm(e) for e in events], data_parallel_rank=rank)


def test_events_and_batches_encode_to_vllms_bytes() -> None:
    import msgspec  # vLLM's dependency: this module is collected (and deselected) without it

    encoder = msgspec.msgpack.Encoder()
    for event in sample_events():
        assert encode_event(event) == encoder.encode(as_vllm(event)), event
    events = sample_events()
    assert encode_batch(1_700_000_000.25, events, 3) == encoder.encode(vllm_batch(1_700_000_000.25, events, 3))
    assert encode_batch(2.0, [], None) == encoder.encode(vllm_batch(2.0, [], None))
    many = [block_stored([n]) for n in range(40)]  # an array16 of events
    assert encode_batch(5.5, many, 0) == encoder.encode(vllm_batch(5.5, many, 0))


def receive(sub: zmq.Socket[bytes], n: int, timeout: float = 10.0) -> list[list[bytes]]:
    out: list[list[bytes]] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < deadline, f"received {len(out)} of {n}"
        if sub.poll(50):
            out.append(sub.recv_multipart())
    return out


def replay(
    ctx: zmq.Context[zmq.Socket[bytes]], port: int, start: int, request: list[bytes] | None = None, timeout_ms: int = 5000
) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart(request or [b"", start.to_bytes(8, "big")])
        out = []
        while dealer.poll(timeout_ms):
            frames = dealer.recv_multipart()
            out.append(frames)
            if frames[-2:] == [(-1).to_bytes(8, "big", signed=True), b""]:
                break
        return out
    finally:
        dealer.close()


def free_ports(n: int) -> list[int]:
    rng = random.Random()
    return [rng.randrange(20_000, 60_000) for _ in range(n)]


def test_the_publisher_sends_and_replays_vllms_frames() -> None:
    from vllm.distributed.kv_events import ZmqEventPublisher

    pub, rep, fake_pub, fake_rep = free_ports(4)
    rank = 1  # vLLM offsets its ports by the rank: bind at port - rank
    theirs = ZmqEventPublisher(rank, f"tcp://*:{pub - rank}", f"tcp://*:{rep - rank}", topic="kv-events")
    ours = VllmPublisher(fake_pub, fake_rep, rank=rank, topic="kv-events")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    subs = []
    try:
        assert theirs.get_publisher_config().endpoint == f"tcp://*:{pub}"
        for port in (pub, fake_pub):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{port}")
            subs.append(sub)
        ours.wait_subscribed()
        time.sleep(0.5)  # vLLM's PUB says nothing of its subscribers
        batches = [sample_events()[i : i + 3] for i in range(0, 12, 3)]
        for i, events in enumerate(batches):
            ts = 1_700_000_000.0 + i
            theirs.publish(vllm_batch(ts, events, None))  # the publisher sets the rank
            ours.publish(list(events), ts=ts)
        live_theirs, live_ours = receive(subs[0], len(batches)), receive(subs[1], len(batches))
        assert live_theirs == live_ours
        assert [int.from_bytes(f[1], "big") for f in live_ours] == [0, 1, 2, 3]
        # Replays: from the start, from the middle, past the end, and a bad request (ignored).
        for start in (0, 2, 9):
            assert replay(ctx, rep, start) == replay(ctx, fake_rep, start)
        assert len(replay(ctx, fake_rep, 2)) == 3
        bad = [b"", b"x", b"y"]
        assert replay(ctx, rep, 0, bad, timeout_ms=500) == replay(ctx, fake_rep, 0, bad, timeout_ms=500) == []
    finally:
        for sub in subs:
            sub.close(linger=0)
        ctx.destroy(linger=0)
        theirs.shutdown()
        ours.close()
