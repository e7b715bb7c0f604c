"""markov_prefetch: kv-hierarchy-lab's predictive policy; first-order Markov successor prefetch."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from policies.base import Block, PolicyContext
from policies.heavy_hitter import HeavyHitterParams, HeavyHitterPolicy
from policies.params import bounded


@dataclasses.dataclass(frozen=True)
class MarkovPrefetchParams(HeavyHitterParams):
    """``freq_weight``: steps of recency one read is worth (the lab's 100); ``fanout``:
    successors proposed per read (2); ``min_count``: times a transition must have been seen
    (2); ``max_successors``: successors remembered per block (8); ``max_sources``: blocks
    whose successors are remembered, the least recently updated dropped first."""

    freq_weight: int = bounded(100, 0, 10**12)
    fanout: int = bounded(2, 1, 1024)
    min_count: int = bounded(2, 1, 2**32)
    max_successors: int = bounded(8, 1, 1024)
    max_sources: int = bounded(1_000_000, 1, 10**8)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("fanout", "min_count", "max_successors", "max_sources"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class MarkovPrefetchPolicy(HeavyHitterPolicy):
    """Evicts the lowest freq x 100 + last step; prefetches the likeliest next blocks.

    Eviction is ``heavy_hitter``'s order with the lab's predictive weight (100).
    Structures, beyond it: an OrderedDict source id -> {successor id: count}, least
    recently updated source first (each inner dict in order of last count, oldest first);
    the id of the previous read; the ids proposed by the latest ``after_access``.

    1. ``insert`` / ``access`` / ``choose_victims``: as ``heavy_hitter``.
    2. ``after_access(block)`` (the top tier's instance sees every read, in any tier):
       count the transition previous read -> this block (a repeated read of the same block
       is not a transition), then propose the successors of this block seen at least twice,
       at most 2, most frequent first, ties by block id. A full successor table (8) makes
       room for a new successor by forgetting the least frequent one (among equals, the
       one counted longest ago): O(max_successors) = O(1).
    3. ``admit_prefetch(candidate, victims)``: True only for a block the latest
       ``after_access`` proposed (the core tries each proposal right after the call).

    Deviations: freq and step as ``heavy_hitter``. The tables are bounded (successors per
    block, and blocks with a table). The core asks ``admit_prefetch`` only when room must
    be made; since this policy defines it, the core also prefetches blocks whose deadline
    comes within reach into free room (never over victims: those are refused here).
    """

    name = "markov_prefetch"
    description = "kv-hierarchy-lab predictive: lowest reads x 100 + last step leaves first; prefetches Markov successors"
    Params = MarkovPrefetchParams

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._successors: OrderedDict[str, dict[str, int]] = OrderedDict()
        self._previous: str | None = None
        self._proposed: frozenset[str] = frozenset()

    def successors(self, block_id: str) -> dict[str, int]:
        """Successor counts of a block (a copy; empty if none)."""
        return dict(self._successors.get(block_id, {}))

    def _learn(self, source: str, target: str) -> None:
        tables = self._successors
        table = tables.get(source)
        if table is None:
            table = tables[source] = {}
            if len(tables) > self.params.max_sources:
                tables.popitem(last=False)
        else:
            tables.move_to_end(source)
        count = table.pop(target, 0) + 1
        if count == 1 and len(table) >= self.params.max_successors:
            # min() returns the first minimum: the least frequent, counted longest ago.
            del table[min(table, key=table.__getitem__)]
        table[target] = count

    def predict(self, block_id: str) -> list[str]:
        """Successors of ``block_id`` seen at least min_count times, best first."""
        table = self._successors.get(block_id)
        if not table:
            return []
        ranked = sorted((-count, target) for target, count in table.items() if count >= self.params.min_count)
        return [target for _, target in ranked[: self.params.fanout]]

    def after_access(self, block: Block) -> Iterable[str]:
        current = block.block_id
        previous, self._previous = self._previous, current
        if previous is not None and previous != current:
            self._learn(previous, current)
        proposals = self.predict(current)
        self._proposed = frozenset(proposals)
        return proposals

    def admit_prefetch(self, candidate: Block, victims: list[Block]) -> bool:
        return candidate.block_id in self._proposed
