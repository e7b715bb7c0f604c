"""``kvbroker replay --engine vllm-scheduler``: a Mooncake trace through the harness, with the
policy of the job deciding the CPU tier through kvbroker's CachePolicy (registered in
broker/replay/engines.py by its dotted path; broker/ does not import this room).

The CPU tier's size is the job's top tier (``--hbm``), in the replay's tokens
(``--bytes-per-token``) turned into vLLM's bytes by the cost model's KV bytes a token; the
GPU cache and the scheduler's limits are the harness's defaults (settings.HarnessSettings).
The record's ``prompt_blocks``, ``prefix_hits`` and ``prefix_hit_rate`` are in tokens here:
prompt tokens, tokens loaded from the CPU tier, their share; ``gpu_hit_tokens``,
``computed_tokens``, ``ttft_p50_s``, ``ttft_p99_s``, ``output_tokens_per_s`` and
``refused_requests`` are added.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from broker.config import CoreConfig
from broker.replay.replay import ReplayResult
from broker.replay.traces import SkipCounter, TraceError
from vllm_integration.scheduler_harness import engine
from vllm_integration.scheduler_harness.figures import summarize
from vllm_integration.scheduler_harness.settings import HarnessSettings
from vllm_integration.scheduler_harness.trace import mooncake


def replay_engine(source: Any, config: CoreConfig, policy: str, params: dict[str, Any] | None) -> tuple[ReplayResult, int]:
    if source.trace is None or source.fmt != "mooncake":
        raise TraceError(str(source.trace), 0, "--engine", "vllm-scheduler replays a Mooncake trace (--format mooncake)")
    skips = SkipCounter(source.options.skip_bad)
    trace = mooncake(source.trace, skips=skips)
    base = HarnessSettings()
    tokens = config.tiers[0].capacity_bytes // source.options.bytes_per_token
    settings = dataclasses.replace(
        base, cpu_bytes=tokens * base.cost.kv_bytes_per_token, policy=f"kvbroker:{policy}", policy_params=dict(params or {})
    )
    result = engine.run(settings, trace)
    f = summarize(policy, result)
    core = result.policy.local.core
    metrics = core.stats.as_dict([t.name for t in core.tiers])
    metrics["prompt_blocks"] = f.prompt_tokens
    metrics["prefix_hits"] = f.cpu_hit_tokens
    metrics["prefix_hit_rate"] = f.cpu_hit_tokens / f.prompt_tokens if f.prompt_tokens else 0.0
    metrics["evictions"] = f.evictions
    metrics["engine_record"] = {
        "gpu_hit_tokens": f.gpu_hit_tokens,
        "computed_tokens": f.computed_tokens,
        "ttft_p50_s": f.ttft_p50_s,
        "ttft_p99_s": f.ttft_p99_s,
        "output_tokens_per_s": f.output_tokens_per_s,
        "refused_requests": f.refused,
        "cpu_chunks": f.cpu_chunks,
    }
    return ReplayResult.of_engine(core, result.wall_s, metrics), skips.skipped
