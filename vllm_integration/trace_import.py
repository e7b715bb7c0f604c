"""vLLM KV-event captures (``--format vllm-events``): what ``kvbroker vllm-bridge --capture``
wrote, turned into the broker events the bridge sent.

The capture format is in ``vllm_integration.events_from_vllm.zmq_events``. Each rank's records go through the same
``EngineTranslator`` as live, with the header's tier map, client id prefix and mapping
options, so replaying a capture gives the bridge's events: a restart record, or (in captures
written before those) a record whose seq goes back, is an engine restart (its blocks are
cleared with the next batch, as live), a jump is a loss the bridge could not repair (nothing
to do). One IntentBatch per record that produced events, per rank client
id (``<client_id>-dp<rank>``). The model is the header's unless ``--model`` names another.
The bridge's clear of stale broker state at start is not part of a capture.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from broker.replay.traces.base import SkipCounter, TraceError
from kvbroker.v1 import intent_pb2 as pb
from vllm_integration.events_from_vllm.to_intents import DEFAULT_TIER_MAP, EngineTranslator, MappingOptions
from vllm_integration.events_from_vllm.zmq_events import (
    RESTART_RECORD_SEQ,
    CaptureError,
    DecodeError,
    SeqTracker,
    decode_batch,
    rank_namespace,
    ts_to_us,
)

if TYPE_CHECKING:  # broker.replay.traces imports this module to register the format
    from broker.replay.traces.options import TraceOptions


@dataclasses.dataclass(frozen=True)
class VllmCaptureOptions:
    # None: the capture header's.
    model: str | None = None
    dtype: str | None = None
    block_bytes: int | None = None
    tier_map: tuple[tuple[str, str], ...] | None = None
    client_id: str | None = None


def _tier_map(value: Any, path: str) -> tuple[tuple[str, str], ...]:
    if value is None:
        return DEFAULT_TIER_MAP
    try:
        pairs = tuple((str(m).upper(), str(t)) for m, t in value)
    except (TypeError, ValueError):
        raise TraceError(path, 0, "header.tier_map", f"expected [[medium, tier], ...], got {value!r}") from None
    if not pairs:
        raise TraceError(path, 0, "header.tier_map", "empty")
    return pairs


def read_vllm_capture(path: str, opts: VllmCaptureOptions | None = None, skips: SkipCounter | None = None) -> Iterator[pb.IntentBatch]:
    """IntentBatches of a capture, in the order the bridge applied them."""
    opts = opts or VllmCaptureOptions()
    skips = skips or SkipCounter()
    try:
        from vllm_integration.events_from_vllm.zmq_events import read_capture

        header, records = read_capture(path)
    except CaptureError as exc:
        raise TraceError(path, exc.index, "capture", exc.reason) from None
    dp_size = int(header.get("dp_size") or 1)
    prefix = opts.client_id or str(header.get("client_id") or "vllm")
    block_bytes = opts.block_bytes if opts.block_bytes is not None else header.get("block_bytes")
    offload_block_size = header.get("offload_block_size")
    prefill_rate = header.get("prefill_tokens_per_s")
    try:
        base = MappingOptions(
            model=opts.model or str(header.get("model") or MappingOptions.model),
            dtype=opts.dtype or str(header.get("dtype") or MappingOptions.dtype),
            block_bytes=int(block_bytes) if block_bytes is not None else None,
            tier_map=opts.tier_map or _tier_map(header.get("tier_map"), path),
            tenant=str(header.get("tenant") or ""),
            offload_block_size=int(offload_block_size) if offload_block_size is not None else None,
            prefill_tokens_per_s=float(prefill_rate) if prefill_rate is not None else None,
            gpu_reuse_reports=bool(header.get("gpu_reuse_reports", False)),
        )
    except (TypeError, ValueError) as exc:
        raise TraceError(path, 0, "header", str(exc)) from None
    translators: dict[int, EngineTranslator] = {}
    trackers: dict[int, SeqTracker] = {}
    seqs: dict[int, int] = {}
    # Ranks whose engine restarted: the clear goes with the next batch, as the bridge sent it.
    restarted: set[int] = set()
    shape = None
    for record in records:
        if isinstance(record, CaptureError):
            skips.bad(TraceError(path, record.index, "record", record.reason))
            continue
        rank = record.rank
        translator = translators.get(rank)
        if translator is None:
            try:
                translator = EngineTranslator(dataclasses.replace(base, namespace=rank_namespace(rank, dp_size)), shape)
            except ValueError as exc:
                raise TraceError(path, record.index, "header.model", str(exc)) from None
            shape = translator.shape
            translators[rank] = translator
            trackers[rank] = SeqTracker()
        tracker = trackers[rank]
        if record.seq == RESTART_RECORD_SEQ and not record.payload:
            tracker.restarted()
            restarted.add(rank)
            continue
        events: list[pb.Event] = []
        try:
            batch = decode_batch(record.payload)
        except DecodeError:
            # As live: vLLM sent it, the bridge counted and skipped it (not a damaged capture).
            translator.stats.bad_batches += 1
            batch = None
        ts = ts_to_us(batch.ts if batch is not None else None, record.ts)
        if record.seq <= tracker.last:  # a capture without restart records
            tracker.restarted()
            restarted.add(rank)
        if rank in restarted:
            restarted.discard(rank)
            events.extend(translator.restart(ts))
        tracker.applied(record.seq)
        if batch is not None:
            events.extend(translator.translate(batch, ts))
        if events:
            seqs[rank] = seqs.get(rank, 0) + 1
            yield pb.IntentBatch(client_id=f"{prefix}-dp{rank}", batch_seq=seqs[rank], events=events)


def capture_format(path: str, opts: TraceOptions, skips: SkipCounter) -> Iterator[pb.IntentBatch]:
    from broker.replay.traces.options import TraceOptions

    # --model overrides the capture's only when it was given (differs from the default).
    model = opts.model if opts.model != TraceOptions.model else None
    return read_vllm_capture(path, VllmCaptureOptions(model=model), skips)
