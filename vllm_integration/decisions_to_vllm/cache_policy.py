"""``KvbrokerCachePolicy``: kvbroker's policies deciding vLLM's CPU-offload evictions.

vLLM (0.33) loads it by the name kvbroker's vLLM plugin registers (plugin.py), no patch::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000, "eviction_policy": "kvbroker",
        "kvbroker_policy": "lru", "kvbroker_journal": "file:///var/lib/kvbroker/vllm-{pid}.journal"}}'

or by module path (``"eviction_policy": "KvbrokerCachePolicy", "cache_policy_module_path":
"vllm_integration.decisions_to_vllm.cache_policy"``).

vLLM builds a CachePolicy with the chunk count alone (``policy_cls(cache_capacity=n)``,
vllm/v1/kv_offload/cpu/manager.py). The ``kvbroker_*`` keys are read from the
kv_connector_extra_config of the offloading spec that is building the manager (found on the
call stack: the spec's ``get_manager`` builds the manager, which builds the policy), else
from vLLM's current config, else from ``KVBROKER_VLLM_*`` environment variables
(vllm_integration/decisions_to_vllm/settings.py). A bad setting stops vLLM's start with a message naming it.

Every call becomes MemoryIntent events (vllm_integration/decisions_to_vllm/policy_calls.py) applied to kvbroker's
deterministic core, embedded here with one tier of ``cache_capacity`` chunks, and
journaled when ``kvbroker_journal`` names a journal: ``kvbroker replay --journal URL
--verify`` then reproduces vLLM's evictions, and ``kvbroker replay --policy ...`` tries
another policy on the same traffic.

``kvbroker_settings_file`` switches the policy while vLLM runs (vllm_integration/decisions_to_vllm/reload.py):
validated in full on a thread of its own, applied on vLLM's between two calls, journaled as
the next config generation.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from types import FrameType
from typing import Any

from typing_extensions import override
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus

from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore, close_at_exit
from vllm_integration.decisions_to_vllm.policy_calls import Decider, RequestIntent, Translator
from vllm_integration.decisions_to_vllm.reload import Listener, LiveSettings, settings_at_start
from vllm_integration.decisions_to_vllm.report import Reporter
from vllm_integration.decisions_to_vllm.settings import OffloadSettings, SettingsError
from vllm_integration.decisions_to_vllm.shadows import ShadowSet, describe_shadows

# Under vLLM's logger, so that vLLM's logging configuration shows it.
log = logging.getLogger("vllm.kvbroker")

# How far up the stack the offloading spec is looked for (policy <- manager <- spec).
_STACK_DEPTH = 12


def vllm_context() -> tuple[Mapping[str, Any], int]:
    """The kv_connector_extra_config vLLM is building this policy for ({} if none is
    found), and the engine's data-parallel index (0 if unknown)."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        extra = getattr(owner, "extra_config", None) if owner is not None else None
        if isinstance(extra, Mapping):
            parallel = getattr(getattr(owner, "config", None), "parallel", None)
            rank = getattr(parallel, "data_parallel_index", 0)
            return extra, rank if isinstance(rank, int) else 0
        frame = frame.f_back
    try:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
    except ImportError:
        config = None
    transfer = getattr(config, "kv_transfer_config", None) if config is not None else None
    extra = getattr(transfer, "kv_connector_extra_config", None)
    return (extra if isinstance(extra, Mapping) else {}), 0


def make_decider(settings: OffloadSettings, local: EmbeddedCore, translator: Translator) -> Decider | None:
    """The decider of ``settings.mode``: None for embedded (the translator's local one)."""
    if settings.mode == "embedded":
        return None
    try:
        from vllm_integration.decisions_to_vllm import sidecar  # imported only here: it brings gRPC in
    except ImportError as exc:
        raise SettingsError(f"kvbroker_mode: sidecar mode is not available in this build ({exc})") from None
    decider: Decider = sidecar.make_decider(settings, local, translator)
    return decider


class KvbrokerCachePolicy(CachePolicy):
    """vLLM's CachePolicy, decided by a kvbroker policy (``kvbroker_policy``, default lru)."""

    def __init__(self, cache_capacity: int, extra_config: Mapping[str, Any] | None = None) -> None:
        super().__init__(cache_capacity)
        found, rank = vllm_context()
        extra = extra_config if extra_config is not None else found
        # The startup settings, with kvbroker_settings_file's keys on top when it names one.
        settings, seen = settings_at_start(extra, rank=rank)
        # Sidecar mode: the embedded core is the broker's local fallback (and mirror).
        fallback = settings.fallback_policy if settings.mode == "sidecar" else ""
        self.local = EmbeddedCore(settings, cache_capacity, policy=fallback or None)
        self.translator = translator = Translator(self.local, tenant=settings.tenant)
        decider = make_decider(settings, self.local, translator)
        if decider is not None:
            translator.decider = decider
        # The settings in force, switched live when the settings file changes; listeners
        # (old, new) run after each switch, on vLLM's thread (shadows follow there).
        self.live = LiveSettings(settings, extra, local=self.local, translator=translator, capacity=cache_capacity, seen=seen)
        self.on_reload: list[Listener] = self.live.on_reload
        # vLLM calls these once per chunk: bound straight to the translator (an instance
        # attribute wins over the class's method), one Python call instead of two.
        self.get = translator.get  # type: ignore[method-assign]
        self.insert = translator.insert  # type: ignore[method-assign]
        self.touch = translator.touch  # type: ignore[method-assign]
        self.mark_evictable = translator.mark_evictable  # type: ignore[method-assign]
        self.mark_non_evictable = translator.mark_non_evictable  # type: ignore[method-assign]
        self.evict = translator.evict  # type: ignore[method-assign]
        # The decider's figure, the shadows and the what-if sizes (vllm_integration/decisions_to_vllm/shadows.py),
        # which snapshot() reports.
        self.shadows = ShadowSet(self.settings, cache_capacity)
        self.shadow_errors = 0
        # A live switch rebuilds the shadows and sizes it changes (kept ones keep counting).
        self.on_reload.append(lambda old, new: self.shadows.configure(new))
        try:
            self.reporter = Reporter(self.snapshot, self.settings)
        except BaseException:
            self.local.close()  # vLLM's start stops here: the journal it opened is closed
            raise
        # At exit, what is buffered goes to the core and the journal (this runs before the
        # journal thread's own close, registered earlier; in vLLM's forked engine core too).
        close_at_exit(self.close)
        log.info(
            "kvbroker CachePolicy: policy %s (%s), %d chunks, journal %s%s%s",
            settings.policy,
            settings.mode,
            cache_capacity,
            settings.resolved_journal(),
            f", settings file {self.live.path} (watched every {settings.settings_poll_s:g} s)" if self.live.path else "",
            describe_shadows(self.shadows),
        )
        self.live.start()

    @property
    def settings(self) -> OffloadSettings:
        """The settings in force (a live switch replaces them)."""
        return self.live.settings

    @override
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        chunk: ChunkStatus | None = self.translator.get(key)
        return chunk

    @override
    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self.translator.insert(key, chunk, req_context)

    @override
    def remove(self, key: OffloadKey) -> None:
        self.translator.remove(key)

    @override
    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self.translator.touch(keys, req_context)

    @override
    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # The missed keys are not resident: nothing to tell (their allocation follows).
        return

    @override
    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self.translator.on_request_access(keys, req_context)

    @override
    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        translator = self.translator
        order, positions = translator.on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context)
        try:
            self.shadows.request(order, reused_keys, req_context, req_context.get_state(RequestIntent), translator._ts_ms, positions)
        except Exception:
            # A shadow decides nothing: its failure must not reach vLLM. It is counted and
            # logged (the first few), and the figures go on without that request.
            self.shadow_errors += 1
            if self.shadow_errors <= 3:
                log.exception("kvbroker: a shadow failed on a request (error %d)", self.shadow_errors)

    @override
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        victims: list[tuple[OffloadKey, ChunkStatus]] | None = self.translator.evict(n, protected)
        return victims

    @override
    def clear(self) -> None:
        self.translator.clear()
        self.shadows.clear()

    @override
    def mark_evictable(self, key: OffloadKey) -> None:
        self.translator.mark_evictable(key)

    @override
    def mark_non_evictable(self, key: OffloadKey) -> None:
        self.translator.mark_non_evictable(key)

    def snapshot(self) -> dict[str, Any]:
        """What the policy reports (report: log lines, metrics, status file): the
        decider's hits and those of its shadows and what-if sizes. Cheap, and safe to call
        from another thread (it reads counters)."""
        return {
            "client_id": self.local.client_id,
            "pid": os.getpid(),
            "time": time.time(),
            "policy": self.settings.policy,
            "capacity": self.cache_capacity,
            "rows": self.shadows.rows(),
            "counters": self.translator.counters(),
        }

    def flush(self) -> None:
        """Apply what is buffered and wait until the journal holds it (tests, shutdown)."""
        self.translator.flush()

    def close(self) -> None:
        """Apply what is buffered, write the journal, stop its thread (idempotent); in
        sidecar mode also forward what is held back and close the link to the broker.
        Then the last report line and status file."""
        self.live.close()
        self.translator.apply()
        close_decider = getattr(self.translator.decider, "close", None)
        if close_decider is not None:
            close_decider()
        self.local.close()
        self.reporter.close()
