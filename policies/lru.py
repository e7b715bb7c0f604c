"""LRU: the least recently used block leaves first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set as AbstractSet
from typing import Any

from mypy_extensions import mypyc_attr

from policies.base import Block, Policy, PolicyContext, take_until


# Compiled (broker/native.py): interpreted policies may subclass it, and copy.deepcopy
# needs its __new__ to be empty (see policies.base.Block).
@mypyc_attr(allow_interpreted_subclasses=True)
class LRUPolicy(Policy):
    """Evicts the least recently inserted or accessed block; ignores intent.

    Structure: one OrderedDict, oldest first. OrderedDict is a C-implemented doubly linked
    list plus a hash: insert, move-to-end and delete are O(1) with no scan.
    """

    name = "lru"
    description = "least recently used leaves first; ignores intent (the baseline)"

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._order: OrderedDict[str, Block] = OrderedDict()

    def insert(self, block: Block) -> None:
        self._order[block.block_id] = block

    def access(self, block: Block) -> None:
        self._order.move_to_end(block.block_id)

    def access_many(self, blocks: list[Block]) -> None:
        move_to_end = self._order.move_to_end
        for block in blocks:
            move_to_end(block.block_id)

    def remove(self, block: Block) -> None:
        if self._order.pop(block.block_id, None) is None:
            raise self._unknown(block)

    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
        return take_until(self._order.values(), bytes_needed, protected)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._order
