"""The event stream of `kvbroker bench`: one serving engine per client, pre-encoded.

Each client is an engine running ``CONCURRENCY`` requests with continuous batching. Every
iteration (``ITERATION_US`` of event time) each running request takes a decode step that
reads all its blocks (one ``accessed`` event); every ``TOKENS_PER_BLOCK`` tokens it
allocates a new block and marks the full one committed (``intent_updated``); the scheduler
announces two requests' newest blocks as DECODE_CRITICAL with a deadline one iteration
ahead, and takes last iteration's announcement back; a finished request frees its blocks
and a new one is admitted, allocating its prompt blocks and reading them.

With ``prefix_cache`` a finished request releases its blocks instead of freeing them: they
stay cached (as vLLM's prefix cache keeps a finished request's blocks), so HBM fills with
cached blocks and from then on every new block displaces one, as in a serving engine whose
cache is full: the broker's eviction path and its directives are part of what is measured
(about 0.1 directives per event; without it this workload makes none).

Events are serialized once, before anything is timed, into one blob of ``IntentBatch.events``
fields (tag, length, bytes) with the offset of each, so a batch of any size is one slice of
the blob and a request message is a few header bytes in front of it (``stream_request``).
Every block and request id begins with ``MARK``; each run replaces it (same length, so every
length prefix stays valid) with its own tag, so runs against one broker never collide.
"""

from __future__ import annotations

import dataclasses
import random
from array import array

from broker.model.pbwire import key, length_delimited, varint
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import intent_pb2 as pb

MARK = b"~00000000000000~"  # replaced per run by run_tag(): same length
BLOCK_BYTES = 2 * 2**20  # 16 tokens of llama-3-8b at fp16
TOKENS_PER_BLOCK = 16
ITERATION_US = 10_000
CONCURRENCY = 16
HINTED_REQUESTS = 2  # requests announced DECODE_CRITICAL per iteration
HINTED_BLOCKS = 2  # of each, its newest blocks

# Keys of the fields written by hand around the pre-encoded events (broker.model.pbwire).
_CLIENT_ID = key(pb.IntentBatch, "client_id")
_BATCH_SEQ = key(pb.IntentBatch, "batch_seq")
_EVENTS = key(pb.IntentBatch, "events")
_BATCH = key(spb.StreamRequest, "batch")

# Tiers of the broker the bench starts: four engines' working sets (~2 GiB) press on HBM.
BENCH_TIERS = """\
[[tiers]]
name = "hbm"
capacity = "2GiB"
read_latency_us = 0.0
bandwidth_gb_per_s = 2000.0

[[tiers]]
name = "dram"
capacity = "16GiB"
read_latency_us = 2.0
bandwidth_gb_per_s = 25.0

[[tiers]]
name = "nvme"
capacity = "1TiB"
read_latency_us = 80.0
bandwidth_gb_per_s = 6.0
"""


def run_tag(nonce: str, run: int) -> bytes:
    """The replacement of MARK for one run: ``~`` + 8 hex digits + 6 digits + ``~``."""
    tag = f"~{nonce[:8]:0>8}{run % 1_000_000:06d}~".encode()
    assert len(tag) == len(MARK)
    return tag


def intent_batch(client_id: bytes, batch_seq: int, events: bytes) -> bytes:
    """``IntentBatch{client_id, batch_seq, events}`` on the wire; ``events`` is a slice of
    the blob (already tagged ``events`` fields)."""
    return length_delimited(_CLIENT_ID, client_id) + _BATCH_SEQ + varint(batch_seq) + events


def stream_request(client_id: bytes, batch_seq: int, events: bytes) -> bytes:
    """``StreamRequest{batch: IntentBatch{...}}`` on the wire (``intent_batch``)."""
    return length_delimited(_BATCH, intent_batch(client_id, batch_seq, events))


def hello_request(client_id: str) -> bytes:
    return spb.StreamRequest(hello=spb.Hello(schema_major=1, schema_minor=0, client_id=client_id)).SerializeToString()


def cleared_events(ts_us: int) -> bytes:
    """One ``cleared`` event (every block of the client goes), as an ``events`` field."""
    raw = pb.Event(ts_us=ts_us, cleared=pb.AllBlocksCleared()).SerializeToString()
    return length_delimited(_EVENTS, raw)


@dataclasses.dataclass
class _Request:
    rid: str
    output: int
    priority: int
    blocks: list[str]
    tokens: int = 0


class EngineWorkload:
    """One engine's events, iteration by iteration (deterministic for a seed)."""

    def __init__(self, client: int, seed: int = 1, *, prefix_cache: bool = False) -> None:
        self.rng = random.Random(seed * 1_000_003 + client)
        self.prefix_cache = prefix_cache
        self.prefix = f"{MARK.decode()}c{client}/"
        self.now = 0
        self.count = 0
        self.active: list[_Request] = []
        self.hinted: list[str] = []
        self._rr = 0

    def iteration(self) -> list[pb.Event]:
        now, events = self.now, []
        for block_id in self.hinted:  # last iteration's announcement is over
            events.append(_update(now, block_id, priority=pb.PRIORITY_HOT, clear_deadline=True))
        while len(self.active) < CONCURRENCY:
            self._admit(now, events)
        for req in list(self.active):
            if req.tokens and req.tokens % TOKENS_PER_BLOCK == 0:
                events.append(_update(now, req.blocks[-1], is_committed=True))
                self._allocate(req, now, events, pb.PHASE_DECODE)
            events.append(pb.Event(ts_us=now, accessed=pb.BlocksAccessed(block_ids=req.blocks)))
            req.tokens += 1
            if req.tokens >= req.output:
                if self.prefix_cache:
                    events.append(pb.Event(ts_us=now, released=pb.BlocksReleased(block_ids=req.blocks)))
                else:
                    events.append(pb.Event(ts_us=now, freed=pb.BlocksFreed(block_ids=req.blocks)))
                self.active.remove(req)
        # The scheduler knows who decodes next: announce them (never one that finishes now).
        self.hinted = []
        candidates = [r for r in self.active if r.tokens + 1 < r.output]
        for k in range(min(HINTED_REQUESTS, len(candidates))):
            req = candidates[(self._rr + k) % len(candidates)]
            for block_id in req.blocks[-HINTED_BLOCKS:]:
                events.append(_update(now, block_id, priority=pb.PRIORITY_DECODE_CRITICAL, deadline_us=now + ITERATION_US))
                self.hinted.append(block_id)
        self._rr += HINTED_REQUESTS
        self.now = now + ITERATION_US
        return events

    def _admit(self, now: int, events: list[pb.Event]) -> None:
        interactive = self.rng.random() < 0.5
        req = _Request(
            rid=f"{self.prefix}r{self.count}",
            output=self.rng.randint(32, 160),
            priority=pb.PRIORITY_HOT if interactive else pb.PRIORITY_WARM,
            blocks=[],
        )
        self.count += 1
        for _ in range(self.rng.randint(2, 12)):
            self._allocate(req, now, events, pb.PHASE_PREFILL)
        events.append(pb.Event(ts_us=now, accessed=pb.BlocksAccessed(block_ids=req.blocks)))
        self.active.append(req)

    def _allocate(self, req: _Request, now: int, events: list[pb.Event], phase: int) -> None:
        k = len(req.blocks)
        intent = pb.MemoryIntent(
            block_id=f"{req.rid}/b{k}",
            request_id=req.rid,
            phase=phase,  # type: ignore[arg-type]
            priority=req.priority,  # type: ignore[arg-type]
            size_bytes=BLOCK_BYTES,
            recompute_cost_us=4_000 if phase == pb.PHASE_PREFILL else 800,
            token_start=k * TOKENS_PER_BLOCK,
            token_count=TOKENS_PER_BLOCK,
            parent_block_id=req.blocks[-1] if req.blocks else "",
            request_priority=90 if req.priority == pb.PRIORITY_HOT else 20,
        )
        events.append(pb.Event(ts_us=now, allocated=pb.BlockAllocated(intent=intent)))
        req.blocks.append(intent.block_id)


def _update(now: int, block_id: str, **changes: object) -> pb.Event:
    return pb.Event(ts_us=now, intent_updated=pb.IntentUpdated(block_id=block_id, **changes))  # type: ignore[arg-type]


@dataclasses.dataclass
class Encoded:
    """``count`` events of one engine: ``blob[offsets[i]:offsets[j]]`` is events i..j-1."""

    blob: bytes
    offsets: array[int]
    mix: dict[str, int]
    end_us: int  # event time after the last event
    block_ids: int  # block ids the events name (an access or free names several)

    @property
    def count(self) -> int:
        return len(self.offsets) - 1

    def tagged(self, tag: bytes) -> bytes:
        """The blob with this run's ids (MARK replaced)."""
        return self.blob.replace(MARK, tag)


def encode_workload(client: int, count: int, seed: int = 1, *, prefix_cache: bool = False) -> Encoded:
    """The first ``count`` events of engine ``client``, serialized."""
    workload = EngineWorkload(client, seed, prefix_cache=prefix_cache)
    parts: list[bytes] = []
    offsets = array("Q", [0])
    mix: dict[str, int] = {}
    position = ids = 0
    while len(parts) < count:
        for event in workload.iteration():
            raw = event.SerializeToString()
            field = length_delimited(_EVENTS, raw)
            parts.append(field)
            position += len(field)
            offsets.append(position)
            kind = event.WhichOneof("kind") or ""
            mix[kind] = mix.get(kind, 0) + 1
            if kind in ("accessed", "freed", "released"):
                ids += len(getattr(event, kind).block_ids)
            else:
                ids += 1
            if len(parts) == count:
                break
    return Encoded(b"".join(parts), offsets, mix, workload.now, ids)
