"""FIFO: the block that became resident first leaves first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set as AbstractSet
from typing import Any

from policies.base import Block, Policy, PolicyContext, take_until


class FIFOPolicy(Policy):
    """Evicts in insertion order; reads and intent changes do not reorder.

    Structure: one OrderedDict, oldest insertion first.

    1. ``insert`` appends the block at the newest end.
    2. ``access`` and ``update`` change nothing: FIFO's whole point is that a hit costs no
       bookkeeping, which is also why it is the floor the other policies must beat.
    3. ``choose_victims`` walks from the oldest end, skipping protected blocks.
    """

    name = "fifo"
    description = "first inserted leaves first; accesses do not reorder"

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._order: OrderedDict[str, Block] = OrderedDict()

    def insert(self, block: Block) -> None:
        self._order[block.block_id] = block

    def access(self, block: Block) -> None:
        pass

    def remove(self, block: Block) -> None:
        if self._order.pop(block.block_id, None) is None:
            raise self._unknown(block)

    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
        return take_until(self._order.values(), bytes_needed, protected)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._order
