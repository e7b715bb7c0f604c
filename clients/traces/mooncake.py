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

from clients.traces.base import SkipCounter, TraceError, batched, read_jsonl, require_int
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
                if isinstance(h, bool) or not isinstance(h, int) or h < 0:
                    raise TraceError(path, line, f"hash_ids[{i}]", f"expected an integer >= 0, got {h!r}")
        except TraceError as exc:
            skips.bad(exc)
            continue
        assert timestamp is not None and input_length is not None and output_length is not None
        requests.append(MooncakeRequest(line, timestamp * 1000, input_length, output_length, [f"h{h}" for h in hashes]))
    requests.sort(key=lambda r: r.arrival_us)  # stable: file order breaks ties
    return requests


def _intent(block_id: str, request: str, opts: MooncakeOptions, parent: str, phase: int) -> pb.MemoryIntent:
    return pb.MemoryIntent(
        block_id=block_id,
        request_id=request,
        phase=phase,  # type: ignore[arg-type]
        priority=pb.PRIORITY_HOT,
        size_bytes=opts.block_bytes,
        token_count=opts.block_tokens,
        parent_block_id=parent,
    )


def prompt_only_events(requests: list[MooncakeRequest], opts: MooncakeOptions) -> Iterator[pb.Event]:
    for req in requests:
        rid = f"req-{req.index}"
        parent = ""
        for block_id in req.hash_ids:
            intent = _intent(block_id, rid, opts, parent, pb.PHASE_PREFILL)
            yield pb.Event(ts_us=req.arrival_us, allocated=pb.BlockAllocated(intent=intent))
            parent = block_id
        if req.hash_ids:
            yield pb.Event(ts_us=req.arrival_us, released=pb.BlocksReleased(block_ids=req.hash_ids))


def decode_events(requests: list[MooncakeRequest], opts: MooncakeOptions) -> Iterator[pb.Event]:
    """Overlapping requests simulated in event time (see the module docstring)."""
    refs: dict[str, int] = {}
    # (time, order, kind, request, step): kind 0 = arrival, 1 = decode step.
    heap: list[tuple[int, int, int, int, int]] = []
    for i, req in enumerate(requests):
        heapq.heappush(heap, (req.arrival_us, i, 0, i, 0))
    order = len(requests)
    private: dict[int, list[str]] = {}
    while heap:
        now, _, kind, i, step = heapq.heappop(heap)
        req = requests[i]
        rid = f"req-{req.index}"
        if kind == 0:
            parent = ""
            for block_id in req.hash_ids:
                live = refs.get(block_id, 0) > 0
                intent = _intent(block_id, rid, opts, parent, pb.PHASE_PREFILL)
                yield pb.Event(ts_us=now, allocated=pb.BlockAllocated(intent=intent, reuse=live))
                refs[block_id] = refs.get(block_id, 0) + 1
                parent = block_id
            private[i] = []
            first_step = now + int(req.input_length * opts.prefill_us_per_token)
            if req.output_length > 0:
                order += 1
                heapq.heappush(heap, (first_step, order, 1, i, 0))
            else:
                yield from _finish(req, now, refs, private.pop(i))
            continue
        blocks = private[i]
        if step % opts.block_tokens == 0:
            parent = blocks[-1] if blocks else (req.hash_ids[-1] if req.hash_ids else "")
            block_id = f"{rid}/d{step // opts.block_tokens}"
            yield pb.Event(ts_us=now, allocated=pb.BlockAllocated(intent=_intent(block_id, rid, opts, parent, pb.PHASE_DECODE)))
            blocks.append(block_id)
        last = step + 1 >= req.output_length
        accessed = pb.BlocksAccessed(block_ids=[*req.hash_ids, *blocks])
        if not last:
            accessed.next_use_us = now + opts.tpot_us
        yield pb.Event(ts_us=now, accessed=accessed)
        if last:
            yield from _finish(req, now, refs, private.pop(i))
        else:
            order += 1
            heapq.heappush(heap, (now + opts.tpot_us, order, 1, i, step + 1))


def _finish(req: MooncakeRequest, now: int, refs: dict[str, int], private: list[str]) -> Iterator[pb.Event]:
    if req.hash_ids:
        yield pb.Event(ts_us=now, released=pb.BlocksReleased(block_ids=req.hash_ids))
        for block_id in req.hash_ids:
            refs[block_id] -= 1
    if private:
        yield pb.Event(ts_us=now, freed=pb.BlocksFreed(block_ids=private))


def read_mooncake(path: str, opts: MooncakeOptions | None = None, skips: SkipCounter | None = None) -> Iterator[pb.IntentBatch]:
    """IntentBatches of a Mooncake trace (all requests are read first, to order them)."""
    opts = opts or MooncakeOptions()
    requests = read_requests(path, skips or SkipCounter())
    events = decode_events(requests, opts) if opts.decode else prompt_only_events(requests, opts)
    yield from batched(events, opts.client_id, opts.batch_events)
