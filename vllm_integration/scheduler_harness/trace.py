"""Mooncake requests as the prompts vLLM's scheduler sees.

A Mooncake line names its prompt's 512-token blocks by hash id (prefix-chained: two prompts
share a block id only where they share everything up to it). The harness gives block ``h``
the tokens ``h * 512 .. h * 512 + 511``, so a prompt is the concatenation of its blocks,
cut at ``input_length``. vLLM then hashes it into its own 16-token blocks as it hashes any
prompt (sha256, chained), and the hashes are stable from run to run: two prompts share a
16-token block exactly where Mooncake says they share the 512-token block around it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from broker.replay.traces import SkipCounter
from broker.replay.traces.mooncake import read_requests
from vllm_integration.scheduler_harness.settings import MOONCAKE_BLOCK_TOKENS


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: its arrival (seconds from the trace's start), its prompt's Mooncake
    blocks and length, its output length."""

    index: int
    arrival_s: float
    hash_ids: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int

    def prompt(self) -> list[int]:
        """The prompt's token ids (built when the request arrives: a trace's prompts
        together would not fit in memory)."""
        tokens: list[int] = []
        for h in self.hash_ids:
            start = h * MOONCAKE_BLOCK_TOKENS
            tokens.extend(range(start, start + MOONCAKE_BLOCK_TOKENS))
            if len(tokens) >= self.prompt_tokens:
                break
        return tokens[: self.prompt_tokens]


def mooncake(path: str, limit: int | None = None, skips: SkipCounter | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests of a Mooncake trace (all if None), by arrival. A request
    with an empty prompt or no output is skipped (vLLM serves neither), counted in ``skips``."""
    counter = skips if skips is not None else SkipCounter()
    out: list[TraceRequest] = []
    for r in read_requests(path, counter):
        if limit is not None and len(out) >= limit:
            break
        prompt = min(r.input_length, MOONCAKE_BLOCK_TOKENS * len(r.hash_ids))
        if prompt < 1 or r.output_length < 1:
            counter.skipped += 1
            continue
        ids = tuple(int(h[1:]) for h in r.hash_ids)
        out.append(TraceRequest(r.index, r.arrival_us / 1e6, ids, prompt, r.output_length))
    return out


def requests_from(rows: Iterable[tuple[float, Iterable[int], int, int]]) -> list[TraceRequest]:
    """Requests from (arrival s, hash ids, prompt tokens, output tokens) rows (generators)."""
    return [TraceRequest(i, t, tuple(ids), p, o) for i, (t, ids, p, o) in enumerate(rows)]
