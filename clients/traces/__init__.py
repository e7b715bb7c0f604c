"""Trace importers: each reads a file and yields IntentBatches, knowing nothing of caches.

``kvbroker replay --trace PATH --format F`` runs them through the core; ``kvbroker import``
writes them to a journal file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from clients.traces import kvds, profiles, vllm
from clients.traces.base import SkipCounter, TraceError
from clients.traces.mooncake import MooncakeOptions, read_mooncake
from kvbroker.v1 import intent_pb2 as pb

__all__ = ["FORMATS", "SkipCounter", "TraceError", "TraceOptions", "read_trace"]


@dataclasses.dataclass(frozen=True)
class TraceOptions:
    """Options common to the importers (each uses those that apply to it)."""

    decode: bool = True
    bytes_per_token: int = MooncakeOptions.bytes_per_token
    tpot_us: int = MooncakeOptions.tpot_us
    batch_events: int = 512
    skip_bad: bool = False
    # kvds-events: event time of one seed step, in microseconds.
    us_per_step: int = 1000
    # kvds-requests: tokens per KV block (Mooncake's is fixed at 512 by its hash ids) and the
    # model of requests that name none (their blocks are sized from it, not bytes_per_token).
    block_tokens: int = 16
    model: str = "llama-3-8b"
    # profile: the generator's seed and the factor on its request / page counts.
    seed: int = 42
    scale: float = 1.0


def _mooncake(path: str, opts: TraceOptions, skips: SkipCounter) -> Iterator[pb.IntentBatch]:
    mopts = MooncakeOptions(decode=opts.decode, bytes_per_token=opts.bytes_per_token, tpot_us=opts.tpot_us, batch_events=opts.batch_events)
    return read_mooncake(path, mopts, skips)


FORMATS: dict[str, Callable[[str, TraceOptions, SkipCounter], Iterator[pb.IntentBatch]]] = {
    "mooncake": _mooncake,
    "kvds-events": kvds.events_format,
    "kvds-requests": kvds.requests_format,
    # The trace "path" is a profile name (clients.traces.profiles.PROFILES).
    "profile": profiles.profile_format,
    # A capture written by `kvbroker vllm-bridge --capture` (format in clients.vllm_events).
    "vllm-events": vllm.capture_format,
}


def read_trace(path: str, fmt: str, opts: TraceOptions, skips: SkipCounter | None = None) -> Iterator[pb.IntentBatch]:
    reader = FORMATS.get(fmt)
    if reader is None:
        raise TraceError(path, 0, "format", f"unknown trace format {fmt!r} (formats: journal, {', '.join(sorted(FORMATS))})")
    return reader(path, opts, skips or SkipCounter(opts.skip_bad))
