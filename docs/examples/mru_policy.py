"""MRU, an out-of-tree kvbroker policy: docs/writing-a-policy.md walks through it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set as AbstractSet
from typing import Any

from policies.base import Block, Policy, PolicyContext, take_until


class MRUPolicy(Policy):
    """Evicts the most recently used block first: for a loop over more blocks than fit
    (a long prompt read again and again), where LRU evicts each block just before its reuse.

    Structure: one OrderedDict, least recently used first.

    1. ``insert`` and ``access`` put the block at the newest end.
    2. ``choose_victims`` walks from the newest end, skipping protected blocks; it changes
       nothing (the core calls ``evicted`` for each block it really moves out).
    """

    name = "mru"
    description = "most recently used leaves first (loops larger than the tier)"

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._order: OrderedDict[str, Block] = OrderedDict()

    def insert(self, block: Block) -> None:
        self._order[block.block_id] = block

    def access(self, block: Block) -> None:
        self._order.move_to_end(block.block_id)

    def remove(self, block: Block) -> None:
        if self._order.pop(block.block_id, None) is None:
            raise self._unknown(block)

    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
        return take_until(reversed(self._order.values()), bytes_needed, protected)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._order
