"""Drive vLLM's real ``CPUOffloadingManager`` (vllm/v1/kv_offload/cpu/manager.py) as its
scheduler does, with any CachePolicy: vLLM's own (``lru``, ``arc``) or kvbroker's adapter.

Needs vLLM (the tests that use it are marked ``vllm``). Used by tests/vllm_integration/decisions_to_vllm and by
bench/vllm_offload.py.

- ``random_stream``: a seeded stream of requests over shared prompt prefixes, several in
  flight at once, each looking up its chunks, loading its hits, storing its misses in
  groups, its loads and stores completing later (some stores failing), touches, request
  finishes, and now and then a cache reset. Every manager answer (lookups, each
  prepare_store's stored and evicted keys, refusals) goes into the trace: two policies that
  decide alike give equal traces.
- ``mooncake``: the Mooncake trace's requests in order, each: look up its prefix, load the
  hits, store the misses, finish. Returns the chunk hit ratio.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random
import time
from collections.abc import Callable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

ADAPTER_MODULE = "vllm_integration.decisions_to_vllm.cache_policy"
ADAPTER_CLASS = "KvbrokerCachePolicy"
MOONCAKE = pathlib.Path(__file__).resolve().parents[2] / "data" / "mooncake" / "synthetic_trace.jsonl"


class Spec:
    """Stands where vLLM's CPUOffloadingSpec stands: it holds the kv_connector_extra_config
    and builds the manager (so the adapter finds its ``kvbroker_*`` keys as it does in vLLM)."""

    def __init__(self, extra_config: Mapping[str, Any]) -> None:
        self.extra_config = dict(extra_config)

    def get_manager(self, num_chunks: int) -> CPUOffloadingManager:
        policy = self.extra_config.get("eviction_policy", "lru")
        # As vLLM's CPUOffloadingSpec reads it: below 2 no admission filter.
        store_threshold = int(self.extra_config.get("store_threshold", 0))
        return CPUOffloadingManager(
            num_chunks,
            cache_policy=policy,
            cache_policy_module_path=self.extra_config.get("cache_policy_module_path"),
            store_threshold=store_threshold,
        )


def offloading_config(extra_config: Mapping[str, Any]) -> Any:
    """What vLLM's CPUOffloadingSpec reads of its config, for a small CPU tier (64 chunks
    of one 16-token block), with ``extra_config`` as its kv_connector_extra_config."""
    from types import SimpleNamespace

    return SimpleNamespace(
        extra_config={"cpu_bytes_to_use": 64 * 4096, **extra_config},
        enable_kv_cache_events=False,
        groups=(SimpleNamespace(tokens_per_block=16, sliding_window_size_in_chunks=None),),
        cache=SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=SimpleNamespace(world_size=1, rank=0),
        worker_kv_bytes_per_block=4096,
        replicated_layout=False,
        model=SimpleNamespace(max_model_len=0),
        engine_id="e",
    )


def vllm_manager(policy: str, num_chunks: int, store_threshold: int = 0) -> CPUOffloadingManager:
    """A manager with one of vLLM's own policies (``lru``, ``arc``) and vLLM's admission
    setting ``store_threshold`` (a chunk is stored on its Nth offer; below 2, always)."""
    return Spec({"eviction_policy": policy, "store_threshold": store_threshold}).get_manager(num_chunks)


class LRUAnchoredPerCall(LRUCachePolicy):
    """vLLM's own LRU with one change: a request's rank is renewed at every call that asks
    for it (each ``on_request_access``, each positioned ``insert``), instead of being fixed
    at the request's first use. A request-scoped use then counts as of the call that makes
    it: the newest, tails before heads within the call (what plain move-to-end accesses
    express). The tests use it to show that a stream exercises the request's rank: where
    this answers otherwise than vLLM's LRU, kvbroker's lru must still answer as vLLM's.

    Overrides a private method of vLLM 0.33's LRUCachePolicy (``_get_request_rank``); a
    vLLM that renames it fails the tests that use this loudly (the manager cannot build it)."""

    def _get_request_rank(self, req_context: ReqContext) -> int:
        assert hasattr(LRUCachePolicy, "_get_request_rank"), "vLLM's LRUCachePolicy changed"
        self._next_rank += 1
        return self._next_rank


def anchored_lru_manager(num_chunks: int) -> CPUOffloadingManager:
    """A manager with ``LRUAnchoredPerCall``, loaded by module path as vLLM loads any policy."""
    return Spec({"eviction_policy": "LRUAnchoredPerCall", "cache_policy_module_path": __name__}).get_manager(num_chunks)


def kvbroker_manager(policy: str, num_chunks: int, **extra: Any) -> CPUOffloadingManager:
    """A manager with kvbroker's adapter running ``policy`` (``kvbroker_*`` keys in ``extra``,
    without the prefix)."""
    config = {"eviction_policy": ADAPTER_CLASS, "cache_policy_module_path": ADAPTER_MODULE, "kvbroker_policy": policy}
    config.update({f"kvbroker_{k}": v for k, v in extra.items()})
    return Spec(config).get_manager(num_chunks)


def key(n: int, group: int = 0) -> Any:
    """Block ``n``'s key in KV cache group ``group``: groups hash alike blocks apart (so
    the keys of one position sort in no particular group order)."""
    digest = n if group == 0 else (n * 2654435761 + group * 0x9E3779B97F4A7C15) % 2**64
    return make_offload_key(digest.to_bytes(8, "big"), group)


@dataclasses.dataclass
class Request:
    ctx: ReqContext
    keys: list[Any]
    rng: random.Random
    state: str = "lookup"
    misses: list[Any] = dataclasses.field(default_factory=list)
    loading: list[Any] = dataclasses.field(default_factory=list)
    storing: list[list[Any]] = dataclasses.field(default_factory=list)


def random_stream(
    manager: CPUOffloadingManager,
    seed: int,
    steps: int,
    *,
    positions: bool = False,
    hints: Callable[[random.Random], Any] | None = None,
    docs: int = 40,
    doc_len: int = 24,
    concurrency: int = 4,
    reset_every: int = 0,
    groups: int = 1,
    req_ids: Callable[[int], str] | None = None,
) -> list[tuple[Any, ...]]:
    """Run ``steps`` scheduler actions; the trace of every manager answer. ``groups``: KV
    cache groups (a hybrid model's): each token position has one key per group, all with
    the same position. ``req_ids``: request n's id (default ``r{n}``)."""
    rng = random.Random(seed)
    trace: list[tuple[Any, ...]] = []
    active: list[Request] = []
    fresh = 10_000_000
    n_req = 0
    resetting = False
    for step in range(steps):
        if reset_every and step % reset_every == reset_every - 1:
            resetting = True  # no new request until the ones in flight are done (vLLM resets an idle cache)
        if resetting and not active:
            manager.reset_cache()
            trace.append(("reset",))
            resetting = False
            continue
        if not resetting and len(active) < concurrency and (not active or rng.random() < 0.3):
            n_req += 1
            req_rng = random.Random(rng.getrandbits(64))
            doc = req_rng.randrange(docs)
            shared = req_rng.randint(0, doc_len)
            blocks = [doc * 1000 + i for i in range(shared)]
            for _ in range(req_rng.randint(1, 6)):
                fresh += 1
                blocks.append(fresh)
            keys = [key(n, g) for n in blocks for g in range(groups)]
            ctx = ReqContext(
                req_id=req_ids(n_req) if req_ids is not None else f"r{n_req}", kv_hints=hints(req_rng) if hints is not None else None
            )
            if positions:
                for i, k in enumerate(keys):
                    ctx.set_offload_key_position(k, (i // groups + 1) * 16)
            manager.on_new_request(ctx)
            active.append(Request(ctx, keys, req_rng))
            continue
        req = active[rng.randrange(len(active))]
        trace.append(advance(manager, req))
        if req.state == "done":
            active.remove(req)
    for req in active:  # drain: complete what is in flight, finish every request
        while req.state != "done":
            trace.append(advance(manager, req))
    return trace


def advance(manager: CPUOffloadingManager, req: Request) -> tuple[Any, ...]:
    """One scheduler action of a request; what the manager answered."""
    rng, ctx = req.rng, req.ctx
    if req.state == "lookup":
        hits = []
        for k in req.keys:
            if manager.lookup(k, ctx) != LookupResult.HIT:
                break
            hits.append(k)
        req.misses = req.keys[len(hits) :]
        if hits:
            manager.prepare_load(hits, ctx)
            req.loading = hits
        req.state = "store"
        return ("lookup", ctx.req_id, len(hits))
    if req.state == "store" and req.misses and rng.random() < 0.7:
        n = rng.randint(1, 4)
        group, req.misses = req.misses[:n], req.misses[n:]
        out = manager.prepare_store(group, ctx)
        if out is None:
            return ("store", ctx.req_id, None)
        if out.keys_to_store:
            req.storing.append(list(out.keys_to_store))
        return ("store", ctx.req_id, tuple(out.keys_to_store), tuple(out.evicted_keys))
    if req.loading and rng.random() < 0.5:
        manager.complete_load(req.loading, ctx)
        req.loading = []
        return ("loaded", ctx.req_id)
    if req.storing and rng.random() < 0.5:
        group = req.storing.pop(0)
        ok = rng.random() < 0.9
        manager.complete_store(group, ctx, success=ok)
        return ("stored", ctx.req_id, ok)
    if rng.random() < 0.15:
        touched = [k for k in req.keys if rng.random() < 0.5]
        manager.touch(touched, ctx)
        return ("touch", ctx.req_id, len(touched))
    if not req.misses and not req.loading and not req.storing:
        manager.on_request_finished(ctx)
        req.state = "done"
        return ("finished", ctx.req_id)
    if req.state == "store" and req.misses:
        req.misses = []  # the request stops storing (it was preempted, or its blocks were not computed)
        return ("skip", ctx.req_id)
    return ("wait", ctx.req_id)


def mooncake_requests(limit: int | None = None) -> Iterator[list[int]]:
    with MOONCAKE.open() as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                return
            yield json.loads(line)["hash_ids"]


def mooncake(
    manager: CPUOffloadingManager,
    requests: list[list[int]],
    *,
    positions: bool = True,
    evictions: list[Any] | None = None,
    on_request: Callable[[int], None] | None = None,
) -> tuple[int, int]:
    """Run the trace's requests one after another: (chunks hit, chunks asked). Each
    store's evicted keys go to ``evictions`` when given; ``on_request(n)`` is called
    before request n starts."""
    hit = asked = 0
    for n, hash_ids in enumerate(requests):
        if on_request is not None:
            on_request(n)
        ctx = ReqContext(req_id=f"m{n}")
        keys = [key(h) for h in hash_ids]
        if positions:
            for i, k in enumerate(keys):
                ctx.set_offload_key_position(k, (i + 1) * 512)
        manager.on_new_request(ctx)
        hits = []
        for k in keys:
            if manager.lookup(k, ctx) != LookupResult.HIT:
                break
            hits.append(k)
        if hits:
            manager.prepare_load(hits, ctx)
            manager.complete_load(hits, ctx)
        misses = keys[len(hits) :]
        if misses:
            out = manager.prepare_store(misses, ctx)
            if evictions is not None:
                evictions.append(None if out is None else list(out.evicted_keys))
            if out is not None and out.keys_to_store:
                manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        hit += len(hits)
        asked += len(keys)
    return hit, asked


def mooncake_at_trace_time(manager: CPUOffloadingManager, requests: list[tuple[int, list[int]]]) -> tuple[int, int]:
    """``mooncake`` on (arrival in ms, hash ids) requests with kvbroker's adapter reading
    the trace's time (each request at its arrival), as replay does: run back to back, the
    wall clock would put the whole trace in seconds, and policies that read event time
    would see another workload. vLLM's own policies read no clock."""
    from vllm_integration.decisions_to_vllm import policy_calls

    arrivals = [t for t, _ in requests]
    now = [0]
    real = policy_calls.time
    policy_calls.time = SimpleNamespace(time_ns=lambda: now[0], monotonic_ns=real.monotonic_ns)  # type: ignore[assignment]
    try:
        return mooncake(manager, [ids for _, ids in requests], on_request=lambda n: now.__setitem__(0, arrivals[n] * 1_000_000))
    finally:
        policy_calls.time = real


class TimedPolicy:
    """Wraps a manager's policy: the time spent in each call, less the clock's own cost
    (calibrated). ``clock``: ``time.thread_time_ns`` (the calling thread's CPU time: what
    the call costs vLLM's scheduler thread, whatever else the machine runs) or
    ``time.perf_counter_ns`` (wall time)."""

    def __init__(self, manager: CPUOffloadingManager, clock: Callable[[], int] = time.thread_time_ns) -> None:
        self.inner = manager._policy
        self.calls = 0
        self.ns = 0
        self.clock = clock
        self.overhead = _timer_overhead(clock)
        manager._policy = self  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)
        if not callable(method):
            return method

        clock = self.clock

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            out = method(*args, **kwargs)
            self.ns += clock() - t0 - self.overhead
            self.calls += 1
            return out

        return timed

    def us_per_call(self) -> float:
        return self.ns / self.calls / 1000 if self.calls else 0.0


def _timer_overhead(clock: Callable[[], int]) -> int:
    """What ``clock() - clock()`` reads with nothing between (the least of many tries)."""
    best = 1 << 62
    for _ in range(20_000):
        a = clock()
        best = min(best, clock() - a)
    return best
