"""ARC: Adaptive Replacement Cache (Megiddo and Modha, FAST'03), counted in bytes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from policies.base import Block, Policy, PolicyContext


def _unprotected(blocks: Iterator[Block], protected: AbstractSet[str]) -> Iterator[Block]:
    return (b for b in blocks if b.block_id not in protected)


class ARCPolicy(Policy):
    """Balances recency (T1) against frequency (T2), steered by what it evicted too early.

    Structures, all OrderedDicts oldest first; sizes are bytes, since blocks differ:
        T1: resident blocks seen once since they became resident.
        T2: resident blocks seen at least twice, or brought back from a ghost list.
        B1: ghosts (id -> size) of blocks evicted from T1.
        B2: ghosts (id -> size) of blocks evicted from T2.
        p:  the adaptive target for T1's bytes, in [0, c], c = the tier's capacity.

    1. ``insert``: a B1 ghost hit means T1 was too small: p grows by the block's size times
       max(1, |B2| / |B1|) and the block joins T2. A B2 ghost hit shrinks p symmetrically
       and the block joins T2. Otherwise it joins T1.
    2. ``access``: the block moves to the newest end of T2 (from T1 or within T2).
    3. ``choose_victims`` (REPLACE, read-only): take the oldest unprotected block of T1
       while T1's remaining bytes exceed p, else of T2; when one list has nothing left to
       give, the other. T1's bytes are counted down as its victims are taken, so the plan
       is what REPLACE would do victim after victim.
    4. ``evicted``: a victim from T1 becomes the newest ghost of B1, from T2 of B2. Only
       here: a block that leaves by ``remove`` (freed, pinned, moved up by a read) was not
       judged by ARC, so it must not steer p.
    5. Ghost bounds, kept after every insert and eviction: |T1| + |B1| <= c (oldest of B1
       dropped) and |B1| + |B2| <= c (oldest of B2 dropped first, as in ARC's case IV),
       so history never holds more bytes than the tier.

    Deviations from the paper, both forced by the interface: REPLACE's tie rule (take from
    T1 when the incoming block is a B2 ghost and |T1| = p) is dropped, since the incoming
    block is not known when victims are chosen and byte counts rarely tie; and ARC's own
    cache-size bound is the core's capacity check, not the lists' lengths.
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
        self.p = 0

    def insert(self, block: Block) -> None:
        bid, size = block.block_id, block.size
        if bid in self._b1:
            # Integer arithmetic keeps p exact and replay bit-identical.
            delta = size if self._b1_bytes >= self._b2_bytes else size * self._b2_bytes // max(1, self._b1_bytes)
            self.p = min(self._c, self.p + delta)
            self._b1_bytes -= self._b1.pop(bid)
            self._t2[bid] = block
            self._t2_bytes += size
        elif bid in self._b2:
            delta = size if self._b2_bytes >= self._b1_bytes else size * self._b1_bytes // max(1, self._b2_bytes)
            self.p = max(0, self.p - delta)
            self._b2_bytes -= self._b2.pop(bid)
            self._t2[bid] = block
            self._t2_bytes += size
        else:
            self._t1[bid] = block
            self._t1_bytes += size
        self._trim_ghosts()

    def access(self, block: Block) -> None:
        bid = block.block_id
        held = self._t1.pop(bid, None)
        if held is None:
            self._t2.move_to_end(bid)
            return
        self._t1_bytes -= held.size
        self._t2[bid] = held
        self._t2_bytes += held.size

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
        was_t1, size = self._pop_resident(block)
        if was_t1:
            self._b1[block.block_id] = size
            self._b1_bytes += size
        else:
            self._b2[block.block_id] = size
            self._b2_bytes += size
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        while self._b1 and self._t1_bytes + self._b1_bytes > self._c:
            self._b1_bytes -= self._b1.popitem(last=False)[1]
        while self._b1_bytes + self._b2_bytes > self._c:
            if self._b2:
                self._b2_bytes -= self._b2.popitem(last=False)[1]
            else:
                self._b1_bytes -= self._b1.popitem(last=False)[1]

    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
        victims: list[Block] = []
        if bytes_needed <= 0:
            return victims
        from_t1 = _unprotected(iter(self._t1.values()), protected)
        from_t2 = _unprotected(iter(self._t2.values()), protected)
        next1 = next(from_t1, None)
        next2 = next(from_t2, None)
        t1_bytes = self._t1_bytes
        got = 0
        while got < bytes_needed:
            if next1 is not None and (t1_bytes > self.p or next2 is None):
                victim, next1 = next1, next(from_t1, None)
                t1_bytes -= victim.size
            elif next2 is not None:
                victim, next2 = next2, next(from_t2, None)
            else:
                return None
            victims.append(victim)
            got += victim.size
        return victims

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
