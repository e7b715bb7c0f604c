"""LRU: the least recently used block leaves first.

Request-scoped uses (``BlocksAccessed.scope``, ``BlockAllocated.scope``; docs/schema.md)
rank as vLLM's LRU ranks a running request's chunks: a scope (a request) takes its rank
when the core opens it, as that moment's newest use, and every block it uses ranks there,
tails before heads. So a chunk a long-running request stores late goes *below* chunks
used since the request began, not to the newest end. Without scoped uses the policy is
the plain move-to-end LRU, with no extra cost per use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from mypy_extensions import mypyc_attr

from policies.base import Block, Policy, PolicyContext, take_until


class RankedScope:
    """A scope's place in the recency order, and the blocks ranked there.

    ``entries`` are ``(-position, block_id, block)``: a higher token position ranks lower
    (tails leave first), equal positions (a hybrid model's KV cache groups) by id. They are
    kept highest rank first, so that the usual run (a request stores head to tail, its
    finish reads tail first) appends and pops at the end."""

    __slots__ = ("rank", "entries", "open")

    def __init__(self, rank: int) -> None:
        # The core's rank of the scope: the index of the event that opened it.
        self.rank = rank
        self.entries: list[tuple[int, str, Block]] = []
        # Open while the scope can rank more blocks; a closed one leaves the order once empty.
        self.open = True


# Compiled (broker/native.py): interpreted policies may subclass it, and copy.deepcopy
# needs its __new__ to be empty (see policies.base.Block).
@mypyc_attr(allow_interpreted_subclasses=True)
class LRUPolicy(Policy):
    """Evicts the least recently inserted or accessed block; ignores intent.

    Structure: one OrderedDict, oldest first. OrderedDict is a C-implemented doubly linked
    list plus a hash: insert, move-to-end and delete are O(1) with no scan.

    A request scope sits in that order as one slot (a ``RankedScope`` key), put there when
    the core opens it; its blocks are a sorted list there (a scoped use is a binary search
    plus a list insert). Deciding whether a scoped use raises a block needs when it was last
    used plainly: once a scope has opened, each plain use records the event's index (the
    clock the core ranks scopes by); a block with none was last used before any scope
    opened, so it ranks below all.
    """

    name = "lru"
    description = "least recently used leaves first; ignores intent (the baseline)"

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        # block id -> Block (a plain use), or RankedScope -> itself (a scope's slot)
        self._order: OrderedDict[Any, Any] = OrderedDict()
        # Request scopes: the open ones by rank, and the scope each scoped block ranks with
        # (with its -position). All empty until the core opens a scope.
        self._scopes: dict[int, RankedScope] = {}
        self._member: dict[str, tuple[RankedScope, int]] = {}
        # block id -> the event index of its last plain use (kept once a scope has opened)
        self._plain_at: dict[str, int] = {}
        self._clock = ctx.clock
        self._scoped = False
        self._slots = 0  # RankedScope slots in _order

    def insert(self, block: Block) -> None:
        block_id = block.block_id
        self._order[block_id] = block
        if self._scoped:
            self._plain_at[block_id] = self._clock.event_index

    def access(self, block: Block) -> None:
        if self._scoped:
            self._plain_use(block)
        else:
            self._order.move_to_end(block.block_id)

    def access_many(self, blocks: list[Block]) -> None:
        if self._scoped:
            for block in blocks:
                self._plain_use(block)
            return
        move_to_end = self._order.move_to_end
        for block in blocks:
            move_to_end(block.block_id)

    def remove(self, block: Block) -> None:
        block_id = block.block_id
        if self._scoped:
            self._plain_at.pop(block_id, None)
            member = self._member.pop(block_id, None)
            if member is not None:
                self._leave(member[0], member[1], block_id)
                return
        if self._order.pop(block_id, None) is None:
            raise self._unknown(block)

    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
        if self._slots == 0:
            return take_until(self._order.values(), bytes_needed, protected)
        return take_until(self._ranked(), bytes_needed, protected)

    def __len__(self) -> int:
        return len(self._order) - self._slots + len(self._member)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._order or block_id in self._member

    # ---- request scopes -------------------------------------------------------------------

    def scope_opened(self, rank: int) -> None:
        self._open(rank)

    def access_scoped(self, blocks: list[Block], rank: int, positions: dict[str, int]) -> None:
        ranked = self._open(rank)
        member = self._member
        for block in blocks:
            block_id = block.block_id
            neg = -positions.get(block_id, 0)
            current = member.get(block_id)
            if current is not None:
                # Only up: a later scope's rank is above, and in the same scope a lower
                # position (a head) is above a higher one.
                held, held_neg = current
                if held.rank > ranked.rank or (held is ranked and held_neg >= neg):
                    continue
                del member[block_id]
                self._leave(held, held_neg, block_id)
            else:
                if self._plain_at.get(block_id, -1) >= ranked.rank:
                    continue  # used since the scope opened: already above it
                del self._order[block_id]
            self._join(ranked, neg, block)

    def place_scoped(self, block: Block, rank: int, position: int) -> None:
        ranked = self._open(rank)
        block_id = block.block_id
        current = self._member.pop(block_id, None)
        if current is not None:
            self._leave(current[0], current[1], block_id)
        else:
            del self._order[block_id]
        self._join(ranked, -position, block)

    def scope_ended(self, rank: int) -> None:
        ranked = self._scopes.pop(rank, None)
        if ranked is not None:
            ranked.open = False
            if not ranked.entries:
                del self._order[ranked]
                self._slots -= 1

    def _open(self, rank: int) -> RankedScope:
        """The scope's slot; made at the newest end when the core opens it (or, after a
        policy swap, at its first use here)."""
        ranked = self._scopes.get(rank)
        if ranked is None:
            self._scoped = True
            ranked = RankedScope(rank)
            self._scopes[rank] = ranked
            self._order[ranked] = ranked
            self._slots += 1
        return ranked

    def _plain_use(self, block: Block) -> None:
        """A plain use once scopes exist: the newest end, numbered."""
        block_id = block.block_id
        member = self._member.pop(block_id, None) if self._member else None
        if member is not None:
            self._leave(member[0], member[1], block_id)
            self._order[block_id] = block
        else:
            self._order.move_to_end(block_id)
        self._plain_at[block_id] = self._clock.event_index

    def _join(self, ranked: RankedScope, neg: int, block: Block) -> None:
        block_id = block.block_id
        entries = ranked.entries
        if entries:
            last = entries[-1]
            if last[0] > neg or (last[0] == neg and last[1] > block_id):  # the usual: below all
                entries.append((neg, block_id, block))
            else:
                entries.insert(_below(entries, neg, block_id), (neg, block_id, block))
        else:
            entries.append((neg, block_id, block))
        self._member[block_id] = (ranked, neg)
        if self._plain_at:
            self._plain_at.pop(block_id, None)

    def _ranked(self) -> Iterator[Block]:
        """Every block, lowest rank first: plain blocks, and each scope's blocks in place."""
        for value in self._order.values():
            if isinstance(value, RankedScope):
                for entry in reversed(value.entries):
                    yield entry[2]
            else:
                yield value

    def _leave(self, ranked: RankedScope, neg: int, block_id: str) -> None:
        entries = ranked.entries
        if entries[-1][1] == block_id:
            entries.pop()
        else:
            del entries[_below(entries, neg, block_id)]
        if not entries and not ranked.open:
            del self._order[ranked]
            self._slots -= 1


def _below(entries: list[tuple[int, str, Block]], neg: int, block_id: str) -> int:
    """The first index of ``entries`` (highest rank first) ranked at or below
    ``(neg, block_id)``: where such an entry is, or goes."""
    lo = 0
    hi = len(entries)
    while lo < hi:
        mid = (lo + hi) // 2
        entry = entries[mid]
        if entry[0] > neg or (entry[0] == neg and entry[1] > block_id):
            lo = mid + 1
        else:
            hi = mid
    return lo
