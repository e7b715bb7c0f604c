"""Sidecar mode: a running `kvbroker serve` chooses vLLM's victims, under a hard bound.

vLLM's scheduler calls the CachePolicy synchronously; the broker is another process. So:

- The translator's batches (every CachePolicy call, as events, applied to the embedded
  core) also go to the broker, without waiting: ``forward`` hands each batch's bytes to the
  link (BrokerLink: batched, ordered, resent after a reconnect), whose thread rewrites them
  into the broker's names. The embedded core, running the fallback policy, is the mirror:
  it holds the same chunks as vLLM.
- ``evict(n, protected)`` sends an EvictionRequested and waits for its answer at most
  ``deadline_s``. In time and valid (n distinct EVICT victims vLLM holds, evictable, none
  protected): those are the victims, acked DONE. Otherwise the embedded core decides (the
  fallback), as in embedded mode. Either way the translator then frees the victims: in the
  mirror and, forwarded, in the broker. Broker known down: no wait at all. A broker that
  keeps timing out is not asked for ``cooldown_s`` (a circuit breaker), so a hung broker
  costs one bound now and then, not one per call.

Keeping the broker's view what vLLM really holds:

- a late answer (the broker chose B, vLLM went with the fallback's F and freed F): each
  victim in B vLLM still holds is acked FAILED with ``actual_tier`` = its tier (the broker
  puts it back), the others DONE. An EvictionRequested that waited out an outage in the
  client's resend buffer and was applied on reconnect is settled the same way.
- any other directive (the broker's own watermark evictions, demotions, prefetches, which
  vLLM's manager cannot carry out) is acked FAILED with where the block really is.
- what a resend cannot repair (an answer lost with a broken stream, a batch dropped by the
  bounds of a long outage, a broker that lost its journal): the tier is restated,
  AllBlocksCleared then every chunk vLLM holds, oldest stored first.

That work runs on the scheduler thread at the start of the next evict (the directives wait
in a deque the link fills), so vLLM's state needs no lock.

Names at the broker: one broker serves every data-parallel rank, and block ids are global
there, so a chunk's id is ``<client_id>/<OffloadKey hex>`` and its tier ``broker_tier``
(one tier per rank in the broker's config: EvictionRequested chooses within a tier).
"""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from clients.broker_client import ClientSecurity, acked_event
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb
from vllm_integration.decisions_to_vllm import intent_bytes
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.latency import LatencyHistogram
from vllm_integration.decisions_to_vllm.link import DOWN, FAILED, LOST, TIMEOUT, BrokerLink, Unanswered
from vllm_integration.decisions_to_vllm.policy_calls import Translator
from vllm_integration.decisions_to_vllm.settings import OffloadSettings, SettingsError
from vllm_integration.decisions_to_vllm.sidecar_setup import check_tier

log = logging.getLogger("vllm.kvbroker.sidecar")

# Why the fallback decided (counters "fallback_<reason>").
REFUSED = "refused"  # the broker could not choose n victims (its view differs)
INVALID = "invalid"  # the answer named victims vLLM cannot evict
COOLDOWN = "cooldown"  # the broker timed out repeatedly: not asked for a while
REASONS = (DOWN, TIMEOUT, LOST, FAILED, REFUSED, INVALID, COOLDOWN)

_EVICT = dpb.DIRECTIVE_KIND_EVICT
# Calls batched by the translator before they are applied and forwarded (embedded: 4096).
FORWARD_EVENTS = 64
# The reason the core gives the victims of an EvictionRequested (Core.evict_chosen).
_REQUESTED = "eviction requested"


def wall_us() -> int:
    """Event time as the translator stamps it: the wall clock, whole milliseconds."""
    return time.time_ns() // 1_000_000 * 1000


class Names:
    """Local block ids (OffloadKey hex) <-> the broker's (``<prefix><id>``), and the tier."""

    def __init__(self, prefix: str, tier: str) -> None:
        self.prefix = prefix
        self.tier = tier
        self._cut = len(prefix)

    def remote(self, block_id: str) -> str:
        return self.prefix + block_id

    def local(self, block_id: str) -> str | None:
        return block_id[self._cut :] if block_id.startswith(self.prefix) else None

    def rewrite(self, raw: bytes) -> list[pb.Event]:
        """A batch the embedded core applied, as the broker must see it: the local
        ``eviction_requested`` of a fallback left out (the broker learns the victims from
        the ``freed`` that follows), ids prefixed, allocations in the rank's tier."""
        out: list[pb.Event] = []
        prefix = self.prefix
        for event in pb.IntentBatch.FromString(raw).events:
            kind = event.WhichOneof("kind")
            if kind == "allocated":
                intent = event.allocated.intent
                intent.block_id = prefix + intent.block_id
                if self.tier:
                    event.allocated.tier = self.tier
                    intent.allowed_tiers.append(self.tier)
            elif kind == "accessed":
                ids = event.accessed.block_ids
                ids[:] = [prefix + b for b in ids]
            elif kind == "freed":
                ids = event.freed.block_ids
                ids[:] = [prefix + b for b in ids]
            elif kind == "intent_updated":
                event.intent_updated.block_id = prefix + event.intent_updated.block_id
            elif kind == "eviction_requested":
                continue
            out.append(event)
        return out

    def allocations(self, block_ids: Sequence[str], ts_us: int) -> list[pb.Event]:
        """Every chunk vLLM holds, as allocations (a restatement, oldest first)."""
        tiers = [self.tier] if self.tier else []
        return [
            pb.Event(
                ts_us=ts_us,
                allocated=pb.BlockAllocated(
                    intent=pb.MemoryIntent(block_id=self.prefix + b, size_bytes=1, allowed_tiers=tiers), tier=self.tier
                ),
            )
            for b in block_ids
        ]


class SidecarDecider:
    """The translator's decider in sidecar mode (``Decider``: block ids in, block ids out)."""

    def __init__(
        self,
        link: BrokerLink,
        translator: Translator,
        local: EmbeddedCore,
        names: Names,
        *,
        deadline_s: float = 0.005,
        timeouts_to_cool: int = 3,
        cooldown_s: float = 1.0,
        log_every_s: float = 60.0,
        now_us: Callable[[], int] = wall_us,
    ) -> None:
        if deadline_s <= 0:
            raise ValueError("deadline_s must be > 0")
        self.link = link
        self.translator = translator
        self.local = local
        self.names = names
        self.deadline_s = deadline_s
        self.timeouts_to_cool = timeouts_to_cool
        self.cooldown_s = cooldown_s
        self.log_every_s = log_every_s
        self._now_us = now_us
        self.evict_latency = LatencyHistogram()
        self.counts: dict[str, int] = {
            "evictions_asked": 0,
            "broker_decisions": 0,
            "fallback_decisions": 0,
            "fallback_none": 0,
            "late_victims_kept": 0,
            "late_victims_evicted": 0,
            "other_directives": 0,
            "resyncs": 0,
            **{f"fallback_{r}": 0 for r in REASONS},
        }
        # Victims of in-time answers, acked here: their copies in link.directives are skipped.
        self._used: set[int] = set()
        self._timeouts = 0
        self._cool_until = 0.0
        self._last_log = time.monotonic()
        self._closed = False
        local.listeners.append(self.forward)
        # A fresh CPU tier: what the broker holds for this client id (a previous run's) goes.
        link.send([pb.Event(ts_us=now_us(), cleared=pb.AllBlocksCleared())])

    # ---- every batch -----------------------------------------------------------------------

    def forward(self, raw: bytes) -> None:
        """A batch the embedded core applied: to the broker, rewritten on the link's thread."""
        names = self.names
        self.link.send_later(lambda: names.rewrite(raw))

    # ---- the decider seam ------------------------------------------------------------------

    def evict(self, count: int, protected: list[str]) -> list[str] | None:
        """``count`` victims (local block ids), none protected: the broker's if it answers
        in time, else the embedded core's."""
        started = time.perf_counter()
        try:
            # The broker (and the mirror) must have seen every call before deciding; and the
            # acks settle() sends must come after the calls they are measured against.
            self.translator.apply()
            self.settle()
            self.counts["evictions_asked"] += 1
            chosen = self._ask_broker(count, protected, started)
            if isinstance(chosen, list):
                self.counts["broker_decisions"] += 1
                return chosen
            return self._fall_back(count, protected, chosen)
        finally:
            self.evict_latency.record(time.perf_counter() - started)
            self._maybe_log()

    def _ask_broker(self, count: int, protected: list[str], started: float) -> list[str] | str:
        """The broker's victims (acked DONE), or why not."""
        link = self.link
        if link.failed is not None:
            return FAILED
        if not link.connected:
            return DOWN
        if started < self._cool_until:
            return COOLDOWN
        names = self.names
        request = pb.EvictionRequested(tier=names.tier, count=count, protected_block_ids=[names.remote(b) for b in protected])
        remaining = self.deadline_s - (time.perf_counter() - started)
        answer = link.ask([pb.Event(ts_us=self._now_us(), eviction_requested=request)], max(remaining, 0.0))
        if isinstance(answer, Unanswered):
            if answer.reason == TIMEOUT:
                self._timed_out()
            return answer.reason
        self._timeouts = 0
        if any(r.field.startswith("eviction_requested") for r in answer.rejections):
            return REFUSED
        victims = [d for d in answer.directives if d.kind == _EVICT and d.reason.startswith(_REQUESTED)]
        chosen = self._valid(victims, count, protected)
        if chosen is None:
            # settle() acks them FAILED (vLLM keeps them): the broker puts them back.
            return INVALID
        ts = self._now_us()
        link.send([acked_event(d.directive_id, ts) for d in victims])
        self._used.update(d.directive_id for d in victims)
        return chosen

    def _timed_out(self) -> None:
        self._timeouts += 1
        if self._timeouts >= self.timeouts_to_cool:
            self._timeouts = 0
            self._cool_until = time.perf_counter() + self.cooldown_s
            log.warning(
                "kvbroker sidecar %s: %d answers late in a row; deciding locally for %.1f s",
                self.link.client_id,
                self.timeouts_to_cool,
                self.cooldown_s,
            )

    def _valid(self, victims: list[dpb.Directive], count: int, protected: list[str]) -> list[str] | None:
        """The local ids of exactly ``count`` distinct victims vLLM holds, none protected."""
        if len(victims) != count:
            log.debug("kvbroker sidecar %s: the broker named %d victims for %d", self.link.client_id, len(victims), count)
            return None
        by_id = self.translator.by_id
        shielded = set(protected)
        chosen: list[str] = []
        for d in victims:
            block_id = self.names.local(d.block_id)
            if block_id is None or block_id not in by_id or block_id in shielded:
                why = "protected or named twice" if block_id in shielded else "not held by vLLM"
                log.debug("kvbroker sidecar %s: the broker named %s: %s", self.link.client_id, d.block_id, why)
                return None
            shielded.add(block_id)  # a second copy is invalid too
            chosen.append(block_id)
        return chosen

    def _fall_back(self, count: int, protected: list[str], reason: str) -> list[str] | None:
        """The embedded core decides, as in embedded mode (its batch is not forwarded: the
        broker learns the victims from the translator's ``freed``)."""
        self.counts[f"fallback_{reason}"] += 1
        ask = intent_bytes.eviction_requested(self.translator.timestamp(), count, [intent_bytes.id_field(b) for b in protected])
        outcome = self.translator.apply(ask)
        if outcome is None or outcome.rejections:
            self.counts["fallback_none"] += 1
            return None
        self.counts["fallback_decisions"] += 1
        return [d.block_id for d in outcome.directives]

    # ---- keeping the broker's view ---------------------------------------------------------

    def settle(self) -> None:
        """Answer the directives that came outside an in-time answer, and restate the tier
        when the broker's view lost something. O(directives waiting); nothing when none.

        Call it after ``translator.apply()``: an ack says where a chunk is after every call
        vLLM made so far, so those calls must reach the broker first."""
        if self.link.directives:
            self._settle_directives()
        # Restated once the broker is there to take it (during an outage the flag waits).
        if self.link.connected and self.link.take_resync():
            self.resync()

    def _settle_directives(self) -> None:
        queue = self.link.directives
        by_id = self.translator.by_id
        names = self.names
        ts = self._now_us()
        acks: list[pb.Event] = []
        while queue:
            d = queue.popleft()
            if d.directive_id in self._used:
                self._used.discard(d.directive_id)
                continue
            block_id = names.local(d.block_id)
            held = block_id is not None and block_id in by_id
            if d.kind == _EVICT and d.reason.startswith(_REQUESTED):
                self.counts["late_victims_kept" if held else "late_victims_evicted"] += 1
            else:
                self.counts["other_directives"] += 1
            if d.kind == _EVICT and not held:
                acks.append(acked_event(d.directive_id, ts))
            else:
                # vLLM keeps the chunk where it is, or does not have it: the broker's model
                # goes back to that.
                acks.append(acked_event(d.directive_id, ts, failed=True, actual_tier=d.from_tier if held else ""))
        if acks:
            self.link.send(acks)

    def flush(self) -> None:
        """Forward what the translator holds back (it batches until the next decision) and
        settle what came from the broker: for an idle engine, tests and shutdown."""
        self.translator.apply()
        self.settle()

    def resync(self) -> None:
        """Restate the tier: AllBlocksCleared, then every chunk vLLM holds (built on the
        link's thread from a copy of the ids: the scheduler pays one list copy)."""
        self.counts["resyncs"] += 1
        self.translator.apply()  # what vLLM did so far goes first; the restatement replaces it
        held = list(self.translator.by_id)
        log.warning("kvbroker sidecar %s: restating %d chunks to the broker (its view lost events)", self.link.client_id, len(held))
        self._used.clear()
        ts = self._now_us()
        names = self.names
        self.link.send_later(lambda: [pb.Event(ts_us=ts, cleared=pb.AllBlocksCleared()), *names.allocations(held, ts)])

    # ---- what the user sees ----------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        """Decisions by origin, fallbacks by reason, late answers, evict wait (µs), the link's."""
        out: dict[str, Any] = dict(self.counts)
        out.update({f"evict_{k}": v for k, v in self.evict_latency.summary().items()})
        out.update({f"link_{k}": v for k, v in self.link.counters().items()})
        return out

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < self.log_every_s:
            return
        self._last_log = now
        log.info("%s", self.summary())

    def summary(self) -> str:
        c = self.counts
        s = self.evict_latency.summary()
        link = self.link.counters()
        late = link["late_answers"]
        rejected = link["client_rejected_events"]
        fallbacks = ", ".join(f"{r} {c['fallback_' + r]}" for r in REASONS if c["fallback_" + r]) or "none"
        return (
            f"kvbroker sidecar {self.link.client_id}: {c['evictions_asked']} evictions, {c['broker_decisions']} decided by the "
            f"broker, {c['fallback_decisions']} by the fallback ({fallbacks}), {late} late answers, "
            f"{c['resyncs']} restatements; evict call p50 {s['p50_us']:.0f} us, p99 {s['p99_us']:.0f} us, max {s['max_us']:.0f} us"
            + (f"; {rejected} events rejected by the broker (see its log)" if rejected else "")
        )

    def close(self) -> None:
        """Forward what is held back, log the counters, close the link (idempotent; also
        at interpreter exit: vLLM does not close its policy)."""
        if self._closed:
            return
        self._closed = True
        self.flush()
        log.info("%s", self.summary())
        self.link.close()


def make_decider(settings: OffloadSettings, local: EmbeddedCore, translator: Translator) -> SidecarDecider:
    """The sidecar decider of ``settings`` (kvbroker_broker, kvbroker_deadline_ms, ...): the
    link starts connecting in the background; vLLM does not wait for the broker."""
    client_id = settings.resolved_client_id()
    tier = settings.resolved_broker_tier()
    # The calls reach the broker in small batches as they come, not all at the next evict:
    # an EvictionRequested is answered after everything sent before it is applied.
    translator.flush_events = FORWARD_EVENTS
    try:
        security = ClientSecurity.from_env()
        security.credentials()  # a file that cannot be read stops vLLM's start, never the link's retries
    except ValueError as exc:
        raise SettingsError(f"sidecar mode: {exc}") from None
    link = BrokerLink(settings.broker, client_id, tenant=settings.tenant, security=security)
    decider = SidecarDecider(link, translator, local, Names(client_id + "/", tier), deadline_s=settings.deadline_ms / 1000.0)
    atexit.register(decider.close)
    check_tier(link, security, tier, local.config.tiers[0].capacity_bytes)
    log.info(
        "kvbroker sidecar %s: broker %s, tier %r, bound %.1f ms, fallback policy %s",
        client_id,
        settings.broker,
        tier or "(the broker's top tier)",
        settings.deadline_ms,
        local.core.policy_name,
    )
    return decider
