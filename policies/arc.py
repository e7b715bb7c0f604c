"""ARC: Adaptive Replacement Cache (Megiddo and Modha, FAST'03), counted in bytes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from policies.base import Block, Policy, PolicyContext

# What the block the core is making room for is, to ARC.
MISS, IN_B1, IN_B2 = 0, 1, 2


def _unprotected(blocks: Iterator[Block], protected: AbstractSet[str]) -> Iterator[Block]:
    return (b for b in blocks if b.block_id not in protected)


class ARCPolicy(Policy):
    """Balances recency (T1) against frequency (T2), steered by what it evicted too early.

    Structures, all OrderedDicts oldest first; sizes are bytes, since blocks differ:
        T1: resident blocks seen once since they became resident.
        T2: resident blocks seen at least twice, or brought back from a ghost list.
        B1: ghosts (id -> size) of blocks evicted from T1.
        B2: ghosts (id -> size) of blocks evicted from T2.
        p:  the adaptive target for T1's bytes, in [0, c], c = the tier's capacity (a
            float: the paper's p is real, and libCacheSim keeps it as a double).

    The paper's cases, for a request of block x (``incoming`` tells ARC which block the
    core is about to make room for, before ``choose_victims``):
      I    x in T1 or T2 (``access``): x moves to T2's newest end.
      II   x in B1: p grows by x's size times max(1, |B2| / |B1|) (|B1| counting x), at
           most c; then REPLACE makes room; x joins T2.
      III  x in B2: p shrinks by x's size times max(1, |B1| / |B2|), at least 0; REPLACE;
           x joins T2.
      IV   x nowhere: for each victim, (A) if |T1| + |B1| + |x| > c, B1's oldest ghost is
           dropped and REPLACE runs, or, with B1 empty, T1's oldest leaves with no ghost;
           (B) otherwise, if |T1| + |T2| + |B1| + |B2| >= 2c, B2's oldest ghost is dropped,
           and REPLACE runs. x joins T1.
    REPLACE: the oldest (unprotected) block of T1 leaves, its ghost the newest of B1, if
    T1 is not empty and (|T1| > p, or |T1| = p and x is in B2), or if T2 has none to give;
    else T2's oldest, its ghost the newest of B2. The adaptation of p (II, III) comes
    before REPLACE, as in the paper: ``choose_victims`` reads the p the incoming block
    will set, and the first ``evicted`` (or ``insert``, if nothing had to leave) sets it.

    ``choose_victims`` changes nothing; ``evicted`` applies the case for each victim. A
    block that leaves by ``remove`` (freed, pinned, moved up by a read) was not judged by
    ARC, so it leaves no ghost. With uniform block sizes this is libCacheSim's ARC (object
    size 1) decision for decision: ``tests/policies/test_libcachesim.py`` checks it on the
    Mooncake trace. In bytes, the step of p is the block's size times the ghost ratio (one
    block's worth, as in the paper's pages); libCacheSim counting bytes would move p by one
    byte. Ghosts hold at most 2c bytes (a bound the cases keep by themselves with uniform
    sizes; it only bites with mixed sizes, oldest of B2 first). Without ``incoming`` (an
    old core, or a test driving the policy by hand) every request counts as case IV until
    ``insert`` finds x among the ghosts, which is what kvbroker's ARC did before.
    """

    name = "arc"
    description = "adaptive replacement cache: recency (T1) vs frequency (T2) balanced by ghost hits, in bytes"

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._c = ctx.tier.capacity_bytes
        self._t1: OrderedDict[str, Block] = OrderedDict()
        self._t2: OrderedDict[str, Block] = OrderedDict()
        self._b1: OrderedDict[str, int] = OrderedDict()
        self._b2: OrderedDict[str, int] = OrderedDict()
        self._t1_bytes = 0
        self._t2_bytes = 0
        self._b1_bytes = 0
        self._b2_bytes = 0
        self.p = 0.0
        # The block the core is making room for (``incoming``), and the one whose ghost
        # hit was already applied by an eviction (it joins T2 when inserted).
        self._arriving: Block | None = None
        self._arriving_event = -1
        self._ghost_hit = ""

    # ---- the request's case --------------------------------------------------------------

    def incoming(self, block: Block) -> None:
        self._arriving = block
        self._arriving_event = self.ctx.clock.event_index
        self._ghost_hit = ""

    def _arrival(self) -> Block | None:
        """The block room is being made for: the one ``incoming`` named during this event.
        Victims asked for otherwise (an engine's EvictionRequested; an arrival that ended
        pinned, so never inserted, in an earlier event) make room for nothing: case IV."""
        return self._arriving if self._arriving_event == self.ctx.clock.event_index else None

    def _case(self) -> int:
        """What the arriving block is: in B1, in B2 (not yet applied) or a miss."""
        arriving = self._arrival()
        if arriving is None:
            return MISS
        bid = arriving.block_id
        if bid in self._b1:
            return IN_B1
        if bid in self._b2:
            return IN_B2
        return MISS

    def _adapted(self, case: int, size: int) -> float:
        """p after the ghost hit of a block of ``size`` bytes (case II or III)."""
        if case == IN_B1:
            return min(float(self._c), self.p + size * max(self._b2_bytes / self._b1_bytes, 1.0))
        return max(0.0, self.p - size * max(self._b1_bytes / self._b2_bytes, 1.0))

    def _apply_ghost_hit(self, block: Block) -> bool:
        """Cases II and III for ``block`` if it is a ghost: adapt p, forget the ghost."""
        bid = block.block_id
        case = IN_B1 if bid in self._b1 else IN_B2 if bid in self._b2 else MISS
        if case == MISS:
            return False
        self.p = self._adapted(case, block.size)
        if case == IN_B1:
            self._b1_bytes -= self._b1.pop(bid)
        else:
            self._b2_bytes -= self._b2.pop(bid)
        self._ghost_hit = bid
        return True

    # ---- events --------------------------------------------------------------------------

    def insert(self, block: Block) -> None:
        bid, size = block.block_id, block.size
        if self._apply_ghost_hit(block) or self._ghost_hit == bid:
            self._t2[bid] = block
            self._t2_bytes += size
        else:
            self._t1[bid] = block
            self._t1_bytes += size
        self._ghost_hit = ""
        self._arriving = None

    def access(self, block: Block) -> None:
        bid = block.block_id
        held = self._t1.pop(bid, None)
        if held is None:
            self._t2.move_to_end(bid)
            return
        self._t1_bytes -= held.size
        self._t2[bid] = held
        self._t2_bytes += held.size

    def refresh(self, blocks: list[Block]) -> None:
        """Used, not read (a request finished with chunks it only stored): the newest end of
        the list each block is in. Not a reuse, so a T1 block stays in T1 (vLLM's ARC does
        the same with a finished request's insertion-only chunks)."""
        t1, t2 = self._t1, self._t2
        for block in blocks:
            bid = block.block_id
            if bid in t1:
                t1.move_to_end(bid)
            else:
                t2.move_to_end(bid)

    def _pop_resident(self, block: Block) -> tuple[bool, int]:
        """Take the block out of T1 or T2: (whether it was in T1, its size)."""
        bid = block.block_id
        held = self._t1.pop(bid, None)
        if held is not None:
            self._t1_bytes -= held.size
            return True, held.size
        held = self._t2.pop(bid, None)
        if held is None:
            raise self._unknown(block)
        self._t2_bytes -= held.size
        return False, held.size

    def remove(self, block: Block) -> None:
        self._pop_resident(block)

    def evicted(self, block: Block) -> None:
        arriving = self._arrival()
        ghost_hit = arriving is not None and (self._apply_ghost_hit(arriving) or self._ghost_hit == arriving.block_id)
        keep_ghost = True
        if not ghost_hit:
            # Case IV: make the history room the paper's way before the victim joins it.
            incoming = arriving.size if arriving is not None else 0
            if self._t1_bytes + self._b1_bytes + incoming > self._c:
                if self._b1:
                    self._b1_bytes -= self._b1.popitem(last=False)[1]
                else:
                    keep_ghost = False  # T1 alone fills the cache: its oldest leaves no ghost
            elif self._b2 and self._t1_bytes + self._t2_bytes + self._b1_bytes + self._b2_bytes >= 2 * self._c:
                self._b2_bytes -= self._b2.popitem(last=False)[1]
        was_t1, size = self._pop_resident(block)
        if not keep_ghost:
            return
        if was_t1:
            self._b1[block.block_id] = size
            self._b1_bytes += size
        else:
            self._b2[block.block_id] = size
            self._b2_bytes += size
        while self._b1_bytes + self._b2_bytes > 2 * self._c:
            if self._b2:
                self._b2_bytes -= self._b2.popitem(last=False)[1]
            else:
                self._b1_bytes -= self._b1.popitem(last=False)[1]

    # ---- victims -------------------------------------------------------------------------

    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
        """The victims ``evicted`` will apply the cases to, one after another, on counters
        that follow what each eviction does to T1, T2 and B1 (nothing changes here)."""
        victims: list[Block] = []
        if bytes_needed <= 0:
            return victims
        arriving = self._arrival()
        case = self._case()
        p = self.p if case == MISS or arriving is None else self._adapted(case, arriving.size)
        incoming = arriving.size if arriving is not None else 0
        c = self._c
        t1, b1 = self._t1_bytes, self._b1_bytes
        # B1's ghosts oldest first (case IV.A drops them), then those this plan adds.
        b1_old = iter(self._b1.values())
        b1_new: list[int] = []
        b1_new_at = 0
        from_t1 = _unprotected(iter(self._t1.values()), protected)
        from_t2 = _unprotected(iter(self._t2.values()), protected)
        next1 = next(from_t1, None)
        next2 = next(from_t2, None)
        got = 0
        while got < bytes_needed:
            if next1 is None and next2 is None:
                return None
            ghost = True
            if case == MISS and t1 + b1 + incoming > c:
                if b1 > 0:  # IV.A: B1's oldest ghost is dropped, then REPLACE
                    dropped = next(b1_old, None)
                    if dropped is None:
                        dropped = b1_new[b1_new_at]
                        b1_new_at += 1
                    b1 -= dropped
                    from_t1_now = t1 > 0 and t1 > p
                else:  # IV.A with B1 empty: T1's oldest leaves, no ghost
                    from_t1_now = True
                    ghost = False
            else:
                from_t1_now = t1 > 0 and (t1 > p or (t1 == p and case == IN_B2))
            if next1 is not None and (from_t1_now or next2 is None):
                victim, next1 = next1, next(from_t1, None)
                t1 -= victim.size
                if ghost:
                    b1 += victim.size
                    b1_new.append(victim.size)
            else:
                assert next2 is not None
                victim, next2 = next2, next(from_t2, None)
            victims.append(victim)
            got += victim.size
        return victims

    # ---- queries -------------------------------------------------------------------------

    def list_of(self, block_id: str) -> str | None:
        """Which list holds ``block_id``: "T1", "T2", "B1", "B2" (ghosts) or None."""
        for label, held in (("T1", self._t1), ("T2", self._t2), ("B1", self._b1), ("B2", self._b2)):
            if block_id in held:
                return label
        return None

    def list_bytes(self) -> dict[str, int]:
        """Bytes in each list (ghosts count the sizes of the blocks they remember)."""
        return {"T1": self._t1_bytes, "T2": self._t2_bytes, "B1": self._b1_bytes, "B2": self._b2_bytes}

    def score(self, block: Block) -> float:
        return 1.0 if block.block_id in self._t2 else 0.0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._t1 or block_id in self._t2
