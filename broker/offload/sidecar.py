"""Sidecar mode: a running `kvbroker serve` chooses vLLM's victims, under a hard bound.

vLLM's scheduler calls the CachePolicy synchronously; the broker is another process. So:

- Every call's events go to the broker without waiting (BrokerLink: batched, ordered,
  resent after a reconnect) and are applied to a local mirror: the embedded core, with the
  configured fallback policy, holding the same tier.
- ``evict(n, protected)`` sends an EvictionRequested and waits for its answer at most
  ``deadline_s``. In time and valid (n distinct EVICT victims the mirror holds, evictable,
  none protected): those are the victims; the mirror drops them too and the broker is told
  they are gone (acks, then BlocksFreed). Otherwise the mirror decides (the fallback), and
  the broker is told what vLLM really evicted (BlocksFreed). Broker known down: no wait at
  all. A broker that keeps timing out is not asked for ``cooldown_s`` (a circuit breaker),
  so a hung broker costs one bound now and then, not one per call.

Keeping the broker's view what vLLM really holds:

- a late answer (the broker chose B after vLLM went with the fallback's F): each victim in B
  that vLLM still holds is acked FAILED with ``actual_tier`` = the tier (the broker puts it
  back), the others DONE; F was already freed. The same holds for an EvictionRequested that
  waited out a broker outage in the client's resend buffer and was applied on reconnect.
- any other directive (the broker's own watermark evictions, demotions, prefetches vLLM's
  manager cannot carry out) is acked FAILED with where the block really is.
- what a resend cannot repair (an answer lost with a broken stream, a batch dropped by the
  queue bounds of a long outage, a broker that restarted without its journal): the tier is
  restated: AllBlocksCleared, then every block the mirror holds, oldest first.

All of this runs on the scheduler thread at the start of the next call (the directives wait
in a deque the link fills), so the mirror needs no lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, Protocol, TypeVar

from broker.offload.latency import LatencyHistogram
from broker.offload.link import DOWN, FAILED, LOST, TIMEOUT, BrokerLink, Unanswered
from clients.broker_client import acked_event, freed_event
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb

log = logging.getLogger("kvbroker.offload.sidecar")

Key = TypeVar("Key", bound=Hashable)

# Why the fallback decided (counters "fallback_<reason>").
REFUSED = "refused"  # the broker could not choose n victims (its view differs)
INVALID = "invalid"  # the answer named victims vLLM cannot evict
COOLDOWN = "cooldown"  # the broker timed out repeatedly: not asked for a while
REASONS = (DOWN, TIMEOUT, LOST, FAILED, REFUSED, INVALID, COOLDOWN)

_EVICT = dpb.DIRECTIVE_KIND_EVICT
# The reason the core gives the victims of an EvictionRequested (Core.evict_chosen).
_REQUESTED = "eviction requested"


class Mirror(Protocol[Key]):
    """The local tier the sidecar keeps in step with vLLM (the embedded core)."""

    tier: str

    def evict(self, n: int, protected: set[Key]) -> list[Key] | None:
        """The fallback: the local policy chooses n victims and the mirror drops them."""

    def forget(self, keys: Sequence[Key]) -> None:
        """The broker chose these victims: the mirror drops them too."""

    def block_id(self, key: Key) -> str: ...

    def key_of(self, block_id: str) -> Key | None:
        """The key of a block the mirror holds, or None."""

    def evictable(self, key: Key) -> bool: ...

    def restate(self) -> list[pb.Event]:
        """Events that rebuild the tier in a broker that lost it: every block held, oldest first."""


Clock = Callable[[], float]


class SidecarDecider(Generic[Key]):
    def __init__(
        self,
        link: BrokerLink,
        mirror: Mirror[Key],
        *,
        deadline_s: float = 0.005,
        timeouts_to_cool: int = 3,
        cooldown_s: float = 1.0,
        log_every_s: float = 60.0,
        now_us: Callable[[], int] | None = None,
        clock: Clock = time.perf_counter,
    ) -> None:
        if deadline_s <= 0:
            raise ValueError("deadline_s must be > 0")
        self.link = link
        self.mirror = mirror
        self.deadline_s = deadline_s
        self.timeouts_to_cool = timeouts_to_cool
        self.cooldown_s = cooldown_s
        self.log_every_s = log_every_s
        self._clock = clock
        self._t0 = time.monotonic_ns()
        self._now_us = now_us or self._monotonic_us
        self.evict_latency = LatencyHistogram()
        self.counts: dict[str, int] = {
            "evictions_asked": 0,
            "broker_decisions": 0,
            "fallback_decisions": 0,
            "fallback_none": 0,
            "late_answers": 0,
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

    def _monotonic_us(self) -> int:
        return (time.monotonic_ns() - self._t0) // 1000

    # ---- the decider seam ------------------------------------------------------------------

    def forward(self, events: Sequence[pb.Event]) -> None:
        """The events of one CachePolicy call: to the broker, without waiting."""
        self.settle()
        self.link.send(events)

    def evict(self, n: int, protected: set[Key]) -> list[Key] | None:
        """n victims, none protected, the broker's if it answers in time, else the mirror's."""
        started = self._clock()
        try:
            self.settle()
            self.counts["evictions_asked"] += 1
            chosen = self._ask_broker(n, protected, started)
            if isinstance(chosen, list):
                self.counts["broker_decisions"] += 1
                return chosen
            return self._fall_back(n, protected, chosen)
        finally:
            self.evict_latency.record(self._clock() - started)
            self._maybe_log()

    def _ask_broker(self, n: int, protected: set[Key], started: float) -> list[Key] | str:
        """The broker's victims (dropped from the mirror, acked, freed), or why not."""
        if self.link.failed is not None:
            return FAILED
        if not self.link.connected:
            return DOWN
        if started < self._cool_until:
            return COOLDOWN
        mirror = self.mirror
        request = pb.EvictionRequested(tier=mirror.tier, count=n, protected_block_ids=[mirror.block_id(k) for k in protected])
        remaining = self.deadline_s - (self._clock() - started)
        answer = self.link.ask([pb.Event(ts_us=self._now_us(), eviction_requested=request)], max(remaining, 0.0))
        if isinstance(answer, Unanswered):
            if answer.reason == TIMEOUT:
                self._timeouts += 1
                if self._timeouts >= self.timeouts_to_cool:
                    self._cool_until = self._clock() + self.cooldown_s
                    self._timeouts = 0
                    log.warning(
                        "kvbroker sidecar %s: %d answers late in a row; deciding locally for %.1fs",
                        self.link.client_id,
                        self.timeouts_to_cool,
                        self.cooldown_s,
                    )
            return answer.reason
        self._timeouts = 0
        if any(r.field.startswith("eviction_requested") for r in answer.rejections):
            return REFUSED
        victims = [d for d in answer.directives if d.kind == _EVICT and d.from_tier == mirror.tier and d.reason.startswith(_REQUESTED)]
        keys = self._valid(victims, n, protected)
        if keys is None:
            # Leave them to settle(): acked FAILED (vLLM keeps them), the broker puts them back.
            return INVALID
        mirror.forget(keys)
        ts = self._now_us()
        events = [acked_event(d.directive_id, ts) for d in victims]
        events.append(freed_event([d.block_id for d in victims], ts))
        self.link.send(events)
        self._used.update(d.directive_id for d in victims)
        return keys

    def _valid(self, victims: list[dpb.Directive], n: int, protected: set[Key]) -> list[Key] | None:
        """The keys of exactly n distinct victims the mirror holds, evictable and unprotected."""
        if len(victims) != n:
            return None
        keys: list[Key] = []
        seen: set[Key] = set()
        for d in victims:
            key = self.mirror.key_of(d.block_id)
            if key is None or key in protected or key in seen or not self.mirror.evictable(key):
                return None
            seen.add(key)
            keys.append(key)
        return keys

    def _fall_back(self, n: int, protected: set[Key], reason: str) -> list[Key] | None:
        self.counts[f"fallback_{reason}"] += 1
        keys = self.mirror.evict(n, protected)
        if keys is None:
            self.counts["fallback_none"] += 1
            return None
        self.counts["fallback_decisions"] += 1
        if keys:
            # What vLLM really evicted: the broker forgets them too (after its own choice, if
            # the request reaches it; settle() puts back what it chose and vLLM kept).
            self.link.send([freed_event([self.mirror.block_id(k) for k in keys], self._now_us())])
        return keys

    # ---- keeping the broker's view ---------------------------------------------------------

    def settle(self) -> None:
        """Answer the directives that came outside an in-time answer, and restate the tier
        when the broker's view lost something. O(directives waiting); nothing when none."""
        if self.link.directives:
            self._settle_directives()
        # Restated once the broker is there to take it (during an outage the flag waits).
        if self.link.connected and self.link.take_resync():
            self.resync()

    def _settle_directives(self) -> None:
        queue = self.link.directives
        mirror = self.mirror
        ts = self._now_us()
        acks: list[pb.Event] = []
        late_batch = False
        while queue:
            d = queue.popleft()
            if d.directive_id in self._used:
                self._used.discard(d.directive_id)
                continue
            held = mirror.key_of(d.block_id) is not None
            if d.kind == _EVICT and d.reason.startswith(_REQUESTED):
                late_batch = True
                self.counts["late_victims_kept" if held else "late_victims_evicted"] += 1
            else:
                self.counts["other_directives"] += 1
            if d.kind == _EVICT and not held:
                acks.append(acked_event(d.directive_id, ts))
            else:
                # vLLM keeps the block where it is (or does not have it): the broker's model
                # goes back to that.
                acks.append(acked_event(d.directive_id, ts, failed=True, actual_tier=mirror.tier if held else ""))
        if late_batch:
            self.counts["late_answers"] += 1
        if acks:
            self.link.send(acks)

    def resync(self) -> None:
        """Restate the tier: AllBlocksCleared, then every block the mirror holds."""
        self.counts["resyncs"] += 1
        events = [pb.Event(ts_us=self._now_us(), cleared=pb.AllBlocksCleared()), *self.mirror.restate()]
        log.warning("kvbroker sidecar %s: restating %d blocks to the broker (its view lost events)", self.link.client_id, len(events) - 1)
        self._used.clear()
        self.link.send(events)

    # ---- what the user sees ----------------------------------------------------------------

    def counters(self) -> dict[str, float]:
        """Decisions by origin, fallbacks by reason, late answers, evict wait (µs), the link's."""
        out: dict[str, float] = dict(self.counts)
        out.update({f"evict_{k}": v for k, v in self.evict_latency.summary().items()})
        out.update({f"link_{k}": v for k, v in self.link.counters().items()})
        return out

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < self.log_every_s:
            return
        self._last_log = now
        c = self.counts
        s = self.evict_latency.summary()
        log.info(
            "kvbroker sidecar %s: %d evictions, %d by the broker, %d by the fallback (%s), %d late answers; "
            "evict wait p50 %.0f us, p99 %.0f us, max %.0f us",
            self.link.client_id,
            c["evictions_asked"],
            c["broker_decisions"],
            c["fallback_decisions"],
            ", ".join(f"{r} {c['fallback_' + r]}" for r in REASONS if c["fallback_" + r]) or "none",
            c["late_answers"],
            s["p50_us"],
            s["p99_us"],
            s["max_us"],
        )

    def close(self) -> None:
        self.settle()
        self.link.close()
