"""The options every importer takes (each uses those that apply to it)."""

from __future__ import annotations

import dataclasses

from broker.replay.traces.mooncake import MooncakeOptions


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
