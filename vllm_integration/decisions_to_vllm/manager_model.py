"""A model of the part of vLLM 0.33's ``CPUOffloadingManager`` (vllm/v1/kv_offload/cpu/manager.py)
that a stream of requests run one after another exercises: prefix lookups, loads, stores
with evictions through the CachePolicy, finishes. It drives kvbroker's adapter
(vllm_integration.decisions_to_vllm.policy_calls.Translator) with the calls the real manager makes, in the same
order, with the same chunk bookkeeping.

Two rooms use it: ``kvbroker replay --engine vllm`` (vllm_integration/manager_replay/engine.py: what a
policy realizes inside vLLM, predicted from a trace) and the shadows inside vLLM
(vllm_integration/decisions_to_vllm/shadows.py: what another policy, or another size, would have hit). The
vllm-marked tests hold its figures equal to the real manager's
(tests/vllm_integration/decisions_to_vllm/test_replay_predicts_vllm.py, test_shadows_vllm.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm_integration.decisions_to_vllm import intent_bytes
from vllm_integration.decisions_to_vllm.policy_calls import Translator


class TraceTimeTranslator(Translator):
    """The adapter with event time set by its driver (``now_ms``: a trace's arrival, or the
    decider's time for a shadow), not the wall clock: no report, no flush by age, no
    settings reload."""

    now_ms = 0

    def timestamp(self) -> bytes:
        ms = self.now_ms
        if ms != self._ts_ms:
            self._ts_ms = ms
            self._ts = intent_bytes.timestamp(ms * 1000)
        return self._ts


class _Chunk:
    """vLLM's ChunkStatus: ``ref_cnt`` -1 while being written, then the readers' count."""

    __slots__ = ("ref_cnt",)

    def __init__(self) -> None:
        self.ref_cnt = -1


class EmulatedManager:
    """The part of vLLM 0.33's CPUOffloadingManager a sequential request stream exercises,
    driving a CachePolicy (the adapter): lookups, loads, stores with evictions, finishes.
    Loads and stores complete at once (one request at a time), so every chunk is ready."""

    def __init__(self, policy: Translator, num_chunks: int) -> None:
        self.policy = policy
        self.num_chunks = num_chunks
        self.used = 0
        self.evictable = 0
        self.stores = 0
        self.stores_refused = 0
        self.evictions = 0

    def run(self, keys: Sequence[bytes], req: Any) -> int:
        """One request: its prefix hits loaded, its misses stored, finished; the hits."""
        policy = self.policy
        get = policy.get
        hits: list[bytes] = []
        for key in keys:
            if get(key) is None:
                break
            hits.append(key)
        seen: dict[bytes, None] = {}
        inserted: set[bytes] = set()
        reused: set[bytes] = set()
        if hits:
            # prepare_load: each chunk read (ref_cnt 0 -> 1, non-evictable), recorded as a
            # request access (the new keys), then complete_load (back to evictable).
            for key in hits:
                policy.mark_non_evictable(key)
            self._record(hits, req, seen)
            reused.update(hits)
            for key in hits:
                policy.mark_evictable(key)
        misses = keys[len(hits) :]
        if misses:
            self._store(list(misses), req, seen, inserted, reused)
        self._finish(seen, inserted, reused, req)
        return len(hits)

    def _record(self, keys: Iterable[bytes], req: Any, seen: dict[bytes, None]) -> None:
        new = [key for key in keys if key not in seen]
        for key in new:
            seen[key] = None
        if new:
            self.policy.on_request_access(new, req)

    def _store(self, keys: list[bytes], req: Any, seen: dict[bytes, None], inserted: set[bytes], reused: set[bytes]) -> None:
        policy = self.policy
        # Every chunk is ready here, so each key is either stored now or a resident reuse,
        # and the manager records the request's access of all of them.
        to_store: list[bytes] = []
        existing: list[bytes] = []
        for key in keys:
            (to_store if policy.get(key) is None else existing).append(key)
        self._record(keys, req, seen)
        reused.update(key for key in existing if key not in inserted)
        if not to_store or not self._make_room(len(to_store), keys):
            return
        for key in to_store:
            policy.insert(key, _Chunk(), req)
        inserted.update(to_store)
        self.stores += 1
        # complete_store: written, evictable.
        for key in to_store:
            chunk = policy.get(key)
            if chunk is not None and chunk.ref_cnt < 0:
                chunk.ref_cnt = 0
                self.evictable += 1
                policy.mark_evictable(key)

    def _make_room(self, count: int, keys: list[bytes]) -> bool:
        """prepare_store's allocation of ``count`` chunks for a store of ``keys`` (none of
        them evictable): the evictions it asks the policy for; False when the store is
        refused (too few evictable chunks, or the policy declined)."""
        need = count - (self.num_chunks - self.used)
        if need > 0:
            if need > self.evictable:
                self.stores_refused += 1
                return False
            evicted = self.policy.evict(need, set(keys))
            if evicted is None:
                self.stores_refused += 1
                return False
            self.evictable -= len(evicted)
            self.used -= len(evicted)
            self.evictions += len(evicted)
        self.used += count
        return True

    def _finish(self, seen: dict[bytes, None], inserted: set[bytes], reused: set[bytes], req: Any) -> None:
        keys = list(seen)
        positions = {key: at for key in keys if (at := req.get_offload_key_position(key)) is not None}
        if len(positions) == len(keys):
            keys.sort(key=positions.__getitem__)
        self.policy.on_request_finished((tuple(keys),) if keys else (), inserted - reused, reused, req)
