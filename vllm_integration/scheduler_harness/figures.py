"""What a vLLM operator reads of a run: time to first token, throughput, and where the
prompt tokens came from (the GPU prefix cache, the CPU tier, computed), with the share of
the no-CPU-tier engine's compute that the CPU tier saves. No vLLM import."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Protocol


class _Request(Protocol):
    prompt_tokens: int
    output_tokens: int
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    computed_tokens: int

    @property
    def ttft_s(self) -> float: ...


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank: a value that occurred (nan if none)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclasses.dataclass(frozen=True)
class Figures:
    label: str
    requests: int
    refused: int
    ttft_p50_s: float
    ttft_p99_s: float
    # Requests and output tokens per second of the run (first arrival to last finish).
    requests_per_s: float
    output_tokens_per_s: float
    prompt_tokens: int
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    computed_tokens: int
    cpu_chunks: int
    evictions: int
    wall_s: float
    # The share of the no-CPU-tier run's computed tokens this run did not compute (None
    # without a baseline).
    compute_saved: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summarize(label: str, result: Any, baseline: Any | None = None) -> Figures:
    """The figures of a run (an engine.RunResult), against ``baseline`` (the same engine
    and requests without a CPU tier) when given."""
    reqs: Sequence[_Request] = result.requests
    computed = sum(r.computed_tokens for r in reqs)
    saved = None
    if baseline is not None:
        base = sum(r.computed_tokens for r in baseline.requests)
        saved = (base - computed) / base if base else 0.0
    span = result.makespan_s or math.inf
    return Figures(
        label=label,
        requests=len(reqs),
        refused=result.refused,
        ttft_p50_s=percentile([r.ttft_s for r in reqs], 0.5),
        ttft_p99_s=percentile([r.ttft_s for r in reqs], 0.99),
        requests_per_s=len(reqs) / span,
        output_tokens_per_s=sum(r.output_tokens for r in reqs) / span,
        prompt_tokens=sum(r.prompt_tokens for r in reqs),
        gpu_hit_tokens=sum(r.gpu_hit_tokens for r in reqs),
        cpu_hit_tokens=sum(r.cpu_hit_tokens for r in reqs),
        computed_tokens=computed,
        cpu_chunks=result.cpu_chunks,
        evictions=len(result.evicted),
        wall_s=result.wall_s,
        compute_saved=saved,
    )


HEADER = (
    "| CPU tier policy | TTFT p50 (s) | TTFT p99 (s) | req/s | out tok/s | GPU hit | CPU hit | computed | compute saved |",
    "| --- | --: | --: | --: | --: | --: | --: | --: | --: |",
)


def table_row(f: Figures) -> str:
    """A markdown row: token shares are of the prompt tokens."""
    total = f.prompt_tokens or 1
    saved = "" if f.compute_saved is None else f"{100 * f.compute_saved:.1f}%"
    return (
        f"| {f.label} | {f.ttft_p50_s:.2f} | {f.ttft_p99_s:.2f} | {f.requests_per_s:.2f} | {f.output_tokens_per_s:.0f} "
        f"| {100 * f.gpu_hit_tokens / total:.1f}% | {100 * f.cpu_hit_tokens / total:.1f}% "
        f"| {100 * f.computed_tokens / total:.1f}% | {saved} |"
    )
