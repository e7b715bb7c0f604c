"""Trace importers: each reads a file and yields IntentBatches, knowing nothing of caches.

``kvbroker replay --trace PATH --format F`` runs them through the core; ``kvbroker import``
writes them to a journal file.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

from broker.replay.traces import kvds, profiles
from broker.replay.traces.base import SkipCounter, TraceError
from broker.replay.traces.mooncake import MooncakeOptions, read_mooncake, read_requests
from broker.replay.traces.mooncake import event_count as mooncake_event_count
from broker.replay.traces.options import TraceOptions
from kvbroker.v1 import intent_pb2 as pb

__all__ = ["FORMATS", "SkipCounter", "TraceError", "TraceOptions", "count_events", "read_trace"]


def _mooncake_options(opts: TraceOptions) -> MooncakeOptions:
    return MooncakeOptions(decode=opts.decode, bytes_per_token=opts.bytes_per_token, tpot_us=opts.tpot_us, batch_events=opts.batch_events)


def _mooncake(path: str, opts: TraceOptions, skips: SkipCounter) -> Iterator[pb.IntentBatch]:
    return read_mooncake(path, _mooncake_options(opts), skips)


@functools.lru_cache(maxsize=8)
def count_events(path: str, fmt: str, opts: TraceOptions) -> int | None:
    """The events a trace imports to, known before its replay (None where a format's count
    is only known by importing it). Read once per process for a sweep's jobs, its progress
    and its warning of a long run."""
    if fmt != "mooncake":
        return None
    return mooncake_event_count(read_requests(path, SkipCounter(opts.skip_bad)), _mooncake_options(opts))


def _vllm_capture(path: str, opts: TraceOptions, skips: SkipCounter) -> Iterator[pb.IntentBatch]:
    # By its registered path: the importer lives with the rest of the vLLM integration and
    # imports this package's base and options (broker/ imports nothing of vllm_integration/).
    from broker.replay.engines import VLLM_CAPTURE_READER, by_path

    batches: Iterator[pb.IntentBatch] = by_path(VLLM_CAPTURE_READER)(path, opts, skips)
    return batches


FORMATS: dict[str, Callable[[str, TraceOptions, SkipCounter], Iterator[pb.IntentBatch]]] = {
    "mooncake": _mooncake,
    "kvds-events": kvds.events_format,
    "kvds-requests": kvds.requests_format,
    # The trace "path" is a profile name (broker.replay.traces.profiles.PROFILES).
    "profile": profiles.profile_format,
    # A capture written by `kvbroker vllm-bridge --capture` (format in vllm_integration.events_from_vllm.zmq_events).
    "vllm-events": _vllm_capture,
}


def read_trace(path: str, fmt: str, opts: TraceOptions, skips: SkipCounter | None = None) -> Iterator[pb.IntentBatch]:
    reader = FORMATS.get(fmt)
    if reader is None:
        raise TraceError(path, 0, "format", f"unknown trace format {fmt!r} (formats: journal, {', '.join(sorted(FORMATS))})")
    return reader(path, opts, skips or SkipCounter(opts.skip_bad))
