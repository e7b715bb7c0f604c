"""vLLM 0.33's KV-event wire format, written from its facts, and a publisher that sends it.

Built from what vllm/distributed/kv_events.py (0.33.0) does, never imported from it, so the
main suite needs no vLLM; tests/vllm_integration/events_from_vllm/test_vllm_wire_matches_vllm.py (marked ``vllm``)
checks these bytes against vLLM's own encoder and ZmqEventPublisher, so this cannot drift.

- A batch (``KVEventBatch``, a msgspec struct with ``array_like``): ``[ts, events,
  data_parallel_rank]``, all three always written (a None rank as nil), ts a float64.
- An event (a tagged msgspec struct with ``omit_defaults``): a map, ``"type"`` first, then the
  fields in declaration order; a field without a default is always written (nil included), a
  field with a default only when it holds another value. msgspec sizes the map header for
  the most keys the struct can have: BlockStored (1 + 15) always gets a map16 header
  (``0xde`` + 2-byte count), BlockRemoved and AllBlocksCleared a fixmap.
- Values as msgpack writes them in their smallest form: ints (up to uint64 / int64), str,
  bytes as bin, tuples and lists as arrays.
- Live frames ``[topic, seq, payload]``, seq 8-byte big-endian from 0 per publisher. The
  replay ROUTER answers ``[identity, b"", start]`` with ``[identity, b"", topic, seq,
  payload]`` per buffered batch with seq >= start, then ``[identity, b"", b"", -1, b""]``;
  any other request is ignored. The buffer keeps the last 10,000 batches; a batch enters it
  after it was sent.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import threading
import time
from typing import Any

import msgpack
import zmq

from vllm_integration.events_from_vllm.zmq_events import block_id

REQUIRED = object()
# (name, default) in declaration order; REQUIRED fields have no default: always written.
STORED_SCHEMA: tuple[tuple[str, Any], ...] = (
    ("block_hashes", REQUIRED),
    ("parent_block_hash", REQUIRED),
    ("token_ids", REQUIRED),
    ("block_size", REQUIRED),
    ("lora_id", REQUIRED),
    ("medium", REQUIRED),
    ("lora_name", REQUIRED),
    ("extra_keys", None),
    ("group_idx", None),
    ("kv_cache_spec_kind", None),
    ("kv_cache_spec_sliding_window", None),
    ("locality", None),
    ("ownership", None),
    ("session_id", None),
    ("lookahead_token_ids", None),
)
REMOVED_SCHEMA: tuple[tuple[str, Any], ...] = (
    ("block_hashes", REQUIRED),
    ("medium", REQUIRED),
    ("group_idx", None),
    ("locality", None),
    ("ownership", None),
)
SCHEMAS = {"BlockStored": STORED_SCHEMA, "BlockRemoved": REMOVED_SCHEMA, "AllBlocksCleared": ()}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# The bridge's default tier map: where vLLM's copy in each medium lands, best first.
TIERS = {"GPU": "hbm", "CPU": "dram", "STORAGE": "nvme"}
BUFFER_STEPS = 10_000


@dataclasses.dataclass(frozen=True)
class WireEvent:
    """One event as vLLM builds it: its type and every field's value (defaults included)."""

    kind: str
    values: tuple[tuple[str, Any], ...]

    def get(self, name: str) -> Any:
        """A field's value; None for a field this event type does not have."""
        return dict(self.values).get(name)


def _event(kind: str, **values: Any) -> WireEvent:
    schema = SCHEMAS[kind]
    unknown = set(values) - {name for name, _ in schema}
    assert not unknown, f"{kind} has no field {unknown}"
    out = []
    for name, default in schema:
        if name not in values and default is REQUIRED:
            raise TypeError(f"{kind}: {name} is required")
        out.append((name, values.get(name, None if default is REQUIRED else default)))
    return WireEvent(kind, tuple(out))


def block_stored(
    block_hashes: list[Any],
    parent_block_hash: Any = None,
    *,
    block_size: int = 16,
    token_ids: list[int] | None = None,
    medium: str | None = "GPU",
    lora_id: int | None = None,
    lora_name: str | None = None,
    group_idx: int | None = 0,
    **optional: Any,
) -> WireEvent:
    """A BlockStored as vLLM's GPU block pool writes it (group_idx 0 and medium "GPU" set);
    ``optional``: extra_keys, kv_cache_spec_kind, kv_cache_spec_sliding_window, locality,
    ownership, session_id, lookahead_token_ids."""
    tokens = list(range(block_size * len(block_hashes))) if token_ids is None else token_ids
    return _event(
        "BlockStored",
        block_hashes=list(block_hashes),
        parent_block_hash=parent_block_hash,
        token_ids=tokens,
        block_size=block_size,
        lora_id=lora_id,
        medium=medium,
        lora_name=lora_name,
        group_idx=group_idx,
        **optional,
    )


def offloaded(block_hash: Any, medium: str = "CPU", *, group_idx: int = 0, **optional: Any) -> WireEvent:
    """vLLM's offloading connector announcing a CPU/STORAGE copy of a chunk by its last hash:
    no parent, no tokens, block_size 0 (OffloadingEventsTracker._placeholder_stored)."""
    return _event(
        "BlockStored",
        block_hashes=[block_hash],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=group_idx,
        **optional,
    )


def block_removed(block_hashes: list[Any], medium: str | None = "GPU", *, group_idx: int | None = 0, **optional: Any) -> WireEvent:
    return _event("BlockRemoved", block_hashes=list(block_hashes), medium=medium, group_idx=group_idx, **optional)


def all_blocks_cleared() -> WireEvent:
    return _event("AllBlocksCleared")


# ---- encoding --------------------------------------------------------------------------------


def _packer() -> msgpack.Packer:
    return msgpack.Packer(use_bin_type=True)


def encode_event(event: WireEvent, *, extra: dict[str, Any] | None = None) -> bytes:
    """The event's bytes as msgspec writes them; ``extra``: keys a newer vLLM would add."""
    schema = SCHEMAS[event.kind]
    defaults = dict(schema)
    written = [(k, v) for k, v in event.values if defaults[k] is REQUIRED or v != defaults[k]]
    written.extend((extra or {}).items())
    packer = _packer()
    count = 1 + len(written)
    most = 1 + len(schema) + len(extra or {})
    head = bytes([0x80 | count]) if most <= 15 else b"\xde" + count.to_bytes(2, "big")
    body = packer.pack("type") + packer.pack(event.kind)
    for key, value in written:
        body += packer.pack(key) + packer.pack(value)
    return head + body


def encode_batch(ts: float, events: list[WireEvent | bytes], rank: int | None) -> bytes:
    """A KVEventBatch: ``events`` as WireEvents, or bytes already encoded (to add unknown keys)."""
    packer = _packer()
    body = b"\x93" + packer.pack(float(ts)) + packer.pack_array_header(len(events))
    for event in events:
        body += event if isinstance(event, bytes) else encode_event(event)
    return body + packer.pack(rank)


# ---- the publisher ---------------------------------------------------------------------------


class VllmPublisher:
    """One data-parallel rank's ZmqEventPublisher: a PUB socket bound at ``pub_port`` and a
    ROUTER replay socket at ``replay_port``, served from a thread, with vLLM's frames.

    The PUB is an XPUB (the same frames to a subscriber; it also tells the test when one
    subscribed). ``publish(..., drop=True)`` puts a batch in the replay buffer without sending
    it live: a batch the subscriber missed. A restarted engine is a new VllmPublisher on the
    same ports after ``close()``.
    """

    def __init__(self, pub_port: int, replay_port: int | None, *, rank: int = 0, topic: str = "kv-events") -> None:
        self.rank = rank
        self.topic = topic.encode()
        self.pub_port, self.replay_port = pub_port, replay_port
        self.seq = 0
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=BUFFER_STEPS)
        self.sent: list[bytes] = []  # every payload, in seq order
        self.replays = 0
        self._lock = threading.Lock()
        self._open()

    def _open(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.router: zmq.Socket[bytes] | None = None
        try:
            self.pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
            if self.replay_port is not None:
                self.router = self.ctx.socket(zmq.ROUTER)
                self.router.setsockopt(zmq.LINGER, 0)
                self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        except zmq.ZMQError:
            self.ctx.destroy(linger=0)
            raise
        self._subscribed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def _serve_replay(self) -> None:
        router = self.router
        while router is not None and not self._stop.is_set():
            if not router.poll(20):
                continue
            frames = router.recv_multipart()
            if len(frames) != 3:  # vLLM logs and ignores anything but [identity, b"", start]
                continue
            identity, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            self.replays += 1
            with self._lock:
                buffered = [(s, d) for s, d in self.buffer if s >= start]
            for seq, data in buffered:
                router.send_multipart([identity, b"", self.topic, seq.to_bytes(8, "big"), data])
            router.send_multipart([identity, b"", b"", END_SEQ, b""])

    def subscribed(self) -> bool:
        while self.pub.poll(0):
            if self.pub.recv()[:1] == b"\x01":
                self._subscribed = True
        return self._subscribed

    def wait_subscribed(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.subscribed():
            if time.monotonic() > deadline:
                raise AssertionError(f"no subscriber on port {self.pub_port} after {timeout} s")
            time.sleep(0.01)

    def publish(self, events: list[WireEvent | bytes], *, ts: float | None = None, drop: bool = False) -> int:
        """One batch; returns its seq. ``drop``: missed by the subscriber (still replayable)."""
        seq = self.seq
        self.seq += 1
        data = encode_batch(time.time() if ts is None else ts, events, self.rank)
        if not drop:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), data])
        with self._lock:
            self.buffer.append((seq, data))
        self.sent.append(data)
        return seq

    def reconnect(self) -> None:
        """The same engine's sockets close and bind again (its subscribers see the connection
        drop): seq and replay buffer are kept, as after a network blip."""
        self.close()
        self._open()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.ctx.destroy(linger=0)


# ---- what vLLM holds ------------------------------------------------------------------------


class Truth:
    """Per rank: block id -> medium -> announcements outstanding (vLLM holds a copy while > 0)."""

    def __init__(self, dp_size: int = 1) -> None:
        self.dp_size = dp_size
        self.ranks: dict[int, dict[str, collections.Counter[str]]] = collections.defaultdict(dict)

    def _bid(self, rank: int, h: Any, event: WireEvent) -> str:
        namespace = f"dp{rank}/" if self.dp_size > 1 else ""
        return block_id(h, namespace=namespace, lora_name=event.get("lora_name"), group_idx=event.get("group_idx"))

    def apply(self, rank: int, events: list[WireEvent]) -> None:
        blocks = self.ranks[rank]
        for event in events:
            if event.kind == "AllBlocksCleared":
                blocks.clear()
                continue
            medium = event.get("medium") or "GPU"
            for h in event.get("block_hashes"):
                bid = self._bid(rank, h, event)
                if event.kind == "BlockStored":
                    blocks.setdefault(bid, collections.Counter())[medium] += 1
                elif bid in blocks and blocks[bid][medium] > 0:
                    blocks[bid][medium] -= 1
                    if not +blocks[bid]:
                        del blocks[bid]

    def restart(self, rank: int) -> None:
        self.ranks[rank] = {}

    def expected(self) -> dict[str, str]:
        """block id -> the tier of its best copy."""
        out = {}
        for blocks in self.ranks.values():
            for bid, media in blocks.items():
                out[bid] = next(TIERS[m] for m in TIERS if media[m] > 0)
        return out


class Engine:
    """One rank of the engine: its publisher and its share of the truth."""

    def __init__(self, truth: Truth, rank: int, pub_port: int, replay_port: int | None) -> None:
        self.truth, self.rank = truth, rank
        self.pub_port, self.replay_port = pub_port, replay_port
        self.publisher = VllmPublisher(pub_port, replay_port, rank=rank)

    def send(self, *events: WireEvent | tuple[WireEvent, dict[str, Any]], missed: bool = False) -> None:
        """One batch; an event may come with keys a newer vLLM adds, ``(event, {key: value})``.
        ``missed``: the bridge does not receive it live."""
        plain = [e if isinstance(e, WireEvent) else e[0] for e in events]
        self.publisher.publish([e if isinstance(e, WireEvent) else encode_event(e[0], extra=e[1]) for e in events], drop=missed)
        self.truth.apply(self.rank, plain)

    def restart(self) -> None:
        """The engine process ends and a new one binds the same ports: seq from 0, an empty
        replay buffer, nothing of the old cache."""
        self.publisher.close()
        self.truth.restart(self.rank)
        self.publisher = VllmPublisher(self.pub_port, self.replay_port, rank=self.rank)


def engines(truth: Truth, n: int, *, replay: bool = True) -> list[Engine]:
    """n ranks on consecutive ports (rank r at base + r), as vLLM offsets them; ``replay``:
    with replay sockets."""
    rng = random.Random()
    for _ in range(50):
        pub, rep = rng.randrange(20_000, 40_000), rng.randrange(40_000, 60_000)
        made: list[Engine] = []
        try:
            for r in range(n):
                made.append(Engine(truth, r, pub + r, rep + r if replay else None))
            return made
        except zmq.ZMQError:
            for engine in made:
                engine.publisher.close()
    raise RuntimeError("no free consecutive ports")
