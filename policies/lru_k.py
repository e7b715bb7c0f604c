"""LRU-K: evict the block whose K-th most recent reference is oldest (O'Neil et al., SIGMOD'93)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from collections.abc import Set as AbstractSet
from typing import Any

from policies.base import Block, Policy, PolicyContext, take_until
from policies.params import bounded
from policies.structures import IndexedHeap


@dataclasses.dataclass(frozen=True)
class LRUKParams:
    """``k``: which past reference decides (2 = LRU-2); ``retained_ratio``: bytes of history
    kept for evicted blocks, as a fraction of the tier's capacity (0 keeps none)."""

    k: int = bounded(2, 1, 64)
    retained_ratio: float = bounded(1.0, 0.0, 1024.0)

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an integer >= 1, got {self.k!r}")
        if not isinstance(self.retained_ratio, (int, float)) or self.retained_ratio < 0.0:
            raise ValueError(f"retained_ratio must be >= 0, got {self.retained_ratio!r}")


Key = tuple[int, int]


class LRUKPolicy(Policy):
    """Evicts by backward K-distance: blocks with fewer than K references first (by LRU),
    then the block whose K-th most recent reference is oldest.

    Structures: an ``IndexedHeap`` of resident blocks keyed (0, last reference) for blocks
    with fewer than K references (infinite backward K-distance) and (1, K-th most recent
    reference) for the others; per resident block a deque of its last K reference times;
    and the retained history (the paper's "retained information"): an OrderedDict, oldest
    first, id -> (size, reference times) of evicted blocks, bounded in bytes. Times come
    from a counter of the policy's own references, so replay is exact and ties impossible.

    1. ``insert`` is a reference: the block's retained history, if any, comes back, the
       new time is appended, and the block enters the heap.
    2. ``access`` is a reference: append the time, re-key the block (O(log n)).
    3. ``choose_victims``: the heap in ascending key order without popping (O(log k) per
       victim), skipping protected blocks.
    4. ``evicted``: the block leaves the heap; its history is retained, oldest retained
       entries dropped while they exceed ``retained_ratio`` x capacity bytes. A block that
       leaves by ``remove`` (freed, pinned, moved up by a read) is simply forgotten.

    Deviation: no correlated reference period (references in quick succession count as
    separate ones); the broker's reads are already one per engine step.
    """

    name = "lru_k"
    description = "LRU-K (K=2 by default): oldest K-th most recent reference leaves first; fewer than K references first"
    Params = LRUKParams

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._k: int = self.params.k
        self._retained_cap = int(self.params.retained_ratio * ctx.tier.capacity_bytes)
        self._heap: IndexedHeap[Block] = IndexedHeap()
        self._history: dict[str, deque[int]] = {}
        self._retained: OrderedDict[str, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._retained_bytes = 0
        self._now = 0

    def _key(self, history: deque[int]) -> Key:
        if len(history) < self._k:
            return (0, history[-1])
        return (1, history[0])

    def references(self, block_id: str) -> tuple[int, ...]:
        """Reference times the policy remembers for a resident or retained block, oldest first."""
        history = self._history.get(block_id)
        if history is not None:
            return tuple(history)
        retained = self._retained.get(block_id)
        return () if retained is None else retained[1]

    def insert(self, block: Block) -> None:
        bid = block.block_id
        self._now += 1
        retained = self._retained.pop(bid, None)
        history: deque[int] = deque(maxlen=self._k)
        if retained is not None:
            self._retained_bytes -= retained[0]
            history.extend(retained[1])
        history.append(self._now)
        self._history[bid] = history
        self._heap.push(bid, self._key(history), block)

    def access(self, block: Block) -> None:
        bid = block.block_id
        self._now += 1
        history = self._history[bid]
        history.append(self._now)
        self._heap.update(bid, self._key(history))

    def _forget(self, block: Block) -> tuple[int, ...]:
        bid = block.block_id
        if bid not in self._heap:
            raise self._unknown(block)
        self._heap.remove(bid)
        return tuple(self._history.pop(bid))

    def remove(self, block: Block) -> None:
        self._forget(block)

    def evicted(self, block: Block) -> None:
        history = self._forget(block)
        if block.size > self._retained_cap:
            return
        self._retained[block.block_id] = (block.size, history)
        self._retained_bytes += block.size
        while self._retained_bytes > self._retained_cap:
            self._retained_bytes -= self._retained.popitem(last=False)[1][0]

    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
        return take_until(self._heap.ordered(), bytes_needed, protected)

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._heap
