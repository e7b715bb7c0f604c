"""The policy interface: what every eviction/prefetch policy implements.

The broker core owns residency, pins, capacity and directives; a policy owns only the order
in which the unpinned blocks of one tier would leave it (vLLM's kv_offload split). One policy
instance serves one tier. Policies are synchronous, deterministic, know no protobuf and do
no I/O; time comes from ``ctx.clock.now_us`` (event time), never the wall clock.

Contract, as the core calls it:

- ``insert(block)``: the block became resident and evictable in this tier (allocated here,
  demoted or promoted here, or unpinned while here). Never called for a pinned block.
- ``access(block)``: an evictable block of this tier was read. ``access_many(blocks)``:
  the same for each block in order (optional, a faster loop).
- ``update(block)``: the block's intent (phase, priority, deadline, ...) changed.
- ``remove(block)``: the block left without being chosen (freed, pinned, moved by an access
  or an ack). Removing a block the policy does not hold raises ``PolicyError``.
- ``incoming(block)`` (optional): the core is about to make room in this tier for
  ``block`` (allocated, reloaded, prefetched, demoted into it); called just before
  ``choose_victims``, only when something must leave. A policy whose choice depends on
  what arrives (ARC: a ghost hit moves its target before REPLACE) notes it; it changes
  nothing that the next ``insert`` would not (the room may still not be made).
- ``choose_victims(bytes_needed, protected)``: name blocks whose sizes add up to at least
  ``bytes_needed``, none in ``protected`` (block ids), or return ``None``. It changes no
  state (libCacheSim's ``to_evict``): the core then calls ``evicted`` for each block it
  really moves out, so eviction is atomic.
- ``evicted(block)``: a chosen victim left the tier (history-keeping policies record it).

Every operation is O(1) or O(log n) in the number of blocks the policy holds; walking the
order from the cold end in ``choose_victims`` costs only the victims and the protected
blocks it steps over.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from enum import IntEnum
from typing import Any, ClassVar, Final, TypeVar

from mypy_extensions import i32, mypyc_attr, u8


class PolicyError(Exception):
    """A policy was used against its contract (unknown block, bad parameter)."""


class Phase(IntEnum):
    """Request phase; numbers equal kvbroker.v1.Phase."""

    UNSPECIFIED = 0
    PREFILL = 1
    DECODE = 2
    VERIFY = 3
    ROLLBACK = 4
    DONE = 5
    IDLE = 6


class Priority(IntEnum):
    """Block priority; numbers equal kvbroker.v1.Priority."""

    UNSPECIFIED = 0
    COLD = 1
    WARM = 2
    HOT = 3
    DECODE_CRITICAL = 4


DROPPED: Final = -1
"""Tier index of a block that is allocated but resident in no tier (must be recomputed)."""

DEFAULT_REQUEST_PRIORITY: Final = 50


# mypyc (broker/native.py compiles this module): a compiled class's __new__ runs __init__,
# unless the class allows interpreted subclasses. This mark is what lets copy.deepcopy copy
# an instance (a shadow policy starts from a copy of the live core) and ``Block.__new__``
# make an empty block (broker.model.apply). (mypyc's serializable=True is meant for it, but in
# mypy 2.4.1 it also turns a constructor call from interpreted code into a no-op.)
@mypyc_attr(allow_interpreted_subclasses=True)
class Block:
    """One KV block as the broker models it: identity, intent and where it lives.

    ``__slots__`` keeps a block small: the broker must hold a million of them (compiled,
    its fields are a C struct).
    """

    __slots__ = (
        "accesses",
        "allowed_mask",
        "block_id",
        "created_us",
        "deadline_us",
        "heap_version",
        "ready_us",
        "is_committed",
        "is_draft",
        "reuse_window",
        "recompute_ok",
        "compression_ok",
        "prefetch_ok",
        "last_access_us",
        "owner",
        "parent_id",
        "children",
        "reuses",
        "critical",
        "due_us",
        "extra",
        "phase",
        "pin_requested",
        "priority",
        "_recompute_cost_set",
        "_recompute_cost_us",
        "released",
        "refs",
        "pinned",
        "request_id",
        "request_priority",
        "size",
        "slack_us",
        "tenant",
        "tier",
        "token_count",
        "token_start",
    )

    def __init__(self, block_id: str, size: int, *, request_id: str = "", tenant: str = "") -> None:
        # Compiled, the slots are a C struct in the order they are first assigned here: the
        # narrow ones first, packed into the word after the object header (bools are a
        # byte each), then the 8-byte ones. A native int (i32, u8) is unboxed and narrow
        # but wraps silently on overflow, and typed code doing arithmetic with it gets a
        # native int too; so only fields that are never counted or computed with, and
        # whose range is bounded, are native: the tier index (-1 .. number of tiers), and
        # phase and priority (enum numbers: broker.model.apply rejects a value outside the enum
        # before it sets one). Counters, sizes, times, request_priority (scored with) and
        # the wire's uint32/uint64 fields stay ``int``: any value, 8 bytes unless huge.
        self.tier: i32 = DROPPED
        # The Priority / Phase numbers (events carry them as ints; read, they are ints).
        self.priority: u8 = Priority.UNSPECIFIED
        self.phase: u8 = Phase.UNSPECIFIED
        self.pin_requested = False
        self.released = False
        # Kept by the core as wants_pin(block) whenever pin, priority or release change
        # (a plain attribute: it is read on every access).
        self.pinned = False
        self.is_draft = False
        self.is_committed = False
        self.recompute_ok = False
        self.compression_ok = False
        self.prefetch_ok = False
        # What the engine said, for measurement only: marked DECODE_CRITICAL, and its
        # deadline (due_us, below). Equal to priority/deadline_us, except in an intent
        # ablation, where policies see no intent but reports still count against what the
        # engine knew.
        self.critical = False
        # recompute_cost_us (a property, below) is None or _recompute_cost_us, by this flag.
        self._recompute_cost_set = False
        self.block_id = block_id
        # client_id of the client that allocated it; a clear drops only that client's blocks.
        self.owner = ""
        self.request_id = request_id
        self.tenant = tenant
        self.parent_id = ""
        self.deadline_us: int | None = None
        self.due_us: int | None = None
        self.slack_us: int | None = None
        # Tokens until the engine expects to read the block again (None: unknown).
        self.reuse_window: int | None = None
        # layer, head_group and spill_cost_us (properties, below): None while all three
        # are at their defaults, else the three. Engines seldom set them and nothing in the
        # broker reads them; one slot instead of three is 16 bytes a block, which keeps a
        # compiled Block in a 256-byte allocation (a block that sets any of them carries a
        # 64-byte tuple instead).
        self.extra: tuple[int, int, int | None] | None = None
        self.size = size
        self.request_priority = DEFAULT_REQUEST_PRIORITY
        # An int slot and a flag rather than an int | None: engines send a recompute cost
        # with (nearly) every block, mostly above 256, and a slot of an int | None points
        # to a boxed int of the block's own (32 bytes); an int slot holds it unboxed
        # (any int: one that does not fit 62 bits is boxed, as before).
        self._recompute_cost_us = 0
        # References the engine holds; 0 means released (cached, evictable, unpinned).
        self.refs = 1
        # Live blocks whose parent_id is this block (the core keeps it): 0 = a chain tail.
        self.children = 0
        # Times a later prompt brought this block again (prefix reuse or a shared reference).
        self.reuses = 0
        # Bit i set: the block may live in tier i. 0 means any tier.
        self.allowed_mask = 0
        self.created_us = 0
        self.last_access_us = 0
        self.accesses = 0
        self.token_start = 0
        self.token_count = 0
        # Bumped whenever the block's prefetch key changes, so stale heap entries are skipped.
        self.heap_version = 0
        # Event time at which the block is usable where it is (a transfer may be in flight).
        self.ready_us = 0

    @property
    def recompute_cost_us(self) -> int | None:
        return self._recompute_cost_us if self._recompute_cost_set else None

    @recompute_cost_us.setter
    def recompute_cost_us(self, value: int | None) -> None:
        self._recompute_cost_set = value is not None
        self._recompute_cost_us = 0 if value is None else value

    @property
    def layer(self) -> int:
        extra = self.extra
        return 0 if extra is None else extra[0]

    @layer.setter
    def layer(self, value: int) -> None:
        self.extra = extra_fields(value, self.head_group, self.spill_cost_us)

    @property
    def head_group(self) -> int:
        extra = self.extra
        return 0 if extra is None else extra[1]

    @head_group.setter
    def head_group(self, value: int) -> None:
        self.extra = extra_fields(self.layer, value, self.spill_cost_us)

    @property
    def spill_cost_us(self) -> int | None:
        extra = self.extra
        return None if extra is None else extra[2]

    @spill_cost_us.setter
    def spill_cost_us(self, value: int | None) -> None:
        self.extra = extra_fields(self.layer, self.head_group, value)

    def allowed_in(self, tier_index: int) -> bool:
        return self.allowed_mask == 0 or bool(self.allowed_mask >> tier_index & 1)

    def __repr__(self) -> str:
        return f"Block({self.block_id!r}, size={self.size}, tier={self.tier})"


def extra_fields(layer: int, head_group: int, spill_cost_us: int | None) -> tuple[int, int, int | None] | None:
    """``Block.extra`` for these values."""
    if layer == 0 and head_group == 0 and spill_cost_us is None:
        return None
    return (layer, head_group, spill_cost_us)


_T = TypeVar("_T")

try:
    # Takes an object that can never be on a reference cycle out of the cyclic collector's
    # lists (policies/_gc.c says why: full collections that walk a million blocks).
    from policies._gc import untrack
except ImportError:  # the pure Python build (KVBROKER_PURE_PYTHON=1): the collector keeps them

    def untrack(obj: _T) -> _T:
        return obj


def wants_pin(block: Block) -> bool:
    """DECODE_CRITICAL implies pinned; a released block is never pinned."""
    if block.released:
        return False
    return block.pin_requested or block.priority == Priority.DECODE_CRITICAL


def reduce_frozen(obj: Any) -> tuple[Any, tuple[Any, ...]]:
    """``__reduce__`` of a frozen dataclass: copy.deepcopy (a shadow policy starts from a copy
    of the live core) rebuilds it through its constructor. Compiled with mypyc, a frozen
    dataclass refuses the field-by-field restore that copy would do otherwise."""
    return type(obj), tuple(getattr(obj, field.name) for field in dataclasses.fields(obj))


@dataclasses.dataclass(frozen=True)
class TierInfo:
    """What a policy may know about the tier it serves and the tiers below it."""

    index: int
    name: str
    capacity_bytes: int
    read_latency_us: float
    bandwidth_bytes_per_us: float

    def transfer_us(self, size: int) -> float:
        """Time to read ``size`` bytes out of this tier."""
        return self.read_latency_us + size / self.bandwidth_bytes_per_us

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reduce_frozen(self)


class Clock:
    """Event time in microseconds, advanced from event timestamps only, and the ordinal of
    the event being applied (0-based over the whole stream, rejected events included)."""

    __slots__ = ("now_us", "event_index")

    def __init__(self, now_us: int = 0) -> None:
        self.now_us = now_us
        self.event_index = -1


@mypyc_attr(allow_interpreted_subclasses=True)  # copyable when compiled: see Block
class FutureUses:
    """The future of a stream, for offline policies (Belady): where each block is used next.

    Built by replay from the whole event stream before it runs: for every block id, the
    ordinals of the events that use it (allocate or access it). A live broker has none.
    """

    NEVER = 1 << 62

    def __init__(self, uses: dict[str, list[int]], clock: Clock) -> None:
        self._uses = uses
        self._next = dict.fromkeys(uses, 0)
        self._clock = clock

    def table(self) -> dict[str, list[int]]:
        """Every block's use ordinals, ascending (read only: for an oracle's own index)."""
        return self._uses

    def next_use(self, block_id: str) -> int:
        """Ordinal of the first event after the current one that uses the block."""
        uses = self._uses.get(block_id)
        if uses is None:
            return self.NEVER
        i = self._next[block_id]
        now = self._clock.event_index
        # Amortised O(1): each use ordinal is stepped over once.
        while i < len(uses) and uses[i] <= now:
            i += 1
        self._next[block_id] = i
        return uses[i] if i < len(uses) else self.NEVER


@dataclasses.dataclass(frozen=True)
class PolicyContext:
    """Everything a policy is given at construction."""

    tier: TierInfo
    tiers: tuple[TierInfo, ...]
    clock: Clock
    # The stream's future: only in replay, only for offline policies.
    future: FutureUses | None = None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reduce_frozen(self)


@dataclasses.dataclass(frozen=True)
class NoParams:
    """Parameters of a policy that has none."""


# Out-of-tree and most built-in policies are interpreted subclasses of this compiled class.
@mypyc_attr(allow_interpreted_subclasses=True)
class Policy(ABC):
    """Base class of every policy. Subclasses set ``name``, ``description`` and ``Params``."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Params: ClassVar[type[Any]] = NoParams
    # Needs the future of the stream (an oracle): replay only, refused by a live broker.
    offline: ClassVar[bool] = False

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        self.ctx = ctx
        self.params = self.Params() if params is None else params
        if not isinstance(self.params, self.Params):
            raise PolicyError(f"{self.name}: params must be {self.Params.__name__}, got {type(params).__name__}")

    @abstractmethod
    def insert(self, block: Block) -> None: ...

    @abstractmethod
    def access(self, block: Block) -> None: ...

    def access_many(self, blocks: list[Block]) -> None:
        """``access`` for each block in turn: what one decode step reads. A policy may
        override it with a faster loop of exactly that effect; the core then gives it a
        step's plain top-tier hits at once (their accesses already counted), else calls
        ``access`` per block."""
        for block in blocks:
            self.access(block)

    def refresh(self, blocks: list[Block]) -> None:
        """``blocks`` were used but not read (``BlocksAccessed.refresh_only``: a request
        finished with chunks it stored). A policy that tells a reuse from recency refreshes
        recency only; by default it is an access, as it was before the flag existed."""
        self.access_many(blocks)

    # ---- request-scoped uses (BlocksAccessed.scope, BlockAllocated.scope) ----------------
    # The core keeps the open scopes (a request of one client each) and gives each a rank:
    # the index of the event that opened it (``clock.event_index``), so ranks order with
    # the events. A policy with a recency order may rank scoped uses with the scope
    # (policies/lru.py does, as vLLM's LRU ranks a running request's chunks); by default a
    # scoped access is a plain access and the rest is a no-op.

    def scope_opened(self, rank: int) -> None:
        """A scope opened at this event (every tier's policy hears of it, in rank order)."""

    def access_scoped(self, blocks: list[Block], rank: int, positions: dict[str, int]) -> None:
        """A request-scoped use of ``blocks`` (in this tier, their accesses counted), at token
        ``positions[block_id]``, for the scope of ``rank``."""
        self.access_many(blocks)

    def place_scoped(self, block: Block, rank: int, position: int) -> None:
        """``block``, just inserted (or taken again) by a scoped allocation, ranks with the
        scope of ``rank`` at token ``position``. Default: it stays where the insert put it."""

    def scope_ended(self, rank: int) -> None:
        """The scope of ``rank`` ended (``ends_scope``, a clear): its rank is forgotten."""

    def update(self, block: Block) -> None:
        """Intent changed; policies that ignore intent keep their order."""

    @abstractmethod
    def remove(self, block: Block) -> None: ...

    def evicted(self, block: Block) -> None:
        """A victim left the tier; by default the same as ``remove``."""
        self.remove(block)

    def incoming(self, block: Block) -> None:
        """The core is about to choose victims to make room for ``block``. The core calls
        it only for a policy that overrides it, so the others pay nothing."""

    @abstractmethod
    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, block_id: object) -> bool: ...

    def score(self, block: Block) -> float:
        """How strongly the policy wants to keep ``block`` (reported in directives)."""
        return 0.0

    def prefer_drop(self, block: Block) -> bool:
        """Whether a victim should be dropped (EVICT) rather than demoted: e.g. when
        recomputing it is cheaper than reloading it from the next tier. Default: demote."""
        return False

    def after_access(self, block: Block) -> Iterable[str]:
        """Called on the top tier's policy after every block access, wherever the block
        was; returns ids of blocks to prefetch (a successor predictor's hook)."""
        return ()

    def admit_prefetch(self, candidate: Block, victims: list[Block]) -> bool:
        """Whether moving ``candidate`` up is worth evicting ``victims``.

        Demand-only policies never prefetch; intent-aware ones override this.
        """
        return False

    def _unknown(self, block: Block) -> PolicyError:
        return PolicyError(f"{self.name}: block {block.block_id!r} is not held by this policy (tier {self.ctx.tier.name})")


def take_until(candidates: Any, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
    """Walk ``candidates`` (cold end first), skipping protected ones, until enough bytes.

    Returns the victims, or ``None`` when the candidates run out first. Shared by the
    policies whose order is one sequence.
    """
    victims: list[Block] = []
    got = 0
    if bytes_needed <= 0:
        return victims
    for block in candidates:
        if block.block_id in protected:
            continue
        victims.append(block)
        got += block.size
        if got >= bytes_needed:
            return victims
    return None
