"""The deterministic core: residency of every block across tiers, pins, capacity,
the demotion cascade, prefetch, directives and their acks.

The live broker and replay run this same code. It is a pure function of
(config, ordered event stream): time comes only from event timestamps (``clock``), never
from the wall clock, and nothing is random. It knows no protobuf; ``broker.model.apply``
translates events into the calls below.

Every operation either raises ``EventError`` before changing anything, or completes.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from enum import IntEnum
from typing import Final

from mypy_extensions import mypyc_attr

from broker.config import QUANT, ConfigError, CoreConfig
from broker.model.stats import CoreStats
from policies.base import DROPPED, Block, Clock, FutureUses, Policy, PolicyContext, PolicyError, Priority, TierInfo, untrack, wants_pin
from policies.registry import make_params, policy_class

_DECODE_CRITICAL: Final = int(Priority.DECODE_CRITICAL)


class DirectiveKind(IntEnum):
    """Numbers equal kvbroker.v1.DirectiveKind."""

    EVICT = 1
    DEMOTE = 2
    PROMOTE = 3
    PREFETCH = 4


_KIND_NAMES: Final = {kind: kind.name.lower() for kind in DirectiveKind}
# Open request scopes kept at most per client (a client that never ends its scopes must not
# grow the policies' orders without bound): past it, that client's oldest open scope ends.
# An engine has far fewer requests running at once (vLLM's max_num_seqs is at most a few
# thousand), so an engine is never cut short: its scoped events all apply, as vLLM's do.
MAX_OPEN_SCOPES: Final = 65_536
# And per tenant (the clients of one tenant together: several engines, or ranks): past it,
# that tenant's oldest open scope ends. Never another tenant's (issue 33, item 8).
MAX_OPEN_SCOPES_PER_TENANT: Final = 4 * MAX_OPEN_SCOPES
# No count bound on the ghosts (history.max_ghosts = 0): more than any dict holds.
MAX_GHOST_COUNT: Final = 2**62
# A scoped access without positions (every block at position 0); read only. One object, so
# that a plain access (the hot path) makes no dict.
_NO_POSITIONS: Final[dict[str, int]] = {}


class EventError(Exception):
    """An event cannot be applied; names the field and the reason. Nothing was changed."""

    def __init__(self, field: str, reason: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
        self.code = code

    def __reduce__(self) -> tuple[type[EventError], tuple[str, str, str]]:
        # Pickled by its fields (a replay worker's error crosses to the parent process);
        # Exception's default would call __init__ with the one formatted message.
        return (EventError, (self.field, self.reason, self.code))


# Copyable when compiled (a shadow starts from a copy of the core): see policies.base.Block.
# A plain class, not a dataclass: compiled, a dataclass's generated __init__ stays
# interpreted (a generic setattr per field, 11 per directive, measured in a replay).
@mypyc_attr(allow_interpreted_subclasses=True)
class Directive:
    __slots__ = (
        "directive_id",
        "kind",
        "block_id",
        "from_tier",
        "to_tier",
        "policy",
        "score",
        "reason",
        "arrive_by_us",
        "size",
        "generation",
    )

    def __init__(
        self,
        directive_id: int,
        kind: DirectiveKind,
        block_id: str,
        from_tier: str,
        to_tier: str,
        policy: str,
        score: float,
        reason: str,
        arrive_by_us: int,
        size: int,
        generation: int,
    ) -> None:
        self.directive_id = directive_id
        self.kind = kind
        self.block_id = block_id
        self.from_tier = from_tier
        self.to_tier = to_tier
        self.policy = policy
        self.score = score
        self.reason = reason
        self.arrive_by_us = arrive_by_us
        self.size = size
        self.generation = generation

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Directive) and self.key() == other.key() and self.generation == other.generation

    def __repr__(self) -> str:
        return (
            f"Directive({self.directive_id}, {self.kind.name}, {self.block_id!r}, {self.from_tier!r} -> {self.to_tier!r}, "
            f"policy={self.policy!r}, score={self.score}, reason={self.reason!r}, arrive_by_us={self.arrive_by_us}, "
            f"size={self.size}, generation={self.generation})"
        )

    def key(self) -> tuple[object, ...]:
        """Everything that identifies what was decided; equal keys mean equal directives."""
        return (
            self.directive_id,
            int(self.kind),
            self.block_id,
            self.from_tier,
            self.to_tier,
            self.policy,
            self.score,
            self.reason,
            self.arrive_by_us,
            self.size,
        )


@mypyc_attr(allow_interpreted_subclasses=True)  # copyable when compiled: see policies.base.Block
class TierState:
    """One tier at run time: its limits, what it holds, and its policy instance."""

    __slots__ = ("blocks", "capacity", "high_bytes", "index", "info", "low_bytes", "name", "pinned_bytes", "policy", "used")

    def __init__(self, info: TierInfo, high: float, low: float, policy: Policy) -> None:
        self.info = info
        self.index = info.index
        self.name = info.name
        self.capacity = info.capacity_bytes
        self.high_bytes = int(info.capacity_bytes * high)
        self.low_bytes = int(info.capacity_bytes * low)
        self.used = 0
        self.blocks = 0
        self.pinned_bytes = 0
        self.policy = policy


@mypyc_attr(allow_interpreted_subclasses=True)  # copyable when compiled: see policies.base.Block
class RequestBlocks:
    """The ids of one request's blocks (``Core.by_request``), for ``Core.request_blocks``.

    A list with lazy deletion, not a set: a set costs about 45 bytes a block (a table of
    16-byte slots at most 60% full, and the set object), this list 8 and its spare room.
    ``ids`` holds every live block of the request at least once, and may still hold ids
    that left it (freed, or taken by another request in a prefix reuse) or repeat one
    that left and came back. ``live`` counts the request's live blocks; when ``ids`` grows
    past twice that, the core drops what left (``Core._unindex_request``): each id dropped
    was appended once, so that is amortised O(1), and ``ids`` stays O(blocks of the request).
    """

    __slots__ = ("ids", "live")

    def __init__(self) -> None:
        self.ids: list[str] = untrack([])
        self.live = 0


@mypyc_attr(allow_interpreted_subclasses=True)  # copyable when compiled: see policies.base.Block
class ClientScopes:
    """The open scopes of one client (``Core.client_scopes``), oldest first, and the
    tenant it acts for: its ``cleared`` ends its own scopes without looking at any other
    client's, and its cap ends its own oldest."""

    __slots__ = ("tenant", "requests")

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        # An OrderedDict: dropping the oldest of a plain dict walks every slot deleted before it.
        self.requests: OrderedDict[str, None] = OrderedDict()


@mypyc_attr(allow_interpreted_subclasses=True)  # copyable when compiled: see policies.base.Block
class OwnedBlocks:
    """The ids of the blocks one client owns (``Core.by_owner``), so that its ``cleared``
    costs its own blocks, not a scan of every tenant's.

    Lazy deletion, as RequestBlocks: ``ids`` holds every live block of the owner at least
    once, in the order it came to own them, and may hold ids that left (freed, or taken by
    another owner in a prefix reuse); ``live`` counts the owner's live blocks, and ``ids``
    is compacted when it grows past twice that (amortised O(1) per block)."""

    __slots__ = ("ids", "live")

    def __init__(self) -> None:
        self.ids: list[str] = untrack([])
        self.live = 0


@mypyc_attr(allow_interpreted_subclasses=True)  # copyable when compiled: see policies.base.Block
class Core:
    """Residency state plus one policy instance per tier."""

    def __init__(
        self,
        config: CoreConfig,
        *,
        generation: int = 1,
        future_uses: dict[str, list[int]] | None = None,
        ablate_intent: bool = False,
    ) -> None:
        """``future_uses`` (block id -> ordinals of the events that use it) is given by
        replay only; offline policies such as belady need it and are refused without it.
        ``ablate_intent`` (replay only) hides every field the engine asserts about a block's
        future from the model and its policies (broker.model.apply lists them) while reports
        still count against them."""
        self.config = config
        self.ablate_intent = ablate_intent
        # In an ablation: block id -> (slack_us, recompute_cost_us) the engine said, which
        # the cost model and the deadline count still use (the blocks carry none).
        self.hidden: dict[str, tuple[int | None, int | None]] = {}
        self.generation = generation
        self.clock = Clock()
        self._future_uses = future_uses
        self.tiers = self._build_tiers(config)
        self.tier_index = {t.name: t.index for t in self.tiers}
        self.blocks: dict[str, Block] = {}
        self.by_request: dict[str, RequestBlocks] = {}
        self.by_owner: dict[str, OwnedBlocks] = {}
        self.client_seq: dict[str, int] = {}
        # Open request scopes (BlocksAccessed.scope): (client, request) -> the scope's rank,
        # the index of the event that opened it (every tier's policy learns of it then).
        self.scopes: dict[tuple[str, str], int] = {}
        # Ghosts: the history of freed blocks, block id -> (reads, reuses, size), oldest
        # first, at most config.history_ghosts x the tiers' capacity in bytes. A block id
        # names content (a prefix hash), so an engine that frees what it evicts and stores
        # it again later (vLLM's CPU tier) brings back the same block: with its ghost, that
        # store is a re-reference, as it is in a replay where the dropped block stays known.
        self.ghosts: OrderedDict[str, tuple[int, int, int]] = OrderedDict()
        # Block id -> the rank of the last request scope that used it: a request's first
        # scoped use of a block it did not store is a prefix reuse (vLLM's reused chunk),
        # counted once per request as a prompt bringing a cached block again is in replay.
        self._scope_use: dict[str, int] = {}
        self._ghost_bytes = 0
        self._ghost_limit = 0
        # history.max_ghosts (0: none): a bound on the count too, so that 1-byte blocks
        # cannot make the bytes bound mean billions of entries.
        self._ghost_count_limit = 0
        # The same scopes by client and by tenant, oldest first, for the caps and a client's
        # clear (O(its own scopes); one with none: O(1)).
        self.client_scopes: dict[str, ClientScopes] = {}
        self.tenant_scopes: dict[str, OrderedDict[tuple[str, str], None]] = {}
        # The caps (MAX_OPEN_SCOPES, MAX_OPEN_SCOPES_PER_TENANT); attributes so that a test
        # can make them small.
        self.max_scopes_per_client: int = MAX_OPEN_SCOPES
        self.max_scopes_per_tenant: int = MAX_OPEN_SCOPES_PER_TENANT
        # limits.max_clock_skew_us: per tenant, the least (ts_us - received_us) of its events
        # that moved the clock; an event may run at most the skew ahead of its tenant's.
        self.time_anchor: dict[str, int] = {}
        # The least of time_anchor's values (anchors only ever go down), so that a tenant's
        # first event is checked in O(1), not O(tenants) (issue 33, item 9).
        self.least_anchor: int = 0
        # Tenants batches act for (IntentBatch.tenant, when set), counted as client_seq
        # gains a key (broker.model.apply): client id -> its tenants, tenant -> its client
        # ids. broker.service.limits bounds them (limits.max_tenants_per_client, max_tenants).
        self.client_tenants: dict[str, int] = {}
        self.tenant_clients: dict[str, int] = {}
        # Blocks per tenant while limits.max_blocks_per_tenant is set (broker.service.limits keeps it).
        self.tenant_blocks: dict[str, int] | None = None
        self.stats = CoreStats(len(self.tiers))
        # Directives decided but not yet acknowledged: id -> block id, oldest first. An
        # OrderedDict: dropping the oldest of a plain dict (next(iter(d))) walks every slot
        # deleted before it, O(n) per directive once the limit is reached.
        self.outstanding: OrderedDict[int, str] = OrderedDict()
        self._next_directive = 1
        self._out: list[Directive] = []
        # Prefetch: (latest start time, tiebreak, version, block id); stale entries skipped.
        self._prefetch_heap: list[tuple[float, int, int, str]] = []
        self._heap_seq = 0
        self._channels: list[list[int]] = []
        self._settle(config)

    def _build_tiers(self, config: CoreConfig) -> list[TierState]:
        """Tier states with fresh policy instances for ``config`` (nothing else changes)."""
        cls = policy_class(config.policy.name)
        if cls.offline and self._future_uses is None:
            raise PolicyError(f"policy {cls.name} needs the future of the stream: it runs in replay only, not live")
        params = make_params(cls, config.policy.params)
        infos = tuple(t.info(i) for i, t in enumerate(config.tiers))
        future = FutureUses(self._future_uses, self.clock) if self._future_uses is not None and cls.offline else None
        return [
            TierState(info, t.high_watermark, t.low_watermark, cls(PolicyContext(info, infos, self.clock, future), params))
            for info, t in zip(infos, config.tiers, strict=True)
        ]

    def _settle(self, config: CoreConfig) -> None:
        """Derive what depends on the config and its policy (at start and on reconfigure)."""
        self.config = config
        self.policy_name = type(self.tiers[0].policy).name or config.policy.name
        # Cost model: per source tier, when each copy channel is next free (a min-heap).
        # A reconfigure keeps the copies already booked on channels that remain.
        old = self._channels
        self._channels = [(old[i] if i < len(old) else []) for i in range(len(config.tiers))]
        for i, t in enumerate(config.tiers):
            channels = sorted(self._channels[i])[-t.channels :] if self._channels[i] else []
            channels += [0] * (t.channels - len(channels))
            heapq.heapify(channels)
            self._channels[i] = channels
        self._scale, self._dequant_us = QUANT[config.quant]
        self._ghost_limit = int(config.history_ghosts * sum(t.capacity_bytes for t in config.tiers))
        self._ghost_count_limit = config.history_max_ghosts if config.history_max_ghosts > 0 else MAX_GHOST_COUNT
        self._trim_ghosts()
        top = self.tiers[0].policy
        self._prefetching = type(top).admit_prefetch is not Policy.admit_prefetch
        self._proposing = type(top).after_access is not Policy.after_access
        self._access_many = type(top).access_many is not Policy.access_many
        self._drop_hook = [type(t.policy).prefer_drop is not Policy.prefer_drop for t in self.tiers]
        self._incoming_hook = [type(t.policy).incoming is not Policy.incoming for t in self.tiers]
        # A deadline change needs the general update path only if some policy reorders on
        # updates or prefetch watches deadlines.
        self._plain_deadlines = not self._prefetching and all(type(t.policy).update is Policy.update for t in self.tiers)

    def follow(self, config: CoreConfig, generation: int) -> None:
        """A config change met in a stream (live reload, replay, recovery): reconfigure only
        if it differs from the one in force (a restarted broker journals its config again)."""
        if config != self.config:
            self.reconfigure(config, generation)
        else:
            self.generation = generation

    def reconfigure(self, config: CoreConfig, generation: int) -> None:
        """Apply a new config between batches: limits, costs and policy may change; the
        tiers (names, order) may not, and no tier may shrink below what it holds now.
        A new policy is warmed from the current residency (least recently used first).
        Raises ConfigError, naming the key, and then changes nothing."""
        old_names = [t.name for t in self.tiers]
        new_names = [t.name for t in config.tiers]
        if old_names != new_names:
            raise ConfigError(f"tiers: the tier list {old_names} cannot change while running (got {new_names}); restart the broker")
        for i, (tier, tc) in enumerate(zip(self.tiers, config.tiers, strict=True)):
            if tc.capacity_bytes < tier.used:
                raise ConfigError(
                    f"tiers[{i}].capacity: {tc.capacity_bytes} is below the {tier.used} bytes tier {tier.name!r} holds now; "
                    "shrink it after blocks leave"
                )
        try:
            tiers = self._build_tiers(config)
        except PolicyError as exc:
            raise ConfigError(f"policy.name: {exc}") from exc
        for new, old in zip(tiers, self.tiers, strict=True):
            new.used, new.blocks, new.pinned_bytes = old.used, old.blocks, old.pinned_bytes
        resident = sorted(
            (b for b in self.blocks.values() if b.tier != DROPPED and not b.pinned), key=lambda b: (b.last_access_us, b.block_id)
        )
        for block in resident:
            tiers[block.tier].policy.insert(block)
        self.tiers = tiers
        self.generation = generation
        self._settle(config)
        # Deadlines the old policy did not watch may matter to the new one.
        self._prefetch_heap = []
        if self._prefetching:
            for block in self.blocks.values():
                if block.deadline_us is not None and block.tier > 0:
                    self._push_prefetch(block)

    # ---- time and directives -------------------------------------------------------------

    def advance(self, ts_us: int) -> None:
        """Move event time forward (it never goes back: clients' clocks may interleave), and
        first promote the blocks whose prefetch start time has come."""
        if ts_us > self.clock.now_us:
            self.clock.now_us = ts_us
            heap = self._prefetch_heap
            if heap and heap[0][0] <= ts_us:
                self.run_prefetch()

    def take_directives(self) -> list[Directive]:
        out, self._out = self._out, []
        return out

    def _emit(self, kind: DirectiveKind, block: Block, src: int, dst: int, score: float, reason: str, arrive_by: int = 0) -> None:
        did = self._next_directive
        self._next_directive += 1
        tiers = self.tiers
        self._out.append(
            Directive(
                did,
                kind,
                block.block_id,
                tiers[src].name if src >= 0 else "",
                tiers[dst].name if dst >= 0 else "",
                self.policy_name,
                score,
                reason,
                arrive_by,
                block.size,
                self.generation,
            )
        )
        self.stats.directives[_KIND_NAMES[kind]] += 1
        outstanding = self.outstanding
        outstanding[did] = block.block_id
        if len(outstanding) > self.config.max_outstanding_directives:
            outstanding.popitem(last=False)

    # ---- tier membership -----------------------------------------------------------------

    def _attach(self, block: Block, t: int) -> None:
        """Place a block in tier t (room already made)."""
        tier = self.tiers[t]
        block.tier = t
        tier.used += block.size
        tier.blocks += 1
        if block.pinned:
            tier.pinned_bytes += block.size
        else:
            tier.policy.insert(block)
        if self._prefetching and block.deadline_us is not None and t > 0:
            self._push_prefetch(block)

    def _detach(self, block: Block, *, as_victim: bool = False) -> None:
        """Take a block out of its tier's accounting and policy."""
        t = block.tier
        if t == DROPPED:
            return
        tier = self.tiers[t]
        tier.used -= block.size
        tier.blocks -= 1
        if block.pinned:
            tier.pinned_bytes -= block.size
        elif as_victim:
            tier.policy.evicted(block)
        else:
            tier.policy.remove(block)
        block.tier = DROPPED

    def _make_room(
        self,
        t: int,
        block: Block,
        protected: AbstractSet[str],
        admit: Callable[[list[Block]], bool] | None = None,
    ) -> bool:
        """Make tier t able to take ``block``'s bytes, evicting per its policy (told which
        block arrives first, if it asks: ``Policy.incoming``).

        Over the high watermark, victims are taken until the tier is under the low one; if
        the policy cannot find that much, just enough to fit. Atomic: either the room is made
        (and ``admit``, when given, accepted the victims) or nothing changes.
        """
        tier = self.tiers[t]
        after = tier.used + block.size
        if after <= tier.high_bytes:
            # Nothing must leave, but a prefetch is still the policy's call (its own rules,
            # e.g. the engine's prefetch_ok, apply with or without victims).
            return admit([]) if admit is not None else True
        if self._incoming_hook[t]:
            tier.policy.incoming(block)
        victims = tier.policy.choose_victims(after - tier.low_bytes, protected)
        if victims is None:
            need = after - tier.capacity
            if need <= 0:
                return admit([]) if admit is not None else True
            victims = tier.policy.choose_victims(need, protected)
            if victims is None:
                return False
        if admit is not None and not admit(victims):
            return False
        for victim in victims:
            self._displace(victim, t, protected)
        return True

    def _displace(self, victim: Block, t: int, protected: AbstractSet[str]) -> None:
        """A victim leaves tier t: demoted to the next lower tier that can take it, else dropped.

        ``protected`` stays protected down the cascade, so a block being moved up is never
        pushed out of the tier it is leaving by the blocks coming down.
        """
        policy = self.tiers[t].policy
        score = policy.score(victim)
        drop = self._drop_hook[t] and policy.prefer_drop(victim)
        self._detach(victim, as_victim=True)
        for d in range(t + 1, 0 if drop else len(self.tiers)):
            if victim.allowed_in(d) and self._make_room(d, victim, protected):
                self._attach(victim, d)
                stats = self.stats
                stats.demotions += 1
                stats.bytes_down += victim.size
                self._emit(DirectiveKind.DEMOTE, victim, t, d, score, "over high watermark")
                return
        self.stats.evictions += 1
        reason = "recompute cheaper than reload" if drop else "over high watermark; no lower tier"
        self._emit(DirectiveKind.EVICT, victim, t, DROPPED, score, reason)

    def choose_count(self, t: int, count: int, protected: AbstractSet[str]) -> list[Block]:
        """Exactly ``count`` victims of tier t's policy, none in ``protected``, changing
        nothing (EvictionRequested); raises EventError naming how many could be chosen.

        Policies choose by bytes: asked for ``count`` bytes, they name at most ``count``
        blocks (every block has at least one byte), exactly ``count`` when those blocks are of
        one byte, as the vLLM adapter's chunks are: one call, O(victims + protected stepped
        over). With larger blocks, the policy is asked for every evictable byte and the first
        ``count`` of its choice are taken (O(the tier), only then)."""
        if count <= 0:
            return []
        policy = self.tiers[t].policy
        victims = policy.choose_victims(count, protected)
        if victims is not None and len(victims) == count:
            return victims
        blocks = self.blocks
        shielded = [b for b in protected if b in policy]
        available = len(policy) - len(shielded)
        if available >= count:
            free_bytes = self.tiers[t].used - self.tiers[t].pinned_bytes - sum(blocks[b].size for b in shielded)
            victims = policy.choose_victims(free_bytes, protected)
            if victims is not None and len(victims) >= count:
                return victims[:count]
            available = len(victims) if victims is not None else 0
        raise EventError(
            "eviction_requested.count",
            f"{count} victims asked in tier {self.tiers[t].name!r}, only {available} can be chosen "
            f"({len(policy)} evictable, {len(shielded)} of them protected); nothing was evicted",
            "RESOURCE_EXHAUSTED",
        )

    def evict_chosen(self, t: int, victims: list[Block]) -> None:
        """Drop victims ``choose_count`` named in tier t (EVICT directives, never a demotion:
        the engine needs the room in this tier now)."""
        policy = self.tiers[t].policy
        stats = self.stats
        for victim in victims:
            score = policy.score(victim)
            self._detach(victim, as_victim=True)
            stats.evictions += 1
            self._emit(DirectiveKind.EVICT, victim, t, DROPPED, score, "eviction requested by the engine")

    def _move(self, block: Block, t: int, protected: AbstractSet[str]) -> bool:
        """Move a block into tier t if room can be made there; True if moved."""
        if not self._make_room(t, block, protected):
            return False
        self._detach(block)
        self._attach(block, t)
        return True

    def _top_allowed(self, block: Block) -> int:
        if not block.allowed_mask:
            return 0
        for t in range(len(self.tiers)):
            if block.allowed_in(t):
                return t
        return DROPPED

    # ---- events --------------------------------------------------------------------------

    def known(self, block_id: str, field: str) -> Block:
        block = self.blocks.get(block_id)
        if block is None:
            raise EventError(field, f"unknown block {block_id!r}", "FAILED_PRECONDITION")
        return block

    def resolve_tier(self, name: str, field: str, *, empty: int = 0) -> int:
        if not name:
            return empty
        t = self.tier_index.get(name)
        if t is None:
            raise EventError(field, f"unknown tier {name!r} (tiers: {', '.join(self.tier_index)})")
        return t

    def allocate(self, block: Block, t: int, *, reuse: bool = False) -> None:
        """A new block in tier t, a released cached block taken again (prefix reuse), or,
        with ``reuse``, one more reference to a block still referenced (shared prefix)."""
        existing = self.blocks.get(block.block_id)
        if existing is not None:
            if existing.released:
                self._reuse(existing, block)
            elif reuse:
                self._share(existing, block)
            else:
                raise EventError(
                    "allocated.intent.block_id",
                    f"block {block.block_id!r} is already allocated (release or free it first, or set reuse)",
                    "ALREADY_EXISTS",
                )
            return
        if self._scale != 1.0:
            block.size = max(1, int(block.size * self._scale))
        self.stats.prompt_blocks += 1
        if not block.allowed_in(t):
            raise EventError("allocated.tier", f"tier {self.tiers[t].name!r} is not in the block's allowed_tiers")
        ghost = self.ghosts.pop(block.block_id, None) if self.ghosts else None
        if ghost is not None:
            self._revive(block, ghost)
        if not self._make_room(t, block, {block.block_id}):
            if ghost is not None:  # refused: the history stays a ghost
                self.ghosts[block.block_id] = ghost
                self._ghost_bytes += ghost[2]
                self.stats.reuses -= 1
            tier = self.tiers[t]
            raise EventError(
                "allocated.tier",
                f"tier {tier.name!r} is full: {tier.used} of {tier.capacity} bytes used, "
                f"{tier.pinned_bytes} pinned, nothing evictable for {block.size} more",
                "RESOURCE_EXHAUSTED",
            )
        block.created_us = block.last_access_us = self.clock.now_us
        block.pinned = wants_pin(block)
        self.blocks[block.block_id] = block
        self._index_request(block)
        self._index_owner(block)
        self._attach(block, t)
        self._link(block)
        self.stats.allocated_bytes += block.size

    def _reuse(self, block: Block, intent: Block) -> None:
        """Prefix reuse: a cached block gets a new owner and intent, and counts as an access."""
        was_pinned = block.pinned
        old_request = block.request_id
        old_owner = block.owner
        relink = block.parent_id != intent.parent_id
        if relink:
            self._unlink(block)
        _take_intent(block, intent)
        if relink:
            self._link(block)
        if block.request_id != old_request:
            self._unindex_request(old_request)
            self._index_request(block)
        if block.owner != old_owner:
            self._unindex_owner(old_owner)
            self._index_owner(block)
        block.released = False
        block.refs = 1
        self._repin(block, was_pinned)
        self._count_prefix_use(block)
        self._touch(block, {block.block_id})
        if self._prefetching and block.deadline_us is not None and block.tier > 0:
            self._push_prefetch(block)

    def _share(self, block: Block, intent: Block) -> None:
        """Another reference to a live block: the most demanding intent of its users wins."""
        was_pinned = block.pinned
        old_deadline = block.deadline_us
        block.refs += 1
        block.priority = max(block.priority, intent.priority)
        block.request_priority = max(block.request_priority, intent.request_priority)
        block.pin_requested = block.pin_requested or intent.pin_requested
        if intent.deadline_us is not None and (block.deadline_us is None or intent.deadline_us < block.deadline_us):
            block.deadline_us = intent.deadline_us
        block.critical = block.critical or intent.critical
        if intent.due_us is not None and (block.due_us is None or intent.due_us < block.due_us):
            block.due_us = intent.due_us
        if not self._repin(block, was_pinned):
            self._intent_changed(block)
        self._count_prefix_use(block)
        self._touch(block, {block.block_id})
        self._deadline_moved(block, old_deadline)

    def _count_scoped_reuse(self, blocks: list[Block], rank: int) -> None:
        """A request (the scope of ``rank``) uses cached blocks: each one it has not used
        or stored yet is reused once more, before its policy hears of the use."""
        uses = self._scope_use
        reused = 0
        for block in blocks:
            bid = block.block_id
            if uses.get(bid, -1) != rank:
                uses[bid] = rank
                block.reuses += 1
                reused += 1
        self.stats.reuses += reused

    def _revive(self, block: Block, ghost: tuple[int, int, int]) -> None:
        """A freed block stored again: its history comes back, and the store counts as
        a replay's reuse of a dropped block does (one more reuse, one more read: the
        engine recomputed it), before any policy sees the block."""
        self._ghost_bytes -= ghost[2]
        block.accesses = ghost[0] + 1
        block.reuses = ghost[1] + 1
        self.stats.reuses += 1

    def _bury(self, block: Block) -> None:
        """File a freed block's history as a ghost (the newest), within the bound."""
        ghosts = self.ghosts
        bid = block.block_id
        old = ghosts.pop(bid, None)
        if old is not None:
            self._ghost_bytes -= old[2]
        ghosts[bid] = (block.accesses, block.reuses, block.size)
        self._ghost_bytes += block.size
        if self._ghost_bytes > self._ghost_limit or len(ghosts) > self._ghost_count_limit:
            self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        """Forget the oldest ghosts until they fit both bounds (bytes, count)."""
        ghosts = self.ghosts
        while ghosts and (self._ghost_bytes > self._ghost_limit or len(ghosts) > self._ghost_count_limit):
            self._ghost_bytes -= ghosts.popitem(last=False)[1][2]

    def _count_prefix_use(self, block: Block) -> None:
        """A prompt brought a block the broker already had: a prefix hit if still resident."""
        stats = self.stats
        block.reuses += 1
        stats.reuses += 1
        stats.prompt_blocks += 1
        if block.tier == 0:
            stats.prefix_hits_top += 1
        if block.tier != DROPPED:
            stats.prefix_hits_any += 1

    def access(
        self,
        blocks: list[Block],
        next_use_us: int | None = None,
        scope: tuple[str, str] | None = None,
        positions: dict[str, int] | None = None,
    ) -> None:
        """A step read these blocks: each must be in its top allowed tier to be used.
        ``next_use_us``, when given, is their new deadline (the next step's time).
        ``scope`` (client, request) makes it a request-scoped use, at token ``positions``:
        a block already in its top allowed tier goes to its policy's ``access_scoped``; one
        brought there (a reload, a recompute) is a plain use. No block: the scope only
        takes its rank."""
        rank = -1 if scope is None else self.open_scope(scope)
        at: dict[str, int] = positions if positions is not None else _NO_POSITIONS
        stats = self.stats
        if scope is not None:
            self._count_scoped_reuse(blocks, rank)
        now = self.clock.now_us
        top = self.tiers[0].policy
        # A policy with its own access_many gets the step's hits in one call (in order, and
        # before any general-path read of this step, so it sees the same sequence).
        hot: list[Block] = []
        # Branch per block rather than call a bound method chosen once (``hot.append`` or
        # ``top.access``): compiled, ``hot.append(block)`` is a native list append, and a
        # bound method in a local was a generic call per block (plus the method object made
        # per event): 6.7% and 1.6% of ``apply_batch``'s instructions on the bench workload.
        many = self._access_many or scope is not None
        protected: set[str] | None = None
        # Scoped uses of blocks outside the top tier (already in their top allowed tier).
        elsewhere: list[Block] | None = None if scope is None else []
        # The hot path's counters, added to stats once per event (plain sums: nothing reads
        # them in between).
        hits = zero = dc_accesses = dc_misses = dl_accesses = dl_misses = 0
        try:
            for block in blocks:
                if block.tier or block.allowed_mask:
                    # Not a plain top-tier hit: the general path (it may move blocks, so the
                    # whole event's blocks are protected from being pushed out by it).
                    if hot:
                        if scope is None:
                            top.access_many(hot)
                        else:
                            top.access_scoped(hot, rank, at)
                        hot.clear()
                    if protected is None:
                        protected = {b.block_id for b in blocks}
                    self._touch(block, protected, elsewhere)
                    continue
                # The hot path, a hit in the top tier: the same accounting as _touch, inlined.
                block.accesses += 1
                block.last_access_us = now
                hits += 1
                if not block.pinned:
                    if many:
                        hot.append(block)
                    else:
                        top.access(block)
                ready = block.ready_us
                if ready > now:
                    latency = ready - now
                    if block.critical:
                        dc_accesses += 1
                        dc_misses += 1  # in the top tier, but its copy is still in flight
                    stats.record_latency(latency)
                else:
                    latency = 0
                    zero += 1
                    if block.critical:
                        dc_accesses += 1
                due = block.due_us
                if due is not None:
                    dl_accesses += 1
                    if now + latency > (due if due > now else now) + self._slack(block):
                        dl_misses += 1
            if scope is not None:
                if hot:
                    top.access_scoped(hot, rank, at)
                if elsewhere:
                    for block in elsewhere:
                        self.tiers[block.tier].policy.access_scoped([block], rank, at)
            elif hot:
                top.access_many(hot)
        finally:
            # x[i] = x[i] + n, not x[i] += n: compiled, the augmented form is a generic
            # in-place add of two objects, this one an add of native ints.
            by_tier, hist = stats.accesses_by_tier, stats.latency_hist
            by_tier[0] = by_tier[0] + hits
            hist[0] = hist[0] + zero
            stats.dc_accesses += dc_accesses
            stats.dc_misses += dc_misses
            stats.deadline_accesses += dl_accesses
            stats.deadline_misses += dl_misses
        if next_use_us is not None:
            ablate = self.ablate_intent
            if self._plain_deadlines:
                # Nothing orders by deadline: set it without the general update path.
                for block in blocks:
                    block.due_us = next_use_us
                    if not ablate:
                        block.deadline_us = next_use_us
            else:
                # updated() (with _repin, _intent_changed, _deadline_moved) for each block,
                # written out: a decode step re-deadlines every block of its request, and the
                # calls cost deadline_edf's decode-mode replay about 15% (73k -> 62k events/s;
                # compiled, still about 10%: 65-78k against 61-68k, runs alternating on
                # 2026-11-23). It must change with updated().
                tiers = self.tiers
                prefetching = self._prefetching
                for block in blocks:
                    was_pinned = block.pinned
                    old_deadline = block.deadline_us
                    block.due_us = next_use_us
                    if not ablate:
                        block.deadline_us = next_use_us
                    # wants_pin(block), inlined: a deadline never changes it, but an ack or
                    # an earlier block of this event may have.
                    now_pinned = False if block.released else (block.pin_requested or block.priority == _DECODE_CRITICAL)
                    if now_pinned != was_pinned:
                        self._repin(block, was_pinned)
                    elif block.tier != DROPPED and not block.pinned:
                        tiers[block.tier].policy.update(block)
                    if prefetching and block.deadline_us != old_deadline and block.deadline_us is not None and block.tier > 0:
                        self._push_prefetch(block)
        if self._proposing:
            top = self.tiers[0].policy
            if protected is None:
                protected = {b.block_id for b in blocks}
            for block in blocks:
                for block_id in top.after_access(block):
                    candidate = self.blocks.get(block_id)
                    if candidate is not None and candidate.tier > 0 and block_id not in protected:
                        self._prefetch(candidate, "predicted next access", 0)

    def _transfer(self, src: int, size: int) -> int:
        """Book a copy out of tier ``src`` on its first free channel; returns when it ends."""
        channels = self._channels[src]
        start = max(self.clock.now_us, heapq.heappop(channels))
        end = start + int(self.tiers[src].info.transfer_us(size)) + self._dequant_us
        heapq.heappush(channels, end)
        return end

    def _touch(self, block: Block, protected: AbstractSet[str], scoped: list[Block] | None = None) -> None:
        """One read of a block: count where it was served from, what it cost, and bring it
        to its top allowed tier (the engine had to, to use it). ``scoped``: a request-scoped
        read, so a block already in its top allowed tier is added there for the caller to
        hand to its policy, instead of a plain access."""
        stats = self.stats
        now = self.clock.now_us
        block.accesses += 1
        block.last_access_us = now
        src = block.tier
        stats.accesses_by_tier[src] += 1
        critical = block.critical
        if critical:
            stats.dc_accesses += 1
        top = self._top_allowed(block)
        if src == top:
            latency = block.ready_us - now if block.ready_us > now else 0
            if critical and latency:
                stats.dc_misses += 1  # in the top tier, but its copy is still in flight
            if not block.pinned:
                if scoped is not None:
                    scoped.append(block)
                else:
                    self.tiers[src].policy.access(block)
        else:
            if critical:
                stats.dc_misses += 1
            if src == DROPPED:
                cost = self.hidden.get(block.block_id, (None, None))[1] if self.ablate_intent else block.recompute_cost_us
                latency = cost if cost is not None else self.config.recompute_us
            else:
                latency = self._transfer(src, block.size) - now
            block.ready_us = now + latency
            # A reload, or a recompute if it had been dropped.
            for t in range(top, len(self.tiers) if src == DROPPED else src):
                if block.allowed_in(t) and self._move(block, t, protected):
                    if src == DROPPED:
                        stats.recomputes += 1
                    else:
                        stats.bytes_up += block.size
                    break
            else:
                if src != DROPPED and not block.pinned:
                    self.tiers[src].policy.access(block)
        stats.record_latency(latency)
        due = block.due_us
        if due is not None:
            stats.deadline_accesses += 1
            # Late if the data is ready after the announced time (or after the access, if
            # the engine asked later than it announced), plus the slack it tolerates.
            if now + latency > (due if due > now else now) + self._slack(block):
                stats.deadline_misses += 1

    def _slack(self, block: Block) -> int:
        """The slack a deadline is judged with: the engine's, even when the policies are
        not told it (an ablation)."""
        if self.ablate_intent:
            return self.hidden.get(block.block_id, (None, None))[0] or 0
        return block.slack_us or 0

    def updated(self, block: Block, was_pinned: bool, old_deadline: int | None) -> None:
        """Intent changed: the caller has set the new fields (``was_pinned`` and
        ``old_deadline`` are what the block had before); pins and policy order follow."""
        if not self._repin(block, was_pinned):
            self._intent_changed(block)
        self._deadline_moved(block, old_deadline)

    def _repin(self, block: Block, was_pinned: bool) -> bool:
        """Follow a pin change in the tier's accounting; True if the pin state changed."""
        now_pinned = wants_pin(block)
        if now_pinned == was_pinned:
            return False
        block.pinned = now_pinned
        if block.tier != DROPPED:
            tier = self.tiers[block.tier]
            if now_pinned:
                tier.policy.remove(block)
                tier.pinned_bytes += block.size
            else:
                tier.pinned_bytes -= block.size
                tier.policy.insert(block)
        return True

    def release(self, blocks: list[Block]) -> None:
        """References dropped: blocks stay cached, unpinned and evictable."""
        for block in blocks:
            if block.released:
                continue
            block.refs -= 1
            if block.refs > 0:
                continue  # another request still holds the shared block
            was_pinned = block.pinned
            block.released = True
            if not self._repin(block, was_pinned):
                self._intent_changed(block)

    def free(self, blocks: list[Block]) -> None:
        """Blocks are gone; their bytes are free."""
        for block in blocks:
            if self.blocks.pop(block.block_id, None) is None:
                continue  # listed twice in one event
            if self.ablate_intent:
                self.hidden.pop(block.block_id, None)
            self._detach(block)
            self._unlink(block)
            self._unindex_request(block.request_id)
            self._unindex_owner(block.owner)
            block.heap_version += 1
            if self._scope_use:
                self._scope_use.pop(block.block_id, None)
            if self._ghost_limit:
                self._bury(block)

    def refresh(self, blocks: list[Block]) -> None:
        """Blocks used but not read (``BlocksAccessed.refresh_only``): the policy of each
        one's tier refreshes it (a pinned or dropped block is in no policy). Not an access:
        nothing is counted, nothing moves between tiers."""
        hot: list[Block] = []
        for block in blocks:
            t = block.tier
            if t == DROPPED or block.pinned:
                continue
            if t == 0:
                hot.append(block)
            else:
                self.tiers[t].policy.refresh([block])
        if hot:
            self.tiers[0].policy.refresh(hot)

    def open_scope(self, scope: tuple[str, str], tenant: str = "") -> int:
        """The rank of a request scope (client, request), opened now (at this event's index)
        if it is not open: every tier's policy learns of it. ``tenant``: the tenant the
        client acts for (its first scope's counts; broker.model.apply opens each scope with
        it). Past MAX_OPEN_SCOPES of the client, the client's oldest ends; past
        MAX_OPEN_SCOPES_PER_TENANT of its tenant, the tenant's oldest. O(1)."""
        rank = self.scopes.get(scope)
        if rank is None:
            client = scope[0]
            mine = self.client_scopes.get(client)
            if mine is None:
                mine = ClientScopes(tenant)
                self.client_scopes[client] = mine
            elif len(mine.requests) >= self.max_scopes_per_client:
                self.end_scope((client, next(iter(mine.requests))))
            theirs = self.tenant_scopes.get(mine.tenant)
            if theirs is None:
                theirs = OrderedDict()
                self.tenant_scopes[mine.tenant] = theirs
            elif len(theirs) >= self.max_scopes_per_tenant:
                self.end_scope(next(iter(theirs)))
            rank = self.clock.event_index
            self.scopes[scope] = rank
            # (Set again: an end above may have emptied and dropped them.)
            self.client_scopes[client] = mine
            self.tenant_scopes[mine.tenant] = theirs
            mine.requests[scope[1]] = None
            theirs[scope] = None
            for tier in self.tiers:
                tier.policy.scope_opened(rank)
        return rank

    def end_scope(self, scope: tuple[str, str]) -> None:
        """``BlocksAccessed.ends_scope``, or the client's clear: its rank is forgotten (its
        blocks keep their place); a later use of the name opens it again. O(1)."""
        rank = self.scopes.pop(scope, None)
        if rank is not None:
            client = scope[0]
            mine = self.client_scopes[client]
            del mine.requests[scope[1]]
            if not mine.requests:
                del self.client_scopes[client]
            theirs = self.tenant_scopes[mine.tenant]
            del theirs[scope]
            if not theirs:
                del self.tenant_scopes[mine.tenant]
            for tier in self.tiers:
                tier.policy.scope_ended(rank)

    def place_scoped(self, block_id: str, scope: tuple[str, str], position: int) -> None:
        """A scoped allocation (``BlockAllocated.scope``): the block, if its tier's policy
        holds it, ranks with the scope at ``position``."""
        rank = self.open_scope(scope)
        block = self.blocks.get(block_id)
        if block is not None:
            self._scope_use[block_id] = rank  # stored by the request: its uses are no reuse
        if block is not None and block.tier != DROPPED:
            policy = self.tiers[block.tier].policy
            if block_id in policy:
                policy.place_scoped(block, rank, position)

    def clear(self, owner: str) -> list[Block]:
        """The client dropped every block it had (engine restart); returns them, in the
        order it came to own them. O(the client's blocks), whatever other clients hold.
        Its request scopes end."""
        scopes = self.client_scopes.get(owner)
        if scopes is not None:
            for request in list(scopes.requests):
                self.end_scope((owner, request))
        entry = self.by_owner.get(owner)
        if entry is None:
            return []
        mine = [self.blocks[b] for b in self._owner_members(owner, entry.ids)]
        del self.by_owner[owner]  # every one goes: no need to unindex (and compact) one by one
        self.free(mine)
        return mine

    def owned(self, owner: str) -> int:
        """How many live blocks ``owner`` holds (what its ``cleared`` would free)."""
        entry = self.by_owner.get(owner)
        return entry.live if entry is not None else 0

    def ack(self, directive_id: int, done: bool, actual: int) -> None:
        """A directive was carried out, or failed with the block really in tier ``actual``."""
        block_id = self.outstanding.pop(directive_id, None)
        if block_id is None:
            raise EventError("acked.directive_id", f"unknown or already acknowledged directive {directive_id}", "FAILED_PRECONDITION")
        if done:
            self.stats.acks_done += 1
            return
        self.stats.acks_failed += 1
        block = self.blocks.get(block_id)
        if block is None or block.tier == actual:
            return
        # The client is the truth: put the model back where the block really is.
        self._detach(block)
        if actual != DROPPED:
            if not self._make_room(actual, block, {block_id}):
                self.stats.overcommits += 1
            self._attach(block, actual)

    def _link(self, block: Block) -> None:
        """Count the block as a child of its parent; a parent stops being a chain tail."""
        parent = self.blocks.get(block.parent_id) if block.parent_id else None
        if parent is not None and parent is not block:
            parent.children += 1
            if parent.children == 1:
                self._intent_changed(parent)

    def _unlink(self, block: Block) -> None:
        parent = self.blocks.get(block.parent_id) if block.parent_id else None
        if parent is not None and parent is not block and parent.children > 0:
            parent.children -= 1
            if parent.children == 0:
                self._intent_changed(parent)

    def _deadline_moved(self, block: Block, old_deadline: int | None) -> None:
        """Re-index a block for prefetch when its deadline changed below the top tier."""
        if self._prefetching and block.deadline_us != old_deadline and block.deadline_us is not None and block.tier > 0:
            self._push_prefetch(block)

    def _intent_changed(self, block: Block) -> None:
        """Tell the block's tier policy something it may order by has changed."""
        if block.tier != DROPPED and not block.pinned:
            self.tiers[block.tier].policy.update(block)

    def _index_request(self, block: Block) -> None:
        """A live block joined its request (allocated, or taken by a prefix reuse)."""
        if not block.request_id:
            return
        entry = self.by_request.get(block.request_id)
        if entry is None:
            # A RequestBlocks holds a list of ids (str) and a count: never on a cycle, it and
            # its list stay out of the cyclic collector's lists (policies/_gc.c).
            entry = self.by_request[block.request_id] = untrack(RequestBlocks())
        entry.ids.append(block.block_id)
        entry.live += 1

    def _unindex_request(self, request_id: str) -> None:
        """A block left ``request_id`` (called once it is out of ``blocks`` or in its new
        request, so that a compaction drops it)."""
        entry = self.by_request.get(request_id)
        if entry is None:
            return
        entry.live -= 1
        if not entry.live:
            del self.by_request[request_id]
        elif len(entry.ids) > 2 * entry.live:
            entry.ids = untrack(self._request_members(request_id, entry.ids))

    def _index_owner(self, block: Block) -> None:
        """A live block came to ``block.owner`` (allocated, or taken by a prefix reuse)."""
        entry = self.by_owner.get(block.owner)
        if entry is None:
            entry = self.by_owner[block.owner] = untrack(OwnedBlocks())
        entry.ids.append(block.block_id)
        entry.live += 1

    def _unindex_owner(self, owner: str) -> None:
        """A block left ``owner`` (called once it is out of ``blocks`` or has its new owner)."""
        entry = self.by_owner.get(owner)
        if entry is None:
            return
        entry.live -= 1
        if not entry.live:
            del self.by_owner[owner]
        elif len(entry.ids) > 2 * entry.live:
            entry.ids = untrack(self._owner_members(owner, entry.ids))

    def _owner_members(self, owner: str, ids: list[str]) -> list[str]:
        """The ids of ``ids`` that are live blocks of ``owner``, each once, in order."""
        blocks = self.blocks
        return [b for b in dict.fromkeys(ids) if (block := blocks.get(b)) is not None and block.owner == owner]

    def _request_members(self, request_id: str, ids: list[str]) -> list[str]:
        """The ids of ``ids`` that are live blocks of the request, each once."""
        blocks = self.blocks
        return [b for b in dict.fromkeys(ids) if (block := blocks.get(b)) is not None and block.request_id == request_id]

    # ---- prefetch ------------------------------------------------------------------------

    def _push_prefetch(self, block: Block) -> None:
        """Index the block by the latest time a transfer to the top tier can start."""
        assert block.deadline_us is not None
        block.heap_version += 1
        start = block.deadline_us - self.tiers[block.tier].info.transfer_us(block.size) - self.config.prefetch_margin_us
        self._heap_seq += 1
        heapq.heappush(self._prefetch_heap, (start, self._heap_seq, block.heap_version, block.block_id))
        heap = self._prefetch_heap
        if len(heap) > 2 * len(self.blocks) + 1024:
            # Drop stale entries so the heap stays proportional to live blocks (amortised O(1)).
            live = [e for e in heap if (b := self.blocks.get(e[3])) is not None and b.heap_version == e[2]]
            heapq.heapify(live)
            self._prefetch_heap = live

    def run_prefetch(self) -> None:
        """Promote blocks whose deadline is within transfer time plus margin, if the policy
        judges them worth the victims. Called once per batch."""
        heap = self._prefetch_heap
        now = self.clock.now_us
        while heap and heap[0][0] <= now:
            _, _, version, block_id = heapq.heappop(heap)
            block = self.blocks.get(block_id)
            if block is None or block.heap_version != version or block.deadline_us is None:
                continue
            src = block.tier
            if src <= 0 or block.deadline_us < now:
                continue  # already on top, dropped (recompute is the engine's call) or too late
            self._prefetch(block, "deadline within reach", block.deadline_us)

    def _prefetch(self, block: Block, reason: str, arrive_by: int) -> None:
        """Move a block up to its top allowed tier ahead of use, if the policy admits the
        victims that must leave for it."""
        src = block.tier
        top = self._top_allowed(block)
        if top >= src:
            return
        policy = self.tiers[top].policy
        admit = lambda victims: policy.admit_prefetch(block, victims)  # noqa: E731
        if self._make_room(top, block, {block.block_id}, admit):
            block.ready_us = self._transfer(src, block.size)
            self._detach(block)
            self._attach(block, top)
            self.stats.prefetches += 1
            self.stats.bytes_up += block.size
            self._emit(DirectiveKind.PREFETCH, block, src, top, policy.score(block), reason, arrive_by)

    # ---- queries -------------------------------------------------------------------------

    def tier_usage(self) -> list[tuple[str, int, int, int, int]]:
        """(name, blocks, bytes, capacity, pinned bytes) per tier, top first."""
        return [(t.name, t.blocks, t.used, t.capacity, t.pinned_bytes) for t in self.tiers]

    def dropped_blocks(self) -> int:
        return len(self.blocks) - sum(t.blocks for t in self.tiers)

    def request_blocks(self, request_id: str) -> Iterable[Block]:
        """The request's live blocks, by id: O(blocks of the request) (see RequestBlocks)."""
        entry = self.by_request.get(request_id)
        if entry is None:
            return []
        return [self.blocks[b] for b in sorted(self._request_members(request_id, entry.ids))]

    def tier_name(self, t: int) -> str:
        return self.tiers[t].name if t >= 0 else ""


def _take_intent(block: Block, intent: Block) -> None:
    """A reused block takes the intent of its new allocation (written out: this runs for
    every prefix reuse, and a getattr/setattr loop costs several times more)."""
    block.owner = intent.owner
    block.request_id = intent.request_id
    block.tenant = intent.tenant
    block.pin_requested = intent.pin_requested
    block.priority = intent.priority
    block.phase = intent.phase
    block.deadline_us = intent.deadline_us
    block.critical = intent.critical
    block.due_us = intent.due_us
    block.slack_us = intent.slack_us
    block.recompute_cost_us = intent.recompute_cost_us
    block.request_priority = intent.request_priority
    block.is_draft = intent.is_draft
    block.is_committed = intent.is_committed
    block.reuse_window = intent.reuse_window
    block.recompute_ok = intent.recompute_ok
    block.compression_ok = intent.compression_ok
    block.prefetch_ok = intent.prefetch_ok
    block.parent_id = intent.parent_id
    block.allowed_mask = intent.allowed_mask
    block.extra = intent.extra
    block.token_start = intent.token_start
    block.token_count = intent.token_count
