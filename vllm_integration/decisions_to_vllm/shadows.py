"""Shadow policies and what-if sizes inside vLLM: what every other policy, and the deciding
policy at other CPU-tier sizes, would have hit on the same requests.

vLLM's manager calls the CachePolicy with the decider's view of the cache: a chunk the
decider keeps is looked up and loaded, a chunk it dropped is stored again. Another policy
would have kept other chunks, so the calls themselves would differ; a shadow cannot follow
the decider's calls. It follows the requests instead. At a request's finish vLLM hands the
policy every chunk the request used (``key_groups``, head to tail by token position); a
shadow runs that request through its own copy of the manager's protocol
(vllm_integration.decisions_to_vllm.manager_model.EmulatedManager: prefix lookup, load the hits, store the misses
with evictions, finish) on its own embedded core of policy P, with no journal. For a stream
of requests that run one after another this is exactly what P realizes as the decider
(tests/vllm_integration/decisions_to_vllm/test_shadows_vllm.py holds the two equal against vLLM's real
manager); with requests in flight together it is P's figure for the same requests taken
in finishing order.

**The decider's own figure** is counted from the same call: a request's hits are the
chunks, from its head, that it loaded (vLLM's ``reused_keys``) before the first it did not,
over the chunks it used.

**What-if sizes** are the decider's policy at other capacities (multiples of the tier).
They are sampled by key, in the manner of SHARDS (Waldspurger et al., FAST 2015;
"miniature simulation", USENIX ATC 2017): a key is in the sample when a hash of it falls
below ``rate`` of the hash space, and a sampled size runs only the sampled chunks of each
request in a cache of ``rate`` times the size. The sample is spatial (by key, not by
call), so a sampled chunk is sampled at every use and its reuse distances scale by the
rate. The sampled hit ratio estimates the full one; the counts reported are scaled back by
1/rate. One hash per chunk serves every sampled size. The rate and its measured error are
in docs/vllm.md ("What-if sizes").
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.manager_model import EmulatedManager, TraceTimeTranslator
from vllm_integration.decisions_to_vllm.policy_calls import RequestIntent
from vllm_integration.decisions_to_vllm.settings import OffloadSettings

# The hash space of the spatial sample (SHARDS' P): a 32-bit hash, so a rate's grain is
# far below any rate worth running.
SAMPLE_SPACE: Final = 1 << 32
# The fewest chunks a sampled what-if cache holds: a smaller size is sampled at a higher
# rate (SHARDS' error grows as the miniature cache shrinks).
MIN_SAMPLED_CHUNKS: Final = 128


def key_hash(key: bytes) -> int:
    """The 32-bit hash a key is sampled by: CRC-32 of its bytes (zlib's, in C: one call per
    chunk, shared by every sampled size). vLLM's keys are block hashes already; a trace's
    keys may be counters, which CRC-32 spreads over its range as well."""
    return zlib.crc32(key)


def sampled(key: bytes, threshold: int) -> bool:
    """Whether ``key`` is in a spatial sample whose rate is ``threshold / SAMPLE_SPACE``."""
    return zlib.crc32(key) < threshold


class _Positions:
    """A request as the emulated manager reads it: its id and the token positions the
    decider's translator already read (``positions``; None: some key has none, and then
    the real request answers); its intent is the one the decider's translator parsed."""

    __slots__ = ("get_offload_key_position", "kv_hints", "req_id")

    def __init__(self, real: Any, positions: dict[Any, int] | None) -> None:
        self.req_id = getattr(real, "req_id", "")
        self.kv_hints = None
        lookup: Callable[[Any], int | None] | None = positions.get if positions is not None else None
        self.get_offload_key_position = lookup or getattr(real, "get_offload_key_position", None) or _no_position

    def get_state(self, cls: type) -> Any:
        return None

    def set_state(self, value: Any) -> None:
        return


def _no_position(key: Any) -> None:
    return None


class _ShadowTranslator(TraceTimeTranslator):
    """The adapter of a shadow: event time is the decider's (set per request), and a
    request's intent is the decider's, handed over per request (no second parse)."""

    intent: RequestIntent | None = None

    def request_intent(self, req_context: Any) -> RequestIntent:
        intent = self.intent
        if intent is None:
            return super().request_intent(req_context)
        return intent


class _Ready:
    """A stored chunk, written at once (a shadow's stores complete in the same call)."""

    __slots__ = ("ref_cnt",)

    def __init__(self) -> None:
        self.ref_cnt = 0


class _LeanManager(EmulatedManager):
    """The emulated manager, less the calls that change nothing a policy sees: a shadow's
    loads and stores complete within the request, so marking a chunk non-evictable and
    evictable again, or storing it pending and completing it, leave the translator as they
    found it and send no event. The events, and so every decision, are the emulated
    manager's (the shadow tests hold them equal to vLLM's real manager)."""

    def run(self, keys: Sequence[bytes], req: Any) -> int:
        get = self.policy.get
        n = 0
        for key in keys:
            if get(key) is None:
                break
            n += 1
        seen: dict[bytes, None] = {}
        inserted: set[bytes] = set()
        hits = keys[:n]
        reused: set[bytes] = set(hits)
        if hits:
            self._record(hits, req, seen)
        if n < len(keys):
            self._store_ready(list(keys[n:]), req, seen, inserted, reused)
        keys_used = list(seen)  # head to tail already: hits, then the rest in order
        self.policy.on_request_finished((tuple(keys_used),) if keys_used else (), inserted - reused, reused, req)
        return n

    def _store_ready(self, keys: list[bytes], req: Any, seen: dict[bytes, None], inserted: set[bytes], reused: set[bytes]) -> None:
        policy = self.policy
        get = policy.get
        to_store = [key for key in keys if get(key) is None]
        self._record(keys, req, seen)
        if len(to_store) < len(keys):
            stored = set(to_store)
            reused.update(key for key in keys if key not in stored)
        if not to_store or not self._make_room(len(to_store), keys):
            return
        self.evictable += len(to_store)
        insert = policy.insert
        for key in to_store:
            insert(key, _Ready(), req)
        inserted.update(to_store)
        self.stores += 1


@dataclasses.dataclass
class Figure:
    """One row of what the policy reports: ``role`` decider, shadow or whatif."""

    role: str
    policy: str
    capacity: int
    hits: int = 0
    asked: int = 0
    sample_rate: float = 1.0

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.asked if self.asked else 0.0

    def row(self) -> dict[str, Any]:
        rate = self.sample_rate
        return {
            "role": self.role,
            "policy": self.policy,
            "capacity": self.capacity,
            # A sampled figure's counts are its sample's, scaled back to the whole stream.
            "hits": self.hits if rate >= 1.0 else round(self.hits / rate),
            "asked": self.asked if rate >= 1.0 else round(self.asked / rate),
            "hit_ratio": self.hit_ratio,
            "sample_rate": rate,
        }


class Shadow:
    """Policy ``policy`` at ``capacity`` chunks (``rate`` of them when sampled), on its own
    emulated manager and embedded core; it decides nothing."""

    def __init__(self, settings: OffloadSettings, figure: Figure, policy_params: dict[str, Any]) -> None:
        self.figure = figure
        self.params = dict(policy_params)
        chunks = figure.capacity if figure.sample_rate >= 1.0 else max(1, round(figure.capacity * figure.sample_rate))
        self.chunks = chunks
        own = dataclasses.replace(settings, policy=figure.policy, policy_params=self.params, journal="none")
        self.local = EmbeddedCore(own, chunks, journal=False)
        self.translator = _ShadowTranslator(self.local, tenant=settings.tenant)
        self.manager = _LeanManager(self.translator, chunks)

    def request(self, keys: Sequence[Any], req: _Positions, intent: RequestIntent | None, now_ms: int) -> None:
        translator = self.translator
        translator.now_ms = now_ms
        translator.intent = intent
        hits = self.manager.run(keys, req)
        figure = self.figure
        figure.hits += hits
        figure.asked += len(keys)

    def clear(self) -> None:
        """vLLM reset its cache: so does the shadow's (it is a cache of the same tier)."""
        self.translator.clear()
        self.translator.apply()
        self.manager.used = self.manager.evictable = 0


class ShadowSet:
    """The decider's figure, its shadows and its what-if sizes, fed a request at a time."""

    def __init__(self, settings: OffloadSettings, capacity: int) -> None:
        self.capacity = capacity
        self.decider = Figure("decider", settings.policy, capacity)
        self.full: list[Shadow] = []
        self.sampled: list[Shadow] = []
        self.thresholds: list[int] = []
        self.configure(settings)

    def configure(self, settings: OffloadSettings) -> None:
        """(Re)build the shadows and what-if sizes of ``settings``; a shadow or size that is
        kept (same policy, parameters, capacity and rate) keeps its state and counts."""
        old = {_identity(s.figure, s.params): s for s in [*self.full, *self.sampled]}
        if self.decider.policy != settings.policy:
            self.decider = Figure("decider", settings.policy, self.capacity)
        full: list[Shadow] = []
        for name in settings.shadows:
            figure = Figure("shadow", name, self.capacity)
            full.append(self._reuse(old, figure, {}, settings))
        rate = settings.whatif_sample
        sized: list[Shadow] = []
        for multiple in settings.whatif:
            capacity = max(1, round(self.capacity * multiple))
            # A size whose sample would hold fewer than MIN_SAMPLED_CHUNKS is sampled at the
            # rate that gives it that many (whole, when that is every key): a miniature cache
            # of a few dozen chunks misestimates, and a small size is cheap to sample more.
            chunks_rate = min(1.0, max(rate, MIN_SAMPLED_CHUNKS / capacity))
            figure = Figure("whatif", settings.policy, capacity, sample_rate=chunks_rate)
            sized.append(self._reuse(old, figure, settings.policy_params, settings))
        self.full = full
        self.sampled = [s for s in sized if s.figure.sample_rate < 1.0]
        self.full += [s for s in sized if s.figure.sample_rate >= 1.0]
        # Each sampled size's threshold; the samples nest (a key in a lower rate's sample is
        # in every higher one's), and one hash per key serves them all.
        self.thresholds = [round(s.figure.sample_rate * SAMPLE_SPACE) for s in self.sampled]

    def _reuse(self, old: dict[tuple[Any, ...], Shadow], figure: Figure, params: dict[str, Any], settings: OffloadSettings) -> Shadow:
        kept = old.get(_identity(figure, params))
        return kept if kept is not None else Shadow(settings, figure, params)

    @property
    def active(self) -> bool:
        return bool(self.full or self.sampled)

    def request(
        self,
        keys: list[Any],
        reused_keys: Iterable[Any],
        req_context: Any,
        intent: RequestIntent | None,
        now_ms: int,
        positions: dict[Any, int] | None = None,
    ) -> None:
        """A request finished, having used ``keys`` (head to tail, at ``positions`` when the
        caller read them) and loaded ``reused_keys``."""
        reused = reused_keys if isinstance(reused_keys, (set, frozenset)) else set(reused_keys)
        hits = 0
        for key in keys:
            if key not in reused:
                break
            hits += 1
        decider = self.decider
        decider.hits += hits
        decider.asked += len(keys)
        if not keys or not self.active:
            return
        req = _Positions(req_context, positions)
        for shadow in self.full:
            shadow.request(keys, req, intent, now_ms)
        if self.sampled:
            crc = zlib.crc32
            top = max(self.thresholds)
            hashed = [(h, key) for key in keys if (h := crc(key)) < top]
            for shadow, threshold in zip(self.sampled, self.thresholds, strict=True):
                part = [key for h, key in hashed if h < threshold] if threshold < top else [key for _, key in hashed]
                if part:
                    shadow.request(part, req, intent, now_ms)

    def clear(self) -> None:
        for shadow in [*self.full, *self.sampled]:
            shadow.clear()

    def figures(self) -> list[Figure]:
        return [self.decider, *(s.figure for s in self.full), *(s.figure for s in self.sampled)]

    def rows(self) -> list[dict[str, Any]]:
        return [f.row() for f in self.figures()]


def _identity(figure: Figure, params: dict[str, Any]) -> tuple[Any, ...]:
    """What makes a shadow the same one across a reconfiguration (it keeps its state)."""
    return (figure.role, figure.policy, figure.capacity, figure.sample_rate, repr(sorted(params.items())))


def describe_shadows(shadows: ShadowSet) -> str:
    """The shadows and what-if sizes for the start's log line ("" when none)."""
    figures = shadows.figures()[1:]
    if not figures:
        return ""
    parts = []
    for f in figures:
        rate = f" sampled {f.sample_rate:g}" if f.sample_rate < 1.0 else ""
        parts.append(f"{f.role} {f.policy}@{f.capacity}{rate}")
    return "; " + ", ".join(parts)
