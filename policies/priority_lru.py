"""priority_lru: the three-key baseline (priority class, request priority, recency)."""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Any, Final

from mypy_extensions import mypyc_attr

from policies.base import Block, Policy, PolicyContext, Priority, take_until

# Eviction rank of a priority class: lower leaves first. UNSPECIFIED counts as WARM.
_CLASS_RANK: Final[dict[int, int]] = {
    Priority.UNSPECIFIED: 1,
    Priority.COLD: 0,
    Priority.WARM: 1,
    Priority.HOT: 2,
    Priority.DECODE_CRITICAL: 3,
}

Key = tuple[int, int]


# Compiled (broker/native.py): interpreted policies may subclass it, and copy.deepcopy
# needs its __new__ to be empty (see policies.base.Block).
@mypyc_attr(allow_interpreted_subclasses=True)
class PriorityLRUPolicy(Policy):
    """Evicts the coldest priority class first, then the lowest request priority, then LRU.

    An honest comparison with the intent policies needs this baseline: a plain sort on the
    labels the engine already sends. Structure: one OrderedDict (LRU order) per
    (class rank, request priority) bucket and a sorted list of the non-empty bucket keys;
    there are at most 4 x 101 keys, so keeping that list sorted is bounded work. A block
    whose key changes joins its new bucket as its most recent entry.
    """

    name = "priority_lru"
    description = "coldest priority class, then lowest request priority, then least recently used"

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._buckets: dict[Key, OrderedDict[str, Block]] = {}
        self._keys: list[Key] = []  # non-empty bucket keys, ascending
        self._key_of: dict[str, Key] = {}

    @staticmethod
    def key(block: Block) -> Key:
        return (_CLASS_RANK.get(block.priority, 1), block.request_priority)

    def _add(self, block: Block, key: Key) -> None:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = OrderedDict()
            bisect.insort(self._keys, key)
        bucket[block.block_id] = block
        self._key_of[block.block_id] = key

    def _drop(self, block: Block) -> Key:
        key = self._key_of.pop(block.block_id, None)
        if key is None:
            raise self._unknown(block)
        bucket = self._buckets[key]
        del bucket[block.block_id]
        if not bucket:
            del self._buckets[key]
            del self._keys[bisect.bisect_left(self._keys, key)]
        return key

    def insert(self, block: Block) -> None:
        self._add(block, self.key(block))

    def access(self, block: Block) -> None:
        self._buckets[self._key_of[block.block_id]].move_to_end(block.block_id)

    def update(self, block: Block) -> None:
        key = self.key(block)
        if self._key_of.get(block.block_id, key) != key:
            self._drop(block)
            self._add(block, key)

    def remove(self, block: Block) -> None:
        self._drop(block)

    def _coldest_first(self) -> Iterator[Block]:
        for key in self._keys:
            yield from self._buckets[key].values()

    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
        return take_until(self._coldest_first(), bytes_needed, protected)

    def score(self, block: Block) -> float:
        rank, request_priority = self.key(block)
        return float(rank * 1000 + request_priority)

    def admit_prefetch(self, candidate: Block, victims: list[Block]) -> bool:
        """Prefetch only over blocks that rank strictly below the candidate."""
        key = self.key(candidate)
        return all(self.key(v) < key for v in victims)

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._key_of
