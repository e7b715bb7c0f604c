"""vLLM's own scheduling code on CPU, with a fake model executor: the engine as it runs.

What is vLLM's here, unchanged: ``Scheduler`` (vllm/v1/core/sched/scheduler.py), its
``KVCacheManager`` (the GPU prefix cache: 16-token blocks, its free-queue LRU), the
``OffloadingConnector``'s scheduler side and ``CPUOffloadingSpec`` / ``CPUOffloadingManager``
(the CPU tier), with vLLM's lru or arc CachePolicy, or kvbroker's
(``vllm_integration.decisions_to_vllm.cache_policy.KvbrokerCachePolicy``, loaded by module
path as vLLM loads it). They are built the way vLLM's own tests build a scheduler
(tests/v1/core/utils.py, tests/v1/kv_connector/unit/utils.py in vLLM's repository): a
``VllmConfig`` over a model config written locally (Llama-3.1-8B's shape, no weights), a
``KVCacheConfig`` of ``gpu_blocks`` blocks.

What is the harness's: the executor. Each step it answers the scheduler as the model runner
and the offloading worker would: a token for each request whose prompt is done, nothing for a
prefill chunk; the CPU tier's loads and stores completing after their modeled time on the host
link (settings.CostModel), reported the way vLLM's offloading worker reports them (job ids in
``OffloadingWorkerMetadata``, a loaded request in ``finished_recving``). Time is the cost
model's, not the wall clock: requests arrive at their trace time, and the same inputs give
the same figures.

Per request, the split of its prompt is vLLM's own ``PrefillStats`` (the first schedule's
GPU-cache hit and CPU-tier hit); the harness counts the prefill tokens it executed beside it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import pathlib
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from vllm_integration.decisions_to_vllm import intent_bytes
from vllm_integration.scheduler_harness.settings import GPU_BLOCK_TOKENS, HarnessError, HarnessSettings
from vllm_integration.scheduler_harness.trace import TraceRequest

ADAPTER_MODULE = "vllm_integration.decisions_to_vllm.cache_policy"
ADAPTER_CLASS = "KvbrokerCachePolicy"
# The model the config describes (its shape only: the scheduler never reads weights).
HEAD_DIM = 128
# The token every fake step samples (the requests ignore EOS and stop at their length).
TOKEN = 0
# Steps in a row that run nothing and wait for nothing before the run is declared stuck.
IDLE_STEPS = 1000


@functools.cache
def _model_dir() -> str:
    """A local model directory holding only a Llama config.json (read by vLLM's
    ModelConfig; no tokenizer, no weights, no network)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="kvbroker-harness-model-"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "head_dim": HEAD_DIM,
        "vocab_size": 128256,
        "max_position_embeddings": 1 << 22,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def connector_extra_config(settings: HarnessSettings) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` of the engine's OffloadingConnector."""
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": settings.cpu_bytes,
        "block_size": settings.cpu_chunk_tokens,
        "store_threshold": settings.store_threshold,
    }
    if settings.policy_family == "vllm":
        extra["eviction_policy"] = settings.policy_name
    else:
        extra.update(
            eviction_policy=ADAPTER_CLASS,
            cache_policy_module_path=ADAPTER_MODULE,
            kvbroker_policy=settings.policy_name,
            kvbroker_policy_params=dict(settings.policy_params),
        )
    return extra


def vllm_config(settings: HarnessSettings) -> VllmConfig:
    model = ModelConfig(model=_model_dir(), skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=settings.max_model_len)
    scheduler = SchedulerConfig(
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=False,
    )
    cache = CacheConfig(block_size=GPU_BLOCK_TOKENS, gpu_memory_utilization=0.9, enable_prefix_caching=True)
    cache.num_gpu_blocks = settings.gpu_blocks
    transfer = None
    if settings.offloads:
        extra = connector_extra_config(settings)
        transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    return VllmConfig(
        scheduler_config=scheduler,
        model_config=model,
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(settings: HarnessSettings) -> KVCacheConfig:
    """One full-attention group whose block holds ``kv_bytes_per_token`` bytes a token (so
    vLLM's CPUOffloadingSpec counts the CPU tier's chunks from the cost model's bytes)."""
    per_token = settings.cost.kv_bytes_per_token
    if per_token % (4 * HEAD_DIM):
        raise HarnessError(f"cost.kv_bytes_per_token: a multiple of {4 * HEAD_DIM} (K and V, {HEAD_DIM} bf16 dims), got {per_token}")
    heads = per_token // (4 * HEAD_DIM)
    spec = FullAttentionSpec(block_size=GPU_BLOCK_TOKENS, num_kv_heads=heads, head_size=HEAD_DIM, dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=settings.gpu_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layers"], spec)])


def build_scheduler(settings: HarnessSettings) -> Scheduler:
    """vLLM's Scheduler for ``settings``, as vLLM's tests build one."""
    settings.check()
    config = vllm_config(settings)
    init_none_hash(sha256)
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config(settings),
        structured_output_manager=StructuredOutputManager(config),
        block_size=GPU_BLOCK_TOKENS,
        log_stats=True,
    )


def offload_manager(scheduler: Scheduler) -> Any:
    """The CPU tier's CPUOffloadingManager (None without a CPU tier)."""
    connector = scheduler.connector
    if connector is None:
        return None
    return connector.connector_scheduler.manager


@dataclasses.dataclass
class RequestFigures:
    """One request as the engine served it (times in seconds of the run)."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    # vLLM's PrefillStats of the request's first schedule.
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    computed_tokens: int = 0
    # Prefill tokens the executor ran for it (more than computed_tokens after a preemption).
    executed_prefill_tokens: int = 0
    first_token_s: float | None = None
    finished_s: float | None = None
    preempted: bool = False

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.arrival_s


@dataclasses.dataclass
class RunResult:
    settings: HarnessSettings
    requests: list[RequestFigures]
    # Requests longer than the GPU cache holds (vLLM refuses them: prompt + output > max_model_len).
    refused: int
    makespan_s: float
    steps: int
    cpu_chunks: int
    # Every eviction the CPU tier's policy made, in order (its keys).
    evicted: list[bytes]
    wall_s: float
    # The CPU tier's CachePolicy (None without a CPU tier): kvbroker's holds its core.
    policy: Any = None


@dataclasses.dataclass
class _Transfer:
    done_s: float
    job_id: int
    # The request an asynchronous load completes (None for a store).
    req_id: str | None
    reported: bool = False


class _HostLink:
    """One direction of the host link: transfers one after another, in submission order."""

    def __init__(self, settings: HarnessSettings) -> None:
        self.cost = settings.cost
        self.free_s = 0.0
        self.queue: collections.deque[_Transfer] = collections.deque()

    def submit(self, now: float, tokens: int, job_id: int, req_id: str | None) -> _Transfer:
        start = max(now, self.free_s)
        self.free_s = start + self.cost.transfer_seconds(tokens)
        transfer = _Transfer(self.free_s, job_id, req_id)
        self.queue.append(transfer)
        return transfer

    def done_by(self, now: float) -> list[_Transfer]:
        done: list[_Transfer] = []
        while self.queue and self.queue[0].done_s <= now:
            t = self.queue.popleft()
            if not t.reported:
                done.append(t)
        return done

    def next_done(self) -> float | None:
        return next((t.done_s for t in self.queue if not t.reported), None)


def _tokens(spec: Any) -> int:
    return len(spec.block_ids) * GPU_BLOCK_TOKENS if isinstance(spec, GPULoadStoreSpec) else 0


class _Executor:
    """The model runner and the offloading worker, faked: what a step costs, what it reports."""

    def __init__(self, settings: HarnessSettings) -> None:
        self.cost = settings.cost
        self.loads = _HostLink(settings)
        self.stores = _HostLink(settings)
        self.jobs: dict[int, _Transfer] = {}

    def pending(self) -> bool:
        return bool(self.jobs)

    def next_done(self) -> float | None:
        times = [t for t in (self.loads.next_done(), self.stores.next_done()) if t is not None]
        return min(times) if times else None

    def start(self, meta: Any, now: float) -> float:
        """This step's transfers: loads start now; a flushed job is waited for (the seconds
        the step stalls are returned). Stores are submitted after the step (``finish``)."""
        stall = 0.0
        if meta is None:
            return stall
        for job_id in meta.jobs_to_flush or ():
            transfer = self.jobs.get(job_id)
            if transfer is not None:
                stall = max(stall, transfer.done_s - now)
        for job_id, job in meta.load_jobs.items():
            self.jobs[job_id] = self.loads.submit(now, _tokens(job.dst_spec), job_id, None if job.sync else job.req_id)
        return stall

    def finish(self, meta: Any, now: float) -> KVConnectorOutput | None:
        """After the step (at ``now``): its stores submitted (vLLM's worker defers them past
        the step), and what completed by now reported as vLLM's worker reports it."""
        if meta is None:
            return None
        for job_id, job in meta.store_jobs.items():
            self.jobs[job_id] = self.stores.submit(now, _tokens(job.src_spec), job_id, None)
        completed: dict[int, int] = {}
        recving: set[str] = set()
        for job_id in meta.jobs_to_flush or ():
            transfer = self.jobs.get(job_id)
            if transfer is not None and not transfer.reported:
                transfer.reported = True
                completed[job_id] = 1
                if transfer.req_id is not None:
                    recving.add(transfer.req_id)
        for transfer in (*self.loads.done_by(now), *self.stores.done_by(now)):
            transfer.reported = True
            completed[transfer.job_id] = 1
            if transfer.req_id is not None:
                recving.add(transfer.req_id)
        for job_id in completed:
            del self.jobs[job_id]
        return KVConnectorOutput(
            finished_sending=set(),
            finished_recving=recving,
            kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=completed) if completed else None,
        )


def _record_evictions(manager: Any, sink: list[bytes]) -> None:
    """Every victim the CPU tier's policy returns, appended to ``sink`` (the policy's evict
    wrapped on the instance; vLLM's manager calls it as before)."""
    policy = manager._policy
    evict: Callable[..., Any] = policy.evict

    def recorded(n: int, protected: set[Any]) -> Any:
        victims = evict(n, protected)
        if victims is not None:
            sink.extend(bytes(key) for key, _ in victims)
        return victims

    policy.evict = recorded


class _Clock:
    """The run's time (seconds), which kvbroker's policy reads as event time."""

    now = 0.0


def _trace_time(manager: Any, clock: _Clock) -> None:
    """kvbroker's CachePolicy stamps its events with the run's time instead of the wall
    clock (as ``kvbroker replay --engine vllm`` stamps them with the trace's), so that a
    policy reading event time decides the same on the same inputs."""
    translator = getattr(manager._policy, "translator", None)
    if translator is None:
        return

    def timestamp() -> bytes:
        ms = int(clock.now * 1000)
        if ms != translator._ts_ms:
            translator._ts_ms = ms
            translator._ts = intent_bytes.timestamp(ms * 1000)
        ts: bytes = translator._ts
        return ts

    translator.timestamp = timestamp


def run(settings: HarnessSettings, requests: Sequence[TraceRequest]) -> RunResult:
    """Serve ``requests`` (by arrival) on the engine ``settings`` describe; every figure."""
    started = time.perf_counter()
    scheduler = build_scheduler(settings)
    manager = offload_manager(scheduler)
    evicted: list[bytes] = []
    clock = _Clock()
    if manager is not None:
        _record_evictions(manager, evicted)
        _trace_time(manager, clock)
    executor = _Executor(settings)
    hasher = get_request_block_hasher(GPU_BLOCK_TOKENS, sha256)
    arrivals = collections.deque(sorted(requests, key=lambda r: (r.arrival_s, r.index)))
    figures: dict[str, RequestFigures] = {}
    refused = 0
    now = 0.0
    steps = idle = 0
    while True:
        while arrivals and arrivals[0].arrival_s * settings.time_scale <= now:
            r = arrivals.popleft()
            if r.prompt_tokens + r.output_tokens > settings.max_model_len:
                refused += 1
                continue
            req_id = str(r.index)
            arrival = r.arrival_s * settings.time_scale
            figures[req_id] = RequestFigures(r.index, arrival, r.prompt_tokens, r.output_tokens)
            params = SamplingParams(max_tokens=r.output_tokens, ignore_eos=True)
            scheduler.add_request(
                Request(req_id, r.prompt(), params, None, arrival_time=arrival, block_hasher=hasher),
            )
        if not scheduler.has_requests() and not executor.pending():
            if not arrivals:
                break
            now = arrivals[0].arrival_s * settings.time_scale
            continue
        clock.now = now
        out = scheduler.schedule()
        steps += 1
        meta = out.kv_connector_metadata
        stall = executor.start(meta, now)
        prefill = decode_context = 0
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for req_id, n in out.num_scheduled_tokens.items():
            req = scheduler.requests[req_id]
            before = req.num_computed_tokens - n
            ran_prefill = max(0, min(before + n, req.num_prompt_tokens) - before)
            prefill += ran_prefill
            figures[req_id].executed_prefill_tokens += ran_prefill
            if ran_prefill == 0:
                decode_context += before + n
            req_ids.append(req_id)
            sampled.append([TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
        for req_id in out.preempted_req_ids or ():
            figures[req_id].preempted = True
        if out.total_num_scheduled_tokens:
            now += stall + settings.cost.step_seconds(prefill, decode_context)
        else:
            # Nothing to run: the engine waits for a transfer or the next arrival.
            waits = [t for t in (executor.next_done(), arrivals[0].arrival_s * settings.time_scale if arrivals else None) if t is not None]
            if waits:
                now = max(now + stall, min(waits))
            idle += 1
            if idle > IDLE_STEPS:
                raise RuntimeError(f"the engine is stuck at {now:.3f} s: {scheduler.get_num_unfinished_requests()} requests, nothing runs")
        if out.total_num_scheduled_tokens or executor.pending():
            idle = 0
        clock.now = now
        kv_output = executor.finish(meta, now)
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )
        for engine_outputs in scheduler.update_from_output(out, runner).values():
            for o in engine_outputs.outputs:
                f = figures[o.request_id]
                stats = o.prefill_stats
                if stats is not None:
                    f.gpu_hit_tokens = stats.num_local_cached_tokens
                    f.cpu_hit_tokens = stats.num_external_cached_tokens
                    f.computed_tokens = stats.num_computed_tokens
                if o.new_token_ids and f.first_token_s is None:
                    f.first_token_s = now
                if o.finish_reason is not None:
                    f.finished_s = now
    cpu_chunks = manager._num_chunks if manager is not None else 0
    return RunResult(
        settings=settings,
        requests=sorted(figures.values(), key=lambda f: f.index),
        refused=refused,
        makespan_s=now,
        steps=steps,
        cpu_chunks=cpu_chunks,
        evicted=evicted,
        wall_s=time.perf_counter() - started,
        policy=manager._policy if manager is not None else None,
    )
