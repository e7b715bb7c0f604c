"""vLLM's CachePolicy calls as MemoryIntent events, and the seam where evictions are decided.

The translation (one CPU tier of one-byte chunks; a chunk's block id is its OffloadKey in hex):

================================  ===================================================================
vLLM calls                        kvbroker events
================================  ===================================================================
``insert(key, chunk, req)``       ``allocated`` (request id, the request's hinted intent, size 1); a
                                  key with a token position: scoped by the request (``scope``, the
                                  position as ``token_start``), as vLLM's LRU ranks it
``touch(keys, req)``              ``accessed`` of the resident keys, last first (vLLM's touch makes
                                  the first key the most recent)
``on_request_finished(groups)``   ``accessed`` of the request's resident keys in prefix order, tail
                                  first: the ``reused_keys`` as reads, the others
                                  ``refresh_only`` (used, not read), a run of each kind per
                                  event; the last ends the request's scope (``ends_scope``); a
                                  hinted request also sends ``intent_updated`` for each (its
                                  intent reaches chunks it reused)
``remove(key)``                   ``freed``
``evict(n, protected)``           ``eviction_requested`` (count n; protected: vLLM's ``protected``
                                  plus every chunk vLLM holds non-evictable), then ``freed`` of the
                                  victims (vLLM forgets them)
``clear()``                       ``cleared``
``on_request_access(keys, req)``  a scoped ``accessed`` (``scope``: the request id) of the resident
                                  keys that have a token position, with their positions, tail
                                  first, ties by key; sent even with none (the request takes its
                                  rank, as in vLLM's LRU)
``mark_evictable`` / ``mark_non_evictable``, ``on_store_miss``, ``get``:
                                  no event (non-evictable chunks travel as protected ids)
================================  ===================================================================

Events are applied in call order, but in batches: they are buffered and applied, as one
IntentBatch, right before the next decision (``evict``, whose ``eviction_requested`` ends
the batch), or when ``FLUSH_EVENTS`` are waiting. Nothing is decided in between, so the
decisions are those of applying each call at once, and one batch per decision costs far
less than one per call. Event time (``ts_us``) is the wall clock at the
call, to the millisecond.

**The decider seam.** ``Decider.evict(count, protected_ids) -> victim ids | None`` is where
an eviction is decided. ``LocalDecider`` applies an ``eviction_requested`` event to the
embedded core (embedded mode); the sidecar mode puts a remote decider there with a local
fallback. Whatever decides, the translator then frees the victims in the local core, so
it stays the same as vLLM's cache.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, Protocol

from vllm_integration.decisions_to_vllm import intent_bytes
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.hints import IntentHint, parse_intent, show

# Under vLLM's logger (this room runs inside vLLM): vLLM's logging configuration shows it.
log = logging.getLogger("vllm.kvbroker")

# Buffered events are applied as a batch at once when this many wait, or when the oldest
# waited this long (bounds memory, and how far the journal lags behind vLLM while it stores
# without evicting).
FLUSH_EVENTS: Final = 4096
FLUSH_MS: Final = 1000
# How often the counters are logged (INFO): an embedded engine has no `kvbroker status`.
REPORT_MS: Final = 60_000
# An ignored hint is logged (WARNING) at most once per this long (the count goes on): hints
# come from requests, and a flood of bad ones must not flood vLLM's log.
HINT_LOG_MS: Final = 10_000
# Distinct reasons counted by name; past this many, "other" (a reason may quote its value).
HINT_REASONS: Final = 64
# A request id (a scope's name, in every chunk's event) longer than this, in UTF-8 bytes, or
# not UTF-8 at all, is named by its digest instead.
MAX_REQUEST_ID_BYTES: Final = 256
# Token positions a chunk may carry: a MemoryIntent.token_start is a uint64; past int64 no
# prompt goes. A key whose position is outside 0..MAX_POSITION is taken as one with none.
MAX_POSITION: Final = 2**63 - 1
# The reason of the EVICT directives an eviction_requested makes (broker.model.core).
REQUESTED: Final = "eviction requested"
# The block id of the empty key (a key's id is its hex, and the core rejects an empty id):
# "-" is no hex string, so it names no other key.
EMPTY_KEY_ID: Final = "-"
# The largest deadline_us MemoryIntent carries (int64).
MAX_DEADLINE_US: Final = 2**63 - 1


class Decider(Protocol):
    """Chooses eviction victims. ``evict`` returns exactly ``count`` block ids, none of them in
    ``protected`` (block ids), or None when it cannot (then nothing changed).

    The core that decides must have seen every call before: a decider first applies the
    translator's buffered events (``translator.apply(...)``, which hands the batch to the
    embedded core and its listeners)."""

    def evict(self, count: int, protected: list[str]) -> list[str] | None: ...


class LocalDecider:
    """Embedded mode: the embedded core's policy decides (an ``eviction_requested`` event)."""

    def __init__(self, local: EmbeddedCore, translator: Translator) -> None:
        self.local = local
        self.translator = translator

    def evict(self, count: int, protected: list[str]) -> list[str] | None:
        ts = self.translator.timestamp()
        ask = intent_bytes.eviction_requested(ts, count, [intent_bytes.id_field(b) for b in protected])
        outcome = self.translator.apply(ask)
        if outcome is None:
            return None
        # The decision is the ask's own outcome, whatever became of the calls before it in
        # the batch (an event of theirs the core rejects changed nothing): the ask, the
        # batch's last event, rejected, the core changed nothing (choose_count picks
        # exactly ``count`` or raises); applied, its victims are the answer, and vLLM drops
        # them as the core did.
        last = outcome.accepted + len(outcome.rejections) - 1
        if any(r.index == last for r in outcome.rejections):
            return None
        return [d.block_id for d in outcome.directives if d.reason.startswith(REQUESTED)]


@dataclasses.dataclass
class TranslatorStats:
    """What the adapter counted (logged at debug; the journal holds the decisions)."""

    batches: int = 0
    events: int = 0
    evictions_asked: int = 0
    evictions_refused: int = 0
    chunks_evicted: int = 0
    hinted_requests: int = 0
    # Batches that raised in the core, decisions that failed or named impossible victims.
    errors: int = 0
    # Hints ignored, by reason (a malformed kvbroker action in a request's kv_hints); at
    # most HINT_REASONS reasons, then "other".
    hints_ignored: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # Request ids named by their digest (longer than MAX_REQUEST_ID_BYTES, or not UTF-8).
    request_ids_digested: int = 0
    # Keys whose token position was outside 0..MAX_POSITION (sent as plain uses).
    positions_ignored: int = 0
    # Events dropped because the core could not read them (the rest of their batch applied).
    events_dropped: int = 0


@dataclasses.dataclass(slots=True)
class RequestIntent:
    """A request's parsed hint and its encoded intent (kept in the ReqContext's state)."""

    owner: object
    generation: int
    # The MemoryIntent fields after block_id of the request's chunks.
    intent_rest: bytes
    # The IntentUpdated fields after block_id when the request has a hint ("" otherwise).
    update_rest: bytes
    # The request id as a scope field (intent_bytes.scope), "" for a request with no id; and as
    # BlockAllocated's (intent_bytes.allocation_scope).
    scope_field: bytes = b""
    scope_tail: bytes = b""


class Translator:
    """The kvbroker side of vLLM's CachePolicy: chunk bookkeeping, events, decisions.

    Duck-typed: keys are any hashable vLLM gives (OffloadKey bytes), chunks vLLM's
    ChunkStatus (``ref_cnt``), request contexts vLLM's ReqContext (``req_id``, ``kv_hints``,
    ``get_state``/``set_state``, ``get_offload_key_position``). It imports no vLLM."""

    def __init__(self, local: EmbeddedCore, *, tenant: str = "", decider: Decider | None = None) -> None:
        self.local = local
        self.tenant = tenant
        # key -> (chunk, block id, block id as an encoded id field)
        self.entries: dict[Any, tuple[Any, str, bytes]] = {}
        self.by_id: dict[str, Any] = {}
        # Keys vLLM holds non-evictable (ref_cnt != 0: a store in flight, a load reading it).
        self.held: set[Any] = set()
        self.stats = TranslatorStats()
        self._buffer: list[bytes] = []
        # Sidecar mode sets it lower: the broker should have the calls before it is asked.
        self.flush_events = FLUSH_EVENTS
        self._ts_ms = -1
        self._ts = b""
        self._applied_ms = -1
        self._report_ms = 0
        self._hint_log_ms = 0
        self._hints_unlogged = 0
        self._generation = 0
        self.decider: Decider = decider if decider is not None else LocalDecider(local, self)
        self._plain_intent = intent_bytes.intent_fields("", tenant=tenant)
        # A settings watcher (vllm_integration/decisions_to_vllm/reload.py) runs on a thread of its own and must
        # not touch the core vLLM's thread is using: it sets ``reload_due``, and the new
        # settings are applied here (``on_reload_due``), on vLLM's thread, at the next call
        # boundary (a new millisecond, or an eviction), between two calls' events.
        self.reload_due = False
        self.on_reload_due: Callable[[], None] | None = None

    # ---- events ---------------------------------------------------------------------------

    def timestamp(self) -> bytes:
        """The encoded ts_us of an event now (wall clock, whole milliseconds)."""
        ms = time.time_ns() // 1_000_000
        if ms != self._ts_ms:
            if self.reload_due:
                self.reload_now()
            if self._buffer and ms - self._applied_ms >= FLUSH_MS:
                self.apply()  # what waited a second goes in (before the caller's event)
            if ms >= self._report_ms:
                if self._report_ms:
                    self.report()
                self._report_ms = ms + REPORT_MS
            self._ts_ms = ms
            self._ts = intent_bytes.timestamp(ms * 1000)
        return self._ts

    def reload_now(self) -> None:
        """Apply the settings a watcher handed over (vLLM's thread only). The flag is
        cleared first: settings handed over meanwhile set it again, none is lost."""
        self.reload_due = False
        if self.on_reload_due is not None:
            self.on_reload_due()

    def set_tenant(self, tenant: str) -> None:
        """The tenant of chunks whose request names none, from the next request on (a
        request in flight keeps the intent it was encoded with)."""
        self.tenant = tenant
        self._plain_intent = intent_bytes.intent_fields("", tenant=tenant)

    def record(self, event: bytes) -> None:
        buffer = self._buffer
        buffer.append(event)
        if len(buffer) >= self.flush_events:
            self.apply()

    def apply(self, last: bytes | None = None) -> Any:
        """Apply the buffered events (and ``last``) as one batch; its outcome, or None when
        there was nothing to apply."""
        evs = self._buffer
        if last is not None:
            evs.append(last)
        if not evs:
            return None
        self._buffer = []
        self._applied_ms = self._ts_ms
        self.stats.batches += 1
        self.stats.events += len(evs)
        try:
            return self.local.apply(evs)
        except Exception:
            readable = self._readable(evs)
            if readable is not None:
                # Bytes the core could not read (nothing of them was applied): the events
                # it reads go in without the others, so one bad event costs only itself.
                self.stats.events_dropped += len(evs) - len(readable)
                log.error("kvbroker: %d events of a batch could not be read; the other %d apply", len(evs) - len(readable), len(readable))
                try:
                    return self.local.apply(readable) if readable else None
                except Exception:
                    pass
            # A policy that raises must not stop vLLM's scheduler: the batch is counted and
            # logged; evictions are then refused (vLLM skips those stores) if the core can
            # no longer name chunks vLLM holds.
            self.stats.errors += 1
            if self.stats.errors <= 10:
                log.exception("kvbroker: applying a batch of %d events failed (error %d)", len(evs), self.stats.errors)
            return None

    def _readable(self, evs: list[bytes]) -> list[bytes] | None:
        """When the batch of ``evs`` cannot be read (nothing of it applied), the events that
        can, each read alone; None when it can (the error was in applying it)."""
        head = intent_bytes.batch_head("check")
        if intent_bytes.readable(intent_bytes.batch(head, 1, evs)):
            return None
        return [ev for ev in evs if intent_bytes.readable(intent_bytes.batch(head, 1, [ev]))]

    def counters(self) -> dict[str, Any]:
        """What the metrics export (report.COUNTERS): evictions, the journal's progress and
        lag, the config generation and, in sidecar mode, the fallback's decisions by reason."""
        st = self.stats
        journal = self.local.journal
        out: dict[str, Any] = {
            "evictions_asked": st.evictions_asked,
            "evictions_refused": st.evictions_refused,
            "chunks_evicted": st.chunks_evicted,
            "errors": st.errors,
            "journal_written": journal.written if journal is not None else 0,
            "journal_pending": journal.pending if journal is not None else 0,
            "config_generation": self.local.generation,
        }
        decider_counters = getattr(self.decider, "counters", None)
        fallbacks = decider_counters() if callable(decider_counters) else {}
        by_reason = {k: v for k, v in fallbacks.items() if k.startswith("fallback_") and k != "fallback_decisions"}
        out["fallbacks"] = {k[len("fallback_") :]: int(v) for k, v in by_reason.items()}
        return out

    def report(self) -> None:
        """Log the counters (every REPORT_MS while vLLM calls)."""
        st = self.stats
        journal = self.local.journal
        log.info(
            "kvbroker: %d chunks held, %d evictions asked (%d refused), %d chunks evicted, %d batches, "
            "%d hinted requests, %d hints ignored, %d positions ignored, %d errors, journal %s",
            len(self.entries),
            st.evictions_asked,
            st.evictions_refused,
            st.chunks_evicted,
            st.batches,
            st.hinted_requests,
            sum(st.hints_ignored.values()),
            st.positions_ignored,
            st.errors,
            f"{journal.url} ({journal.written} records written)" if journal is not None else "none",
        )

    def flush(self) -> None:
        """Apply what is buffered and wait until the journal holds it."""
        self.apply()
        self.local.flush()

    # ---- requests -------------------------------------------------------------------------

    def request_intent(self, req_context: Any) -> RequestIntent:
        state: RequestIntent | None = req_context.get_state(RequestIntent)
        if state is not None and state.owner is self and state.generation == self._generation:
            return state
        request_id = self.request_name(getattr(req_context, "req_id", ""))
        # parse_intent never raises; encoding a valid hint cannot either, but whatever a
        # request holds must not reach vLLM's call as an exception: the hint is ignored.
        try:
            hint, reason = parse_intent(getattr(req_context, "kv_hints", None))
            state = self._encode_intent(request_id, hint)
        except Exception as exc:
            reason = f"kv_hints: unusable ({type(exc).__name__})"
            state = self._encode_intent(request_id, None)
        if reason:
            self._hint_ignored(request_id, reason)
        if request_id:
            state.scope_field = intent_bytes.scope(request_id)
            state.scope_tail = intent_bytes.allocation_scope(request_id)
        req_context.set_state(state)
        return state

    def request_name(self, req_id: Any) -> str:
        """A request's name in events (its request_id and scope): its id, or, for an id
        longer than MAX_REQUEST_ID_BYTES or that is not UTF-8 (a lone surrogate), ``~``
        and the hex of its blake2b digest: bounded, valid on the wire, and still one name
        per request (so vLLM's ranking by request holds). "" for a request with no id."""
        if not req_id:
            return ""
        name = req_id if type(req_id) is str else str(req_id)
        try:
            data = name.encode()
        except UnicodeEncodeError:
            data = b""
        if data and len(data) <= MAX_REQUEST_ID_BYTES:
            return name
        self.stats.request_ids_digested += 1
        return "~" + hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()

    def _hint_ignored(self, request_id: str, reason: str) -> None:
        """Count an ignored hint by reason (bounded), and log it at most once per HINT_LOG_MS."""
        ignored = self.stats.hints_ignored
        ignored[reason if reason in ignored or len(ignored) < HINT_REASONS else "other"] += 1
        now = time.monotonic_ns() // 1_000_000
        if now < self._hint_log_ms:
            self._hints_unlogged += 1
            return
        self._hint_log_ms = now + HINT_LOG_MS
        more = f" ({self._hints_unlogged} more ignored since the last report)" if self._hints_unlogged else ""
        self._hints_unlogged = 0
        log.warning("kvbroker: request %s: kv_hints ignored: %s%s", show(request_id), reason, more)

    def _encode_intent(self, request_id: str, hint: IntentHint | None) -> RequestIntent:
        if hint is None:
            rest = intent_bytes.intent_fields(request_id, tenant=self.tenant) if request_id else self._plain_intent
            return RequestIntent(self, self._generation, rest, b"")
        self.timestamp()  # the deadline counts from now
        deadline = None if hint.deadline_ms is None else self._ts_ms * 1000 + int(hint.deadline_ms * 1000)
        if deadline is not None and deadline > MAX_DEADLINE_US:
            raise OverflowError("deadline_us past int64")  # parse_intent's bound keeps it far below
        rest = intent_bytes.intent_fields(
            request_id,
            priority=hint.priority,
            deadline_us=deadline,
            request_priority=hint.request_priority,
            reuse_tokens=hint.expected_reuse_tokens,
            tenant=hint.tenant if hint.tenant is not None else self.tenant,
            is_draft=bool(hint.is_draft),
        )
        update = intent_bytes.update_fields(
            priority=hint.priority,
            deadline_us=deadline,
            request_priority=hint.request_priority,
            reuse_tokens=hint.expected_reuse_tokens,
            is_draft=hint.is_draft,
        )
        self.stats.hinted_requests += 1
        return RequestIntent(self, self._generation, rest, update)

    # ---- vLLM's CachePolicy ---------------------------------------------------------------

    def get(self, key: Any) -> Any:
        entry = self.entries.get(key)
        return entry[0] if entry is not None else None

    def insert(self, key: Any, chunk: Any, req_context: Any) -> None:
        # The hot path (vLLM calls it once per chunk stored): written out.
        # vLLM's keys are block hashes; an empty one (its interface allows it) is a key as
        # any other, as in vLLM's LRU: an id no hex string can be, not the empty id the
        # core rejects (its chunk could then never be evicted).
        block_id = key.hex() or EMPTY_KEY_ID
        field = intent_bytes.id_field(block_id)
        self.entries[key] = (chunk, block_id, field)
        self.by_id[block_id] = key
        if chunk.ref_cnt != 0:
            self.held.add(key)
        state = req_context.get_state(RequestIntent)
        if state is None or state.owner is not self or state.generation != self._generation:
            state = self.request_intent(req_context)
        # A positioned chunk ranks with its request (vLLM's LRU: (request rank, -position)).
        position = req_context.get_offload_key_position(key) if state.scope_field else None
        if position is not None and not 0 <= position <= MAX_POSITION:
            self.stats.positions_ignored += 1
            position = None  # negative or absurd: a plain use, never a wrong one
        if position is None:
            event = intent_bytes.allocated(self.timestamp(), field, state.intent_rest)
        else:
            event = intent_bytes.scoped_allocated(self.timestamp(), field, state.intent_rest, state.scope_tail, position)
        buffer = self._buffer  # after timestamp(), which may have applied (and replaced) it
        buffer.append(event)
        if len(buffer) >= FLUSH_EVENTS:
            self.apply()

    def remove(self, key: Any) -> None:
        entry = self.entries.pop(key)
        del self.by_id[entry[1]]
        self.held.discard(key)
        self.record(intent_bytes.freed(self.timestamp(), (entry[2],)))

    def touch(self, keys: Iterable[Any], req_context: Any) -> None:
        self._access(list(keys), req_context)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[Any]],
        insertion_only_keys: set[Any],
        reused_keys: set[Any],
        req_context: Any,
    ) -> tuple[list[Any], dict[Any, int] | None]:
        """The request is done with its chunks: every resident one, tail first (vLLM's LRU
        makes the head the most recent). The chunks it loaded (``reused_keys``) go as reads,
        the rest (stored, or kept from before) as refreshes: used, not read, so a policy
        that counts reuse (arc) does not count them, and recency is vLLM LRU's exactly
        (each run of one kind is one event, in order). Then the request's scope ends.
        Returns the request's keys head to tail and their token positions (None when some
        key has none): the shadows replay them."""
        entries = self.entries
        runs: list[tuple[bool, list[bytes]]] = []
        order, positions = prefix_order(key_groups, req_context)
        for key in reversed(order):
            entry = entries.get(key)
            if entry is None:
                continue
            read = key in reused_keys
            if runs and runs[-1][0] == read:
                runs[-1][1].append(entry[2])
            else:
                runs.append((read, [entry[2]]))
        intent = self.request_intent(req_context)
        if not runs and not intent.scope_field:
            return order, positions
        ts = self.timestamp()
        self._hint_updates(ts, intent, [field for _, fields in runs for field in fields])
        if not runs:
            self.record(intent_bytes.ending_accessed(ts, (), intent.scope_field))
            return order, positions
        last = len(runs) - 1
        for i, (read, fields) in enumerate(runs):
            self.record(intent_bytes.ending_accessed(ts, fields, intent.scope_field if i == last else b"", refresh_only=not read))
        return order, positions

    def on_request_access(self, keys: Iterable[Any], req_context: Any) -> None:
        """The request's chunks are used while it runs: a scoped access (the request id as
        the scope) of the resident ones that have a token position, with their positions,
        tail first (ties: by key). vLLM's LRU ranks them (request rank, -position), raising
        only; so does kvbroker's lru with a scoped use. Sent even when no chunk qualifies:
        the request's first call takes its rank, in vLLM and in the scope alike."""
        intent = self.request_intent(req_context)
        if not intent.scope_field:
            return  # no request id, no scope: vLLM ranks it, but nothing can name it here
        position = getattr(req_context, "get_offload_key_position", None)
        entries = self.entries
        placed = [(at, key) for key in keys if key in entries and (at := position(key)) is not None] if position is not None else []
        if placed and not all(0 <= at <= MAX_POSITION for at, _ in placed):
            # Negative or absurd positions: those keys go as keys with no position do (left
            # out of the scoped use), never at a wrong one.
            kept = [(at, key) for at, key in placed if 0 <= at <= MAX_POSITION]
            self.stats.positions_ignored += len(placed) - len(kept)
            placed = kept
        # Tails first, then by key bytes (vLLM's order of equal ranks).
        placed.sort(key=lambda p: (-p[0], p[1]))
        fields = [entries[key][2] for _, key in placed]
        ts = self.timestamp()
        self._hint_updates(ts, intent, fields)
        self.record(intent_bytes.scoped_accessed(ts, fields, intent.scope_field, [at for at, _ in placed]))

    def _access(self, keys: list[Any], req_context: Any) -> None:
        """An access of ``keys`` (head first): the last is read first, so the first ends
        the most recent, as in vLLM's own touch."""
        entries = self.entries
        fields = [entry[2] for key in reversed(keys) if (entry := entries.get(key)) is not None]
        if not fields:
            return
        ts = self.timestamp()
        intent = self.request_intent(req_context)
        self._hint_updates(ts, intent, fields)
        self.record(intent_bytes.accessed(ts, fields))

    def _hint_updates(self, ts: bytes, intent: RequestIntent, fields: list[bytes]) -> None:
        """A hinted request's intent reaches the chunks it uses: ``intent_updated`` for each
        (once), before the use."""
        if intent.update_rest:
            for field in dict.fromkeys(fields):
                self.record(intent_bytes.updated(ts, field, intent.update_rest))

    def mark_evictable(self, key: Any) -> None:
        self.held.discard(key)

    def mark_non_evictable(self, key: Any) -> None:
        self.held.add(key)

    def evict(self, n: int, protected: Iterable[Any]) -> list[tuple[Any, Any]] | None:
        """Exactly ``n`` (key, chunk) victims, none protected nor held, or None (no change);
        ``n`` <= 0 asks for none: [] (vLLM's LRU answers a negative count so too)."""
        if n <= 0:
            return []
        if self.reload_due:
            self.reload_now()  # a switch is in force from the next decision on
        stats = self.stats
        stats.evictions_asked += 1
        entries = self.entries
        shielded = [entry[1] for key in protected if (entry := entries.get(key)) is not None]
        shielded += [entries[key][1] for key in self.held]
        try:
            victims = self.decider.evict(n, shielded)
        except Exception:
            stats.errors += 1
            log.exception("kvbroker: the eviction decision failed; the store is refused")
            victims = None
        by_id = self.by_id
        if victims is not None and not self._acceptable(victims, n, shielded):
            stats.errors += 1
            log.error("kvbroker: the decider named victims vLLM cannot evict (%d asked): %s; the store is refused", n, victims[:8])
            victims = None
        if victims is None:
            stats.evictions_refused += 1
            return None
        out = []
        fields = []
        for block_id in victims:
            key = by_id.pop(block_id)
            chunk, _, field = entries.pop(key)
            out.append((key, chunk))
            fields.append(field)
        stats.chunks_evicted += n
        # vLLM forgets the victims: so does the local core, first thing in the next batch.
        self.record(intent_bytes.freed(self.timestamp(), fields))
        return out

    def _acceptable(self, victims: list[str], n: int, shielded: list[str]) -> bool:
        """Exactly ``n`` distinct chunks vLLM holds, none shielded (a decider is trusted with
        nothing: a remote one may be out of step)."""
        if len(victims) != n or len(set(victims)) != n:
            return False
        by_id = self.by_id
        if any(v not in by_id for v in victims):
            return False
        return not set(victims).intersection(shielded)

    def clear(self) -> None:
        self._buffer = []  # the clear drops every block: nothing buffered matters any more
        self.entries.clear()
        self.by_id.clear()
        self.held.clear()
        self._generation += 1
        self.record(intent_bytes.cleared(self.timestamp()))


def prefix_order(key_groups: Sequence[Sequence[Any]], req_context: Any) -> tuple[list[Any], dict[Any, int] | None]:
    """A request's keys in one head-to-tail order: the groups' keys, sorted by their token
    position when the request knows every key's position, else as given; and the positions
    (None when some key has none)."""
    keys = [key for group in key_groups for key in group]
    position = getattr(req_context, "get_offload_key_position", None)
    if position is None:
        return keys, None
    where = {}
    for key in keys:
        at = position(key)
        if at is None:
            return keys, None
        where[key] = at
    keys.sort(key=where.__getitem__)
    return keys, where
