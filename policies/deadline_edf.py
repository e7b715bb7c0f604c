"""deadline_edf: blocks that could not come back before their deadline stay; the rest leave
by (priority class, earliest pending deadline kept, request priority, recency), and the near
ones last, latest start first."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Any, ClassVar, Final

from mypy_extensions import mypyc_attr, u8

from policies.base import Block, Policy, PolicyContext, take_until, untrack
from policies.params import bounded
from policies.priority_lru import PriorityLRUPolicy
from policies.structures import SortedKeys

# Where a held block is in the partition. UNDATED, FAR and STALE blocks are "free" (in the
# priority order); NEAR blocks are protected.
# The class rank of a released block (cached, no request holds it): below every class, so
# that the cache's unreferenced blocks leave before any block a running request reads.
# Without it a finished request's HOT blocks outranked the WARM blocks of running requests:
# with the prefix cache full of released blocks (vLLM keeps a finished request's blocks
# cached), the bench workload with released prompts thrashed at a 0.60 hit rate and 2.4
# demotions per event where lru kept every running block (1.00, 0.11).
RELEASED_RANK: Final = -1


def free_rank(block: Block) -> tuple[int, int]:
    """(class rank, request priority) of the free order: priority_lru's, a released block
    ranking below every class."""
    rank, request_priority = PriorityLRUPolicy.key(block)
    return (RELEASED_RANK if block.released else rank, request_priority)


# The urgency of a block with no pending deadline: below every -deadline (see ``urgency``).
NO_DEADLINE: Final = -(1 << 64)


def urgency(block: Block) -> int:
    """Earliest deadline first within a class: ``-deadline`` while the block has a deadline
    it has not been read at or after (a promise the engine has not yet kept, however long
    ago it fell due), else ``NO_DEADLINE``. Larger is kept longer."""
    deadline = block.deadline_us
    if deadline is None or block.last_access_us >= deadline:
        return NO_DEADLINE
    return -deadline


UNDATED: Final = 0
FAR: Final = 1
NEAR: Final = 2
STALE: Final = 3


# A plain class when compiled (broker/native.py): __post_init__ names a bad value, where a
# compiled class would refuse a float for an int field before it, naming no parameter.
@mypyc_attr(native_class=False)
@dataclasses.dataclass(frozen=True)
class DeadlineEDFParams:
    """``stale_after_us``: a deadline passed by more than this no longer protects the block
    (it leaves NEAR; unread, it still ranks by that deadline within its class); ``guard_us``: a block is near when its deadline is
    at most its reload time plus this away (the core's default prefetch margin: a block
    evicted inside it would be proposed for prefetch at once); ``default_recompute_us``:
    the recompute cost of a block that gives none."""

    stale_after_us: int = bounded(10_000, 0, 10**12)
    guard_us: int = bounded(500, 0, 10**12)
    default_recompute_us: int = bounded(4_000, 0, 10**12)

    def __post_init__(self) -> None:
        for name in ("stale_after_us", "guard_us", "default_recompute_us"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


@mypyc_attr(allow_interpreted_subclasses=True)  # copyable when compiled: see policies.base.Block
class _Held:
    """What the policy keeps per block: its sort keys, fixed at the block's last event."""

    __slots__ = ("block", "deadline", "free_key", "in_free", "keyed_priority", "keyed_released", "latest_start", "parked", "stamp", "state")

    def __init__(self, block: Block, stamp: int) -> None:
        # One per held block (a million at a time): compiled, the fields are a C struct in
        # this order. The state (0..3) is a byte beside the header's bitmap.
        self.state: u8 = UNDATED
        # Whether ``free_key`` (this very tuple) is in ``_free``: live, a placeholder or
        # stale (see "Stale entries" and "Placeholders" in the policy's docstring).
        self.in_free = False
        # The block's priority and released flag when its free key was last computed (bytes
        # beside the state, no larger object): a read checks them to keep its placeholder
        # without keying the block (``DeadlineEDFPolicy._keeps_place``).
        self.keyed_priority: u8 = 0
        self.keyed_released = False
        # Whether the block is in ``_pending`` (parked): a byte read at every access, where
        # a lookup in ``_pending`` (a dict of every block read since the lists were last
        # read) was a probe of a large table per block per step. The fifth byte takes the
        # record from 88 to 96 bytes, the size the allocator already gave it (16-byte
        # classes): no more memory.
        self.parked = False
        self.block = block
        self.stamp = stamp
        # (class rank, urgency, request priority, stamp, block id): ``_free``'s key. A tuple of
        # unknown length to the compiler, so that it stays one Python object, the one
        # ``_free`` holds: typed as four fields, mypyc keeps the four in the struct and
        # boxes a new tuple each time the key is filed or looked up.
        self.free_key: tuple[Any, ...] = (0, 0, 0, 0, "")
        self.deadline = 0
        self.latest_start = 0.0


# Compiled (broker/native.py): interpreted policies may subclass it, and copy.deepcopy
# needs its __new__ to be empty (see policies.base.Block).
@mypyc_attr(allow_interpreted_subclasses=True)
class DeadlineEDFPolicy(Policy):
    """Evicts free blocks by (priority class, pending deadline, request priority, LRU), then
    near-deadline blocks, the one with the latest must-start time first. A released block
    (cached, held by no request: ``free_rank``) ranks below every class, whatever its label
    said.

    Earliest deadline first within a class (``urgency``): among the free blocks of one
    class, those without a pending deadline leave first, then those with one, the latest
    deadline first. A deadline is pending from when the engine sets it until the block is
    read at or after it (or the deadline is changed or cleared): a promised read not yet
    made, however long ago it fell due. Why this order: a deadline is the one thing the
    engine says about *when* a block is read, and EDF is the order that serves promises in
    time; request priority and recency say nothing about when, so they only order blocks
    of equal deadline (or none). Why pending and not "passed means gone": kvbroker's engine
    hooks (vllm_integration/events_from_vllm/engine_hooks.py) clear a request's deadlines when it is preempted or
    finishes, and a decode step names the next use with its read; a deadline still set on
    an unread block is a read still owed. An engine that abandons blocks without clearing
    their deadlines makes them outstay undated blocks of their class (they still leave
    before any higher class, and ``stale_after_us`` still ends their protection). Measured
    (docs/deadlines.md): on kv_deadline_scheduler's deadline_pressure trace this order reads
    every decode-critical block from HBM (0 of 96 missed at 128 MiB, where recency among
    same-priority blocks missed 9 and priority_lru 6), with more prefetch traffic; no
    constant was changed for it.

    A block with deadline D (absolute event time) and reload cost R (the transfer time out
    of the next lower tier, or, in the bottom tier, its recompute cost) has the *latest
    start* ``L = D - R``: the last moment it may leave this tier and still be back by D.
    D, R and so L are fixed between the block's own events, whatever the clock does. With
    ``now`` the event time (``ctx.clock.now_us``), a held block is

      NEAR     if ``now >= L - guard_us`` and ``now - D <= stale_after_us``: evicting it
               now would make it late (its time-to-deadline is at most its reload time plus
               the guard). Protected: it leaves only when the free blocks are not enough.
      STALE    if ``now - D > stale_after_us``: the deadline passed long ago; no protection
               (in ``_free``, where an unread block still ranks by it: ``urgency``).
      FAR      if ``now < L - guard_us``: a deadline, but time enough to come back.
      UNDATED  without a deadline.

    Structures (each a ``SortedKeys``, policies.structures; dict ``_held`` block id -> its
    keys and state):
      ``_free``      UNDATED, FAR and STALE blocks by (class rank, urgency, request
                     priority, recency stamp, id): ``priority_lru``'s classes with EDF inside
                     them, one list so that a block returning from NEAR regains its old
                     place.
      ``_far``       FAR blocks by (L, stamp, id): those to become NEAR next are a prefix.
      ``_near``      NEAR blocks by (L, -stamp, id); victims are taken from its end.
      ``_near_by_d`` NEAR blocks by (D, stamp, id): those to become STALE next are a prefix.

    Lazy filing: ``insert``, ``access`` and ``update`` only take the block out of the lists
    (and give it its new recency stamp) and park it in ``_pending``; when something reads the
    lists (``choose_victims``, ``is_near``, ``admit_prefetch``, ``score``), every parked
    block is keyed from its fields at that moment and filed. A decode step reads and
    re-deadlines every block of its request, and between two reads a block is often touched
    many times: it now costs one keying and one removal and insertion per list, not four
    of each per step. Equal to filing at once (``lazy = False``, the reference a test runs
    it against) because: the lists are sorted on total keys (block id last), so they hold
    the same order whenever they are read; a block's state computed at a later time equals
    its state at its event carried forward by ``_sync`` (both transitions depend only on
    its own D, L and ``now``); and the fields the keys read (priority, request priority,
    deadline, size, recompute cost) change only by intent updates, shares and reuses, each
    followed by ``update``, ``access``, ``insert`` or ``remove`` of the block before any
    read that could choose it (a reuse's own cascade runs with the block protected).

    Stale entries in ``_free``: a block that leaves the free order (read, updated, removed,
    evicted, or turned NEAR) is not taken out of ``_free`` at once, which cost a bisection
    of tuples per read of every block (a fifth of a prefix-cached workload's time); its
    entry stays, *stale*, and ``_stale`` counts them. An entry is live only while it is its
    held block's current ``free_key`` (the same tuple, by identity) and the block is not
    NEAR; readers skip the others. Victims are taken from the cold end, where the stale
    entries of read blocks drift as they age, so the victim scan pops the stale prefix
    first; and once more than half of ``_free`` is stale (and more than ``compact_floor``
    entries), the list is rebuilt from its blocks' current keys: O(1) amortised per event. A block
    returning from NEAR to STALE, or re-keyed to an equal key, revives its entry instead of
    filing a new one (``_Held.in_free``).

    Placeholders: a read gives a block a later stamp, so its new key sorts after its entry
    in ``_free`` (unless an update lowered its class or request priority). Then nothing is
    filed: the entry stays as the block's ``free_key``, a placeholder, and the victim scan
    (``_coldest_first``), on meeting it, moves it to the block's current key, which it
    reaches again later in the same scan if it goes that far. A block read at every decode
    step is filed once per pass of the scan over the list instead of once per read of the
    policy (every allocation under pressure). The order a caller sees is the order of the
    current keys, as before: a placeholder's current key, computed from its fields when
    met, is the key the read would have filed (the fields change only with events that
    park the block again). The eager reference (``lazy = False``) removes entries at once
    and never keeps a placeholder, so the random-stream test that holds lazy equal to eager
    checks all of this too.

    Why no rescan is ever needed as time advances: keys are absolute times (L, D) and do not
    change with ``now``; only the two boundaries move, and only forward (event time never
    goes back). ``now >= L - guard`` is a prefix of ``_far``, ``now - D > stale_after`` a
    prefix of ``_near_by_d``. ``_sync`` pops those prefixes: each block crosses FAR -> NEAR
    and NEAR -> STALE at most once per keying, so the work is O(log n) amortised per event.

    Steps:
      1. ``insert`` / ``access``: new recency stamp; compute (D, R, L) and the state now;
         file the block in the lists of its state. ``update``: the same, keeping the stamp
         (an intent change is not a use). ``remove`` / ``evicted``: drop it from its lists.
      2. ``_sync`` (first thing in every call, ``choose_victims`` included): move the FAR
         prefix with ``L - guard <= now`` to NEAR (or straight to STALE), then the
         ``_near_by_d`` prefix with ``now - D > stale_after`` back to ``_free``. It changes
         the representation only, never the order a caller sees at a given ``now``. (The
         free key's urgency depends on the deadline and the last read only, not on
         ``now``: a read or an update re-keys the block.)
      3. ``choose_victims``: ``_free`` from its coldest end, then ``_near`` from its latest
         start (the block that would be late by the least, ``now - L``), skipping the
         protected ids. Nothing else changes.
      4. ``admit_prefetch(candidate, victims)``: admitted when the candidate's deadline has
         not passed, no victim ranks in a higher priority class than the candidate, and
         every victim with a live (not stale) deadline must start its reload strictly
         later than the candidate must start its own load (``D - transfer`` out of its
         tier): earliest start first, EDF.
      5. ``prefer_drop(block)``: True when recomputing the block costs less than reloading
         it from the next lower tier (always at the bottom tier). The core asks it for
         every victim it displaces and drops (EVICT) instead of demoting when it says so.

    Choices: the near blocks leave by latest must-start time L, not by latest deadline D
    (the same order for equal sizes; with unequal reload times the latest L is the block
    that would be late by the least). ``guard_us`` widens "near" beyond the reload time;
    set it to the core's ``prefetch.margin_us``, so that the blocks the core would propose
    for prefetch at once are not the ones pushed out. Unlike ``priority_lru``, an intent
    update keeps a block's recency (only insert and read are uses).
    """

    name = "deadline_edf"
    description = (
        "keeps blocks that could not be reloaded before their deadline; the rest by class (released blocks lowest), request priority, LRU"
    )
    Params = DeadlineEDFParams
    # Lazy filing (see the class docstring); False files every block at its own event, the
    # reference the lazy path is tested against.
    lazy: ClassVar[bool] = True
    # Fewest stale entries before ``_free`` may be rebuilt (see "Stale entries"); the tests
    # set 0 to rebuild as often as the half-stale rule allows.
    compact_floor: ClassVar[int] = 4096

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._held: dict[str, _Held] = {}
        self._free = SortedKeys()
        self._far = SortedKeys()
        self._near = SortedKeys()
        self._near_by_d = SortedKeys()
        # Held blocks keyed at their last event but not in the lists yet (see "Lazy filing").
        self._pending: dict[str, _Held] = {}
        # Entries of _free that are not live (see "Stale entries").
        self._stale = 0
        # Keys of _free not yet in it (see _coldest_first): sorted, merged by _flush.
        self._moved: list[tuple[Any, ...]] = []
        self.compactions = 0  # rebuilds of _free, for the tests and the curious
        # The last recency stamp given (an int, not itertools.count: compiled, next() is a
        # lookup of the builtin and a call per block read).
        self._stamp = -1
        self._synced_at = -1
        index = ctx.tier.index
        self._next_tier = ctx.tiers[index + 1] if index + 1 < len(ctx.tiers) else None

    # ---- costs ---------------------------------------------------------------------------

    def recompute_us(self, block: Block) -> float:
        cost = block.recompute_cost_us
        return float(self.params.default_recompute_us if cost is None else cost)

    def reload_us(self, block: Block) -> float:
        """What getting the block back costs if it leaves this tier: the transfer out of the
        next lower tier, or its recompute cost at the bottom."""
        if self._next_tier is None:
            return self.recompute_us(block)
        return self._next_tier.transfer_us(block.size)

    def latest_start(self, block: Block) -> float | None:
        """``deadline - reload time``: the last moment the block may leave and be back in
        time (None without a deadline). Independent of the clock."""
        if block.deadline_us is None:
            return None
        return block.deadline_us - self.reload_us(block)

    def prefer_drop(self, block: Block) -> bool:
        """Drop rather than demote: recompute is cheaper than the reload from the next
        tier (or there is no next tier). The core asks it for every victim it displaces."""
        if self._next_tier is None:
            return True
        return self.recompute_us(block) < self._next_tier.transfer_us(block.size)

    # ---- the partition -------------------------------------------------------------------

    def _state(self, deadline: int, latest_start: float, now: int) -> int:
        p = self.params
        if now - deadline > p.stale_after_us:
            return STALE
        if now >= latest_start - p.guard_us:
            return NEAR
        return FAR

    @staticmethod
    def _free_key(held: _Held) -> tuple[Any, ...]:
        """The block's place in the free order, from its fields and stamp now."""
        block = held.block
        rank, request_priority = free_rank(block)
        return (rank, urgency(block), request_priority, held.stamp, block.block_id)

    @staticmethod
    def _set_free_key(held: _Held, key: tuple[Any, ...]) -> None:
        """Make ``key``, just computed by ``_free_key``, the block's free key, and record
        the fields its class came from (``_keeps_place`` reads them)."""
        block = held.block
        held.free_key = key
        held.keyed_priority = block.priority
        held.keyed_released = block.released

    def _key(self, held: _Held) -> None:
        """Compute the block's keys and state from its fields now (step 1)."""
        block = held.block
        self._set_free_key(held, self._free_key(held))
        deadline = block.deadline_us
        if deadline is None:
            held.state = UNDATED
            return
        latest_start = deadline - self.reload_us(block)
        held.deadline, held.latest_start = deadline, latest_start
        held.state = self._state(deadline, latest_start, self.ctx.clock.now_us)

    def _flush(self) -> None:
        """Key every parked block from its fields now and file it (see "Lazy filing")."""
        if self._moved:  # the placeholders the last scan moved (see _coldest_first)
            self._free.update(self._moved)
            self._moved = []
        pending = self._pending
        if not pending:
            return
        # Filed together: SortedKeys.update merges many new keys into a list by one sort of
        # two sorted runs, where adding each is two bisections and a list insertion; a tier
        # read seldom (a lower tier at a watermark reclaim) files thousands at once.
        new_free: list[tuple[Any, ...]] = []
        new_far: list[tuple[float, int, str]] = []
        for block_id, held in pending.items():
            held.parked = False
            old = held.free_key
            self._key(held)  # a direct call when compiled (a bound method in a local is not)
            state = held.state
            if held.in_free and held.free_key >= old:
                # Its entry is this key, or an earlier place (a read moved it towards the hot
                # end): it stays, as a placeholder the victim scan moves (see "Placeholders").
                held.free_key = old
                if state != NEAR:
                    self._stale -= 1
            else:
                held.in_free = state != NEAR
                if state != NEAR:
                    new_free.append(held.free_key)
            if state == NEAR:
                self._add_near(held)
            elif state == FAR:
                new_far.append((held.latest_start, held.stamp, block_id))
        pending.clear()
        self._free.update(new_free)
        self._far.update(new_far)
        if self._stale > self.compact_floor and 2 * self._stale > len(self._free):
            self._compact()

    def _drop_free(self, held: _Held) -> None:
        """The block's ``_free`` entry stops being live (see "Stale entries")."""
        if self.lazy:
            self._stale += 1
        else:
            self._free.remove(held.free_key)
            held.in_free = False

    def _holder(self, key: tuple[Any, ...], forget: bool) -> _Held | None:
        """The held block whose entry ``key`` is (live or a placeholder), or None for a
        stale entry. With ``forget``, a stale entry that is its NEAR block's ``free_key`` is
        marked as no longer in ``_free``: the caller takes it out."""
        held = self._held.get(key[4])
        if held is None or held.free_key is not key:
            return None
        if held.state != NEAR:
            return held
        if forget:
            held.in_free = False
        return None

    def _compact(self) -> None:
        """Rebuild ``_free`` from its blocks' current keys (placeholders moved to theirs)."""
        keys = []
        for key in self._free:
            held = self._holder(key, True)
            if held is not None:
                self._set_free_key(held, self._free_key(held))
                keys.append(held.free_key)
        self._free = SortedKeys(keys)
        self._stale = 0
        self.compactions += 1

    def _unfile(self, held: _Held) -> None:
        block_id = held.block.block_id
        if held.state == NEAR:
            self._near.remove((held.latest_start, -held.stamp, block_id))
            self._near_by_d.remove((held.deadline, held.stamp, block_id))
        else:
            self._drop_free(held)
            if held.state == FAR:
                self._far.remove((held.latest_start, held.stamp, block_id))

    def _add_near(self, held: _Held) -> None:
        block_id = held.block.block_id
        self._near.add((held.latest_start, -held.stamp, block_id))
        self._near_by_d.add((held.deadline, held.stamp, block_id))

    def _sync(self) -> None:
        """Bring the partition to the current time (step 2): pop the two moving prefixes."""
        now = self.ctx.clock.now_us
        if now == self._synced_at:
            return
        self._synced_at = now
        p = self.params
        far, near_by_d = self._far, self._near_by_d
        while far and far[0][0] - p.guard_us <= now:
            held = self._held[far.pop(0)[2]]
            if now - held.deadline > p.stale_after_us:
                held.state = STALE  # stays in _free
            else:
                held.state = NEAR
                self._drop_free(held)
                self._add_near(held)
        while near_by_d and now - near_by_d[0][0] > p.stale_after_us:
            held = self._held[near_by_d.pop(0)[2]]
            self._near.remove((held.latest_start, -held.stamp, held.block.block_id))
            held.state = STALE
            if held.in_free:
                self._stale -= 1  # its entry, stale while NEAR, is live again
            else:
                self._free.add(held.free_key)
                held.in_free = True

    def _get(self, block: Block) -> _Held:
        held = self._held.get(block.block_id)
        if held is None:
            raise self._unknown(block)
        return held

    # ---- the interface -------------------------------------------------------------------

    def insert(self, block: Block) -> None:
        self._sync()
        # A _Held points to its block, numbers and a tuple: never on a cycle (policies/_gc.c).
        self._stamp += 1
        held = untrack(_Held(block, self._stamp))
        self._held[block.block_id] = held
        self._pending[block.block_id] = held
        held.parked = True
        if not self.lazy:
            self._flush()

    def _park(self, block: Block) -> _Held:
        """Take a held block out of the lists until they are next read (see "Lazy filing")."""
        block_id = block.block_id
        held = self._held.get(block_id)
        if held is None:
            raise self._unknown(block)
        if not held.parked:
            self._park_held(held)
        return held

    def _park_held(self, held: _Held) -> None:
        """Out of its lists, into ``_pending`` (held not parked yet): ``parked`` says so."""
        self._unfile(held)
        self._pending[held.block.block_id] = held
        held.parked = True

    def _keeps_place(self, held: _Held) -> bool:
        """Whether a read of this block may leave everything as it is but its stamp: what
        ``_flush`` would decide after keying it, told without keying it. It would keep the
        block's ``_free`` entry as its placeholder and file nothing when the block is not
        parked, its entry is in ``_free``, it is UNDATED or STALE by its fields now (no other
        list holds it, and neither state changes with time), and its key sorts at or after
        the entry: the class of its last keying (priority and released as recorded then;
        that key sorted at or after the entry, or the entry would have been refiled), the
        entry's request priority, and a later stamp. A read follows the field changes of a
        share or a reuse (core._touch), so the fields are checked, not the state of the
        last keying. Under a prefix cache most reads are of such blocks: parked, each was
        keyed again at every read of the lists only to keep its entry, and a tier reclaimed
        in small steps is read often."""
        if not held.in_free:
            return False
        block = held.block
        state = held.state
        if state == UNDATED:
            if block.deadline_us is not None:
                return False
        elif state != STALE or block.deadline_us != held.deadline:
            return False
        key = held.free_key
        return (
            block.priority == held.keyed_priority
            and block.released == held.keyed_released
            and urgency(block) == key[1]
            and block.request_priority == key[2]
        )

    def access(self, block: Block) -> None:
        self._sync()
        block_id = block.block_id
        held = self._held.get(block_id)
        if held is None:
            raise self._unknown(block)
        if not held.parked and not (self.lazy and self._keeps_place(held)):
            self._park_held(held)  # out of its lists under its old stamp
        self._stamp += 1
        held.stamp = self._stamp
        if not self.lazy:
            self._flush()

    def access_many(self, blocks: list[Block]) -> None:
        if not self.lazy:
            super().access_many(blocks)
            return
        self._sync()
        held_of = self._held
        for block in blocks:  # access, written out: the loop of every decode step
            block_id = block.block_id
            held = held_of.get(block_id)
            if held is None:
                raise self._unknown(block)
            if not held.parked and not self._keeps_place(held):
                self._park_held(held)  # under its old stamp
            self._stamp += 1
            held.stamp = self._stamp

    def update(self, block: Block) -> None:
        self._sync()
        self._park(block)
        if not self.lazy:
            self._flush()

    def remove(self, block: Block) -> None:
        self._sync()
        held = self._get(block)
        if held.parked:
            del self._pending[block.block_id]
        else:
            self._unfile(held)
        del self._held[block.block_id]

    def _coldest_first(self) -> Iterator[Block]:
        """The free blocks in order, then the near ones. The stale prefix of ``_free`` is
        popped first; then ``_free`` is walked with its own iterator (an index per entry
        cost a walk of its position tree, and a reclaim passes thousands of stale entries),
        skipping stale entries, and a placeholder met on the way is moved to its block's
        current key, later in the order, where the walk reaches it again."""
        free, held_of = self._free, self._held
        while free and self._holder(free[0], True) is None:
            free.pop(0)
            self._stale -= 1
        # The current keys of the placeholders met, in order; merged into _free by the next
        # _flush (every read starts with one), not filed during the walk.
        moved = self._moved
        j = 0
        for key in free:
            held = self._holder(key, False)
            if held is None:
                continue
            current = self._free_key(held)
            if current != key:
                self._set_free_key(held, current)  # a placeholder: the block's place is later
                bisect.insort(moved, current)  # after every key yielded so far
                self._stale += 1  # its old entry, now stale
                continue
            while j < len(moved) and moved[j] < key:
                yield held_of[moved[j][4]].block
                j += 1
            yield held.block
        while j < len(moved):
            yield held_of[moved[j][4]].block
            j += 1
        for key in reversed(self._near):
            yield held_of[key[2]].block

    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
        self._sync()
        self._flush()
        return take_until(self._coldest_first(), bytes_needed, protected)

    def is_near(self, block: Block) -> bool:
        """Whether the block is held and protected by its deadline now."""
        self._sync()
        self._flush()
        held = self._held.get(block.block_id)
        return held is not None and held.state == NEAR

    def admit_prefetch(self, candidate: Block, victims: list[Block]) -> bool:
        self._sync()
        self._flush()
        now = self.ctx.clock.now_us
        deadline = candidate.deadline_us
        if deadline is None or deadline < now:
            return False
        src = candidate.tier
        load_us = self.ctx.tiers[src].transfer_us(candidate.size) if 0 <= src < len(self.ctx.tiers) else self.recompute_us(candidate)
        must_start = deadline - load_us
        rank = free_rank(candidate)[0]
        for victim in victims:
            held = self._held.get(victim.block_id)
            if held is None:
                held = self._describe(victim)
            if free_rank(victim)[0] > rank:  # held.block is victim
                return False
            if held.state in (FAR, NEAR) and held.latest_start <= must_start:
                return False
        return True

    def _describe(self, block: Block) -> _Held:
        """Keys and state of a block this policy does not hold, as if inserted now."""
        held = _Held(block, -1)
        self._key(held)
        return held

    def score(self, block: Block) -> float:
        """Class rank x 1000 + request priority, plus 10,000 while protected by a deadline."""
        rank, request_priority = free_rank(block)
        return float(rank * 1000 + request_priority + (10_000 if self.is_near(block) else 0))

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._held
