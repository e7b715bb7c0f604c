"""two_queue: an inactive (probation) LRU and a capped active LRU, Linux page-cache style."""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Set as AbstractSet
from typing import Any

from policies.base import Block, Policy, PolicyContext, take_until
from policies.params import bounded


@dataclasses.dataclass(frozen=True)
class TwoQueueParams:
    """``active_ratio``: the active queue's cap, as a fraction of the tier's bytes;
    ``promote_after``: reads while inactive that promote a block (1 = the first reuse)."""

    active_ratio: float = bounded(0.5, 0.0, 1.0, lo_open=True)
    promote_after: int = bounded(1, 1, 2**32)

    def __post_init__(self) -> None:
        if not isinstance(self.active_ratio, (int, float)) or not 0.0 < self.active_ratio <= 1.0:
            raise ValueError(f"active_ratio must be in (0, 1], got {self.active_ratio!r}")
        if not isinstance(self.promote_after, int) or self.promote_after < 1:
            raise ValueError(f"promote_after must be an integer >= 1, got {self.promote_after!r}")


class TwoQueuePolicy(Policy):
    """Evicts the inactive queue (LRU) first, then the active queue (LRU).

    The active/inactive design proposed for vLLM's GPU block pool against scan pollution: a
    burst of one-time blocks only ever churns the inactive queue, so blocks that proved
    reuse stay. Structures: two OrderedDicts, oldest first (``_inactive``, ``_active``), the
    active queue's bytes, and per inactive block the reads seen since it entered the queue.

    1. ``insert``: newest end of the inactive queue.
    2. ``access`` of an inactive block: count the read; at ``promote_after`` reads the
       block moves to the newest end of the active queue, else to the newest end of the
       inactive one. ``access`` of an active block: newest end of the active queue.
    3. Cap: while the active queue holds more than ``active_ratio`` x the tier's capacity
       in bytes, its oldest block is demoted to the newest end of the inactive queue (a move
       in policy order, not out of the tier) and must earn its promotion again. Each
       demotion follows a promotion, so this is amortised O(1).
    4. ``choose_victims``: the inactive queue from its oldest end, then the active queue,
       skipping protected blocks. Read-only.
    """

    name = "two_queue"
    description = "new blocks on probation (inactive LRU); reused ones in a capped active LRU, evicted last"
    Params = TwoQueueParams

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._active_cap = int(self.params.active_ratio * ctx.tier.capacity_bytes)
        self._promote_after: int = self.params.promote_after
        self._inactive: OrderedDict[str, Block] = OrderedDict()
        self._active: OrderedDict[str, Block] = OrderedDict()
        self._active_bytes = 0
        self._reads: dict[str, int] = {}  # inactive block id -> reads since it became inactive

    def is_active(self, block: Block) -> bool:
        return block.block_id in self._active

    def insert(self, block: Block) -> None:
        self._inactive[block.block_id] = block
        self._reads[block.block_id] = 0

    def access(self, block: Block) -> None:
        bid = block.block_id
        if bid in self._active:
            self._active.move_to_end(bid)
            return
        reads = self._reads[bid] + 1
        if reads < self._promote_after:
            self._reads[bid] = reads
            self._inactive.move_to_end(bid)
            return
        del self._inactive[bid], self._reads[bid]
        self._active[bid] = block
        self._active_bytes += block.size
        while self._active_bytes > self._active_cap:
            _, demoted = self._active.popitem(last=False)
            self._active_bytes -= demoted.size
            self._inactive[demoted.block_id] = demoted
            self._reads[demoted.block_id] = 0

    def remove(self, block: Block) -> None:
        bid = block.block_id
        if self._inactive.pop(bid, None) is not None:
            del self._reads[bid]
        elif (held := self._active.pop(bid, None)) is not None:
            self._active_bytes -= held.size
        else:
            raise self._unknown(block)

    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
        return take_until(itertools.chain(self._inactive.values(), self._active.values()), bytes_needed, protected)

    def score(self, block: Block) -> float:
        return 1.0 if block.block_id in self._active else 0.0

    def __len__(self) -> int:
        return len(self._inactive) + len(self._active)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._inactive or block_id in self._active
