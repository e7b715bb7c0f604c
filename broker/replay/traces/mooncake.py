"""Mooncake traces: `timestamp` (ms), `input_length`, `output_length`, `hash_ids` JSONL.

Each hash id is a prompt block of `block_tokens` (512) tokens; ids are prefix-chained, so a
block is reusable across requests exactly when its id repeats. Two ways to turn a trace into
events:

- ``decode=False`` (prompt blocks only, the methodology of prefix-cache hit-ratio studies):
  requests in timestamp order, one after the other; each allocates its blocks in order (a
  block the broker still holds is a prefix reuse), then releases them.
- ``decode=True``: requests overlap in event time. At arrival the prefill allocates or reuses
  the prompt blocks (another reference when a running request holds them); after the
  prefill, one decode step per output token every ``tpot_us`` accesses the request's
  blocks and names the next step's time as their next use (their deadline); a new private
  block is allocated every `block_tokens` generated tokens. At the end the prompt blocks are
  released (they stay cached for later requests) and the private ones freed.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterator

from broker.replay.traces.base import SkipCounter, TraceError, read_jsonl, require_int
from kvbroker.v1 import intent_pb2 as pb

LLAMA3_8B_BYTES_PER_TOKEN = 131_072
# Bounds that keep every event time (arrival + prefill + decode steps) inside int64.
MAX_TIMESTAMP_MS = 2**62 // 1000
MAX_TOKENS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class MooncakeOptions:
    block_tokens: int = 512
    bytes_per_token: int = LLAMA3_8B_BYTES_PER_TOKEN
    decode: bool = True
    # Time per output token (decode pace) and prefill time per prompt token.
    tpot_us: int = 20_000
    prefill_us_per_token: float = 50.0
    batch_events: int = 512
    client_id: str = "mooncake"

    def __post_init__(self) -> None:
        for name in ("block_tokens", "bytes_per_token", "tpot_us", "batch_events"):
            if getattr(self, name) <= 0:
                raise ValueError(f"mooncake option {name} must be > 0, got {getattr(self, name)}")

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.bytes_per_token


@dataclasses.dataclass
class MooncakeRequest:
    index: int
    arrival_us: int
    input_length: int
    output_length: int
    hash_ids: list[str]


MAX_HASH_ID = 2**64 - 1


def _short(value: object) -> str:
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 512 else f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 60 else text[:57] + "..."


def read_requests(path: str, skips: SkipCounter) -> list[MooncakeRequest]:
    requests: list[MooncakeRequest] = []
    for line, obj in read_jsonl(path, skips):
        try:
            timestamp = require_int(obj, "timestamp", path, line, maximum=MAX_TIMESTAMP_MS)
            input_length = require_int(obj, "input_length", path, line, maximum=MAX_TOKENS)
            output_length = require_int(obj, "output_length", path, line, maximum=MAX_TOKENS)
            hashes = obj.get("hash_ids")
            if not isinstance(hashes, list):
                raise TraceError(path, line, "hash_ids", f"expected a list of integers, got {hashes!r}")
            for i, h in enumerate(hashes):
                # A hash id is a uint64 (vLLM's engine replay packs it in 8 bytes).
                if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= MAX_HASH_ID:
                    raise TraceError(path, line, f"hash_ids[{i}]", f"expected an integer in 0..2^64-1, got {_short(h)}")
        except TraceError as exc:
            skips.bad(exc)
            continue
        assert timestamp is not None and input_length is not None and output_length is not None
        requests.append(MooncakeRequest(line, timestamp * 1000, input_length, output_length, [f"h{h}" for h in hashes]))
    requests.sort(key=lambda r: r.arrival_us)  # stable: file order breaks ties
    return requests


class _Batches:
    """Events written in place into IntentBatches of at most ``max_events``, numbered from
    1: the batches ``base.batched`` makes of the same events, without building each event
    apart and copying it in (which cost more than half of the import)."""

    def __init__(self, client_id: str, max_events: int) -> None:
        self.client_id = client_id
        self.max_events = max_events
        self.seq = 0
        self.full: list[pb.IntentBatch] = []
        self._start()

    def _start(self) -> None:
        self.seq += 1
        self.batch = pb.IntentBatch(client_id=self.client_id, batch_seq=self.seq)
        self.events = self.batch.events
        self.count = 0

    def event(self, ts_us: int) -> pb.Event:
        """A new event at ``ts_us``, appended to the current batch; set its kind."""
        if self.count >= self.max_events:
            self.full.append(self.batch)
            self._start()
        self.count += 1
        return self.events.add(ts_us=ts_us)

    def take(self) -> list[pb.IntentBatch]:
        """The batches filled since the last call."""
        full, self.full = self.full, []
        return full

    def last(self) -> list[pb.IntentBatch]:
        """The batches not yet taken, the last one too if it holds any event."""
        return self.take() + ([self.batch] if self.count else [])


def _allocate(out: _Batches, ts_us: int, block_id: str, request: str, opts: MooncakeOptions, parent: str, phase: int, reuse: bool) -> None:
    alloc = out.event(ts_us).allocated
    intent = alloc.intent
    intent.block_id = block_id
    intent.request_id = request
    intent.phase = phase  # type: ignore[assignment]
    intent.priority = pb.PRIORITY_HOT
    intent.size_bytes = opts.block_bytes
    intent.token_count = opts.block_tokens
    intent.parent_block_id = parent
    if reuse:
        alloc.reuse = True


def prompt_only_events(requests: list[MooncakeRequest], opts: MooncakeOptions, out: _Batches) -> Iterator[pb.IntentBatch]:
    """Writes the events into ``out``; yields the batches as they fill."""
    for req in requests:
        rid = f"req-{req.index}"
        parent = ""
        now = req.arrival_us
        for block_id in req.hash_ids:
            _allocate(out, now, block_id, rid, opts, parent, pb.PHASE_PREFILL, False)
            parent = block_id
        if req.hash_ids:
            out.event(now).released.block_ids.extend(req.hash_ids)
        if out.full:
            yield from out.take()


def decode_events(requests: list[MooncakeRequest], opts: MooncakeOptions, out: _Batches) -> Iterator[pb.IntentBatch]:
    """Overlapping requests simulated in event time (see the module docstring). Writes the
    events into ``out``; yields the batches as they fill."""
    refs: dict[str, int] = {}
    # (time, order, kind, request, step): kind 0 = arrival, 1 = decode step.
    heap: list[tuple[int, int, int, int, int]] = []
    for i, req in enumerate(requests):
        heapq.heappush(heap, (req.arrival_us, i, 0, i, 0))
    order = len(requests)
    private: dict[int, list[str]] = {}
    block_tokens, tpot_us = opts.block_tokens, opts.tpot_us
    while heap:
        now, _, kind, i, step = heapq.heappop(heap)
        req = requests[i]
        rid = f"req-{req.index}"
        if kind == 0:
            parent = ""
            for block_id in req.hash_ids:
                live = refs.get(block_id, 0) > 0
                _allocate(out, now, block_id, rid, opts, parent, pb.PHASE_PREFILL, live)
                refs[block_id] = refs.get(block_id, 0) + 1
                parent = block_id
            private[i] = []
            first_step = now + int(req.input_length * opts.prefill_us_per_token)
            if req.output_length > 0:
                order += 1
                heapq.heappush(heap, (first_step, order, 1, i, 0))
            else:
                _finish(out, req, now, refs, private.pop(i))
        else:
            blocks = private[i]
            if step % block_tokens == 0:
                parent = blocks[-1] if blocks else (req.hash_ids[-1] if req.hash_ids else "")
                block_id = f"{rid}/d{step // block_tokens}"
                _allocate(out, now, block_id, rid, opts, parent, pb.PHASE_DECODE, False)
                blocks.append(block_id)
            last = step + 1 >= req.output_length
            accessed = out.event(now).accessed
            block_ids = accessed.block_ids
            block_ids.extend(req.hash_ids)
            block_ids.extend(blocks)
            if not last:
                accessed.next_use_us = now + tpot_us
            if last:
                _finish(out, req, now, refs, private.pop(i))
            else:
                order += 1
                heapq.heappush(heap, (now + tpot_us, order, 1, i, step + 1))
        if out.full:
            yield from out.take()


def _finish(out: _Batches, req: MooncakeRequest, now: int, refs: dict[str, int], private: list[str]) -> None:
    if req.hash_ids:
        out.event(now).released.block_ids.extend(req.hash_ids)
        for block_id in req.hash_ids:
            refs[block_id] -= 1
    if private:
        out.event(now).freed.block_ids.extend(private)


def event_count(requests: list[MooncakeRequest], opts: MooncakeOptions) -> int:
    """The events ``read_mooncake`` makes of these requests, without making them: a
    replay's share done and time left from its start (the file is read whole before the
    first batch, so how far into the file says nothing)."""
    total = 0
    for req in requests:
        prompt = len(req.hash_ids)
        total += prompt + (1 if prompt else 0)  # the allocations, then one release
        if opts.decode and req.output_length > 0:
            # A step's access each, a private block every block_tokens steps, one free at the end.
            total += req.output_length + -(-req.output_length // opts.block_tokens) + 1
    return total


def read_mooncake(path: str, opts: MooncakeOptions | None = None, skips: SkipCounter | None = None) -> Iterator[pb.IntentBatch]:
    """IntentBatches of a Mooncake trace (all requests are read first, to order them)."""
    opts = opts or MooncakeOptions()
    requests = read_requests(path, skips or SkipCounter())
    out = _Batches(opts.client_id, opts.batch_events)
    yield from decode_events(requests, opts, out) if opts.decode else prompt_only_events(requests, opts, out)
    yield from out.last()
