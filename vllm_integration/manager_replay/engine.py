"""Replay a Mooncake trace as vLLM's CPU offload tier runs it: the figure vLLM realizes.

A replay of prompt blocks (``--no-decode``) counts every block a later prompt finds still
resident. vLLM 0.33's ``CPUOffloadingManager`` realizes less: its scheduler looks a
request's chunks up in order and stops at the first miss (a prefix lookup), loads the hits,
and stores the rest, evicting through its CachePolicy; a chunk found resident after the
first miss is not a hit, only a reuse at the request's finish. What the policy is told
follows from that, so the same policy sees other events, and decides otherwise.

``replay_requests`` runs the requests one after another through that protocol (the calls
``tests/vllm_integration/decisions_to_vllm/manager_driver.py: mooncake`` makes on vLLM's real manager, in the
same order, with the same chunk bookkeeping) into the adapter kvbroker puts inside vLLM
(``vllm_integration.decisions_to_vllm.policy_calls.Translator`` on an embedded core, no journal). So the policy
sees exactly the events it sees inside vLLM, with the same history bound, and the hit count
is vLLM's: chunks hit by the prefix lookups over chunks asked. The vllm-marked tests hold
the two figures together on the same trace (tests/vllm_integration/decisions_to_vllm/test_replay_predicts_vllm.py).

Event time is the trace's (each request at its arrival), where inside vLLM it is the wall
clock: only a policy that reads event time can tell.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import Any

from broker.config import CoreConfig
from broker.replay.replay import ReplayResult
from broker.replay.traces import SkipCounter, TraceError
from broker.replay.traces.mooncake import read_requests
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.manager_model import EmulatedManager, TraceTimeTranslator
from vllm_integration.decisions_to_vllm.settings import TIER, OffloadSettings

ENGINES = ("vllm",)


def is_vllm_cpu_tier(config: CoreConfig) -> bool:
    """Whether a journal's config is the one kvbroker's CachePolicy runs inside vLLM
    (``OffloadSettings.core_config``): one tier named as its CPU tier, of one-byte chunks,
    full before it evicts (vLLM makes room itself)."""
    (tier, *more) = config.tiers
    return not more and tier.name == TIER and tier.high_watermark == tier.low_watermark == 1.0


def chunk_key(hash_id: str | int) -> bytes:
    """The OffloadKey of a Mooncake hash id (``h123`` or 123) in KV cache group 0, as the
    manager driver makes it (8 bytes of hash, 4 of group index)."""
    n = int(hash_id[1:]) if isinstance(hash_id, str) else hash_id
    return n.to_bytes(8, "big") + b"\0\0\0\0"


class _Request:
    """The ReqContext the adapter reads: the request id, per-type state, token positions."""

    __slots__ = ("_positions", "_state", "kv_hints", "req_id")

    def __init__(self, req_id: str, positions: dict[bytes, int]) -> None:
        self.req_id = req_id
        self.kv_hints = None
        self._state: dict[type, Any] = {}
        self._positions = positions

    def get_state(self, cls: type) -> Any:
        return self._state.get(cls)

    def set_state(self, value: Any) -> None:
        self._state[type(value)] = value

    def get_offload_key_position(self, key: bytes) -> int | None:
        return self._positions.get(key)


@dataclasses.dataclass
class EngineResult:
    """What vLLM's manager would report: chunks hit by prefix lookups, chunks asked."""

    hits: int
    asked: int
    stores: int
    stores_refused: int
    evictions: int
    seconds: float
    core: Any

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.asked if self.asked else 0.0


def replay_requests(
    requests: Iterable[tuple[int, Sequence[str | int]]],
    num_chunks: int,
    policy: str,
    params: dict[str, Any] | None = None,
    *,
    history_ghosts: float | None = None,
    block_tokens: int = 512,
) -> EngineResult:
    """Run (arrival in ms, hash ids) requests, in order, through the emulated manager with
    kvbroker's ``policy`` deciding at ``num_chunks`` chunks; vLLM's hit count."""
    settings = OffloadSettings(policy=policy, policy_params=dict(params or {}))
    if history_ghosts is not None:
        settings = dataclasses.replace(settings, history_ghosts=history_ghosts)
    local = EmbeddedCore(settings, num_chunks, journal=False)
    translator = TraceTimeTranslator(local)
    manager = EmulatedManager(translator, num_chunks)
    hits = asked = 0
    started = time.perf_counter()
    for n, (arrival_ms, hash_ids) in enumerate(requests):
        keys = [chunk_key(h) for h in hash_ids]
        translator.now_ms = arrival_ms
        req = _Request(f"m{n}", {k: (i + 1) * block_tokens for i, k in enumerate(keys)})
        hits += manager.run(keys, req)
        asked += len(keys)
    translator.apply()
    return EngineResult(
        hits=hits,
        asked=asked,
        stores=manager.stores,
        stores_refused=manager.stores_refused,
        evictions=manager.evictions,
        seconds=time.perf_counter() - started,
        core=local.core,
    )


def replay_engine(source: Any, config: CoreConfig, policy: str, params: dict[str, Any] | None) -> tuple[ReplayResult, int]:
    """A replay job with ``--engine vllm`` (``source``: broker.replay.sweep's Source, which
    imports this module): the Mooncake trace's requests through the
    emulated manager, the top tier's capacity in chunks (bytes over one chunk's bytes);
    the record of a replay (``prefix_hits``, ``prompt_blocks`` and ``prefix_hit_rate`` are
    vLLM's: chunks hit by prefix lookups, chunks asked) and the bad lines skipped."""
    if source.trace is None or source.fmt != "mooncake":
        raise TraceError(str(source.trace), 0, "--engine", "vllm replays a Mooncake trace (--format mooncake)")
    skips = SkipCounter(source.options.skip_bad)
    requests = read_requests(source.trace, skips)
    block_tokens = 512  # Mooncake's hash ids name 512-token blocks
    chunk_bytes = block_tokens * source.options.bytes_per_token
    chunks = max(1, config.tiers[0].capacity_bytes // chunk_bytes)
    flat = ((r.arrival_us // 1000, [int(h[1:]) for h in r.hash_ids]) for r in requests)
    result = replay_requests(flat, chunks, policy, params, history_ghosts=config.history_ghosts, block_tokens=block_tokens)
    core = result.core
    metrics = core.stats.as_dict([t.name for t in core.tiers])
    metrics["prompt_blocks"] = result.asked
    metrics["prefix_hits"] = result.hits
    metrics["prefix_hit_rate"] = result.hit_ratio
    metrics["evictions"] = result.evictions
    return ReplayResult.of_engine(core, result.seconds, metrics), skips.skipped
