"""Aged LFU: the least frequently used block leaves first; frequencies halve over time."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from policies.base import Block, Policy, PolicyContext, take_until
from policies.params import bounded
from policies.structures import DList, Node


@dataclasses.dataclass(frozen=True)
class LFUParams:
    """``age_every``: accesses between two halvings; ``max_freq``: the counter's ceiling."""

    age_every: int = bounded(4096, 1, 2**32)
    max_freq: int = bounded(63, 1, 65_535)

    def __post_init__(self) -> None:
        if not isinstance(self.age_every, int) or self.age_every < 1:
            raise ValueError(f"age_every must be an integer >= 1, got {self.age_every!r}")
        if not isinstance(self.max_freq, int) or self.max_freq < 1:
            raise ValueError(f"max_freq must be an integer >= 1, got {self.max_freq!r}")


class _Node(Node):
    __slots__ = ("count", "epoch")

    def __init__(self, block: Block) -> None:
        super().__init__(block)
        self.count = 1  # frequency as of ``epoch``
        self.epoch = 0


class LFUPolicy(Policy):
    """Evicts the lowest aged frequency first; within one frequency, the least recent.

    Structures: one intrusive list (``DList``) per frequency level, oldest first; a sorted
    list of the non-empty levels (at most ``max_freq`` + 1, so keeping it sorted is bounded
    work); a node per block holding its count and the epoch that count was taken at.

    Aging without touching every block: the epoch advances every ``age_every`` accesses and
    a block's frequency is ``count >> (epoch - node.epoch)``, computed when needed. Halving
    everyone maps level f to f // 2, so the lists of levels 2k and 2k+1 are spliced into
    level k, in that order, in O(1) each: the blocks follow their lists without being
    visited, and the computed frequency of every block still names the list it is in.

    1. ``insert``: frequency 1, newest end of level 1.
    2. ``access``: frequency + 1 (capped at ``max_freq``), newest end of its new level;
       every ``age_every``-th access then halves everyone (O(levels), amortised O(1)).
    3. ``choose_victims``: levels in ascending order, each from its oldest end, skipping
       protected blocks. Among equal frequencies the order is LRU since the last halving;
       a halving puts the blocks that had the lower frequency first (ties by old frequency,
       then recency), which a splice gives for free.
    """

    name = "lfu"
    description = "least frequently used leaves first (ties by LRU); frequencies halve every age_every accesses"
    Params = LFUParams

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._age_every: int = self.params.age_every
        self._max_freq: int = self.params.max_freq
        self._lists: dict[int, DList[_Node]] = {}
        self._levels: list[int] = []  # non-empty levels, ascending
        self._nodes: dict[str, _Node] = {}
        self._epoch = 0
        self._accesses = 0

    def frequency(self, block: Block) -> int:
        """The block's aged frequency now (0 if the policy does not hold it)."""
        node = self._nodes.get(block.block_id)
        return 0 if node is None else self._level(node)

    def _level(self, node: _Node) -> int:
        return node.count >> (self._epoch - node.epoch)

    def _link(self, node: _Node, level: int) -> None:
        lst = self._lists.get(level)
        if lst is None:
            lst = self._lists[level] = DList()
            bisect.insort(self._levels, level)
        lst.append(node)

    def _unlink(self, node: _Node) -> int:
        level = self._level(node)
        lst = self._lists[level]
        lst.remove(node)
        if not lst:
            del self._lists[level]
            del self._levels[bisect.bisect_left(self._levels, level)]
        return level

    def insert(self, block: Block) -> None:
        node = _Node(block)
        node.epoch = self._epoch
        self._nodes[block.block_id] = node
        self._link(node, 1)

    def access(self, block: Block) -> None:
        node = self._nodes[block.block_id]
        level = self._unlink(node)
        node.count = min(self._max_freq, level + 1)
        node.epoch = self._epoch
        self._link(node, node.count)
        self._accesses += 1
        if self._accesses % self._age_every == 0:
            self._age()

    def _age(self) -> None:
        """Halve every frequency: splice level f into f // 2, lower levels first."""
        merged: dict[int, DList[_Node]] = {}
        for level in self._levels:
            target = level >> 1
            lst = self._lists[level]
            if target in merged:
                merged[target].extend(lst)
            else:
                merged[target] = lst
        self._lists = merged
        self._levels = list(merged)  # built in ascending order of level, so already sorted
        self._epoch += 1

    def remove(self, block: Block) -> None:
        node = self._nodes.pop(block.block_id, None)
        if node is None:
            raise self._unknown(block)
        self._unlink(node)

    def _coldest_first(self) -> Iterator[Block]:
        for level in self._levels:
            for node in self._lists[level]:
                yield node.block

    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
        return take_until(self._coldest_first(), bytes_needed, protected)

    def score(self, block: Block) -> float:
        return float(self.frequency(block))

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._nodes
