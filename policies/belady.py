"""belady: the offline optimum; the block used farthest in the future leaves first."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from policies.base import Block, Policy, PolicyContext, PolicyError, take_until
from policies.params import bounded
from policies.structures import SortedKeys


@dataclasses.dataclass(frozen=True)
class BeladyParams:
    # Blocks of different sizes: among the `window` farthest-used candidates, evict the
    # ones with the largest size x distance first (0 = plain Belady on next use only).
    size_window: int = bounded(0, 0, 1_000_000)

    def __post_init__(self) -> None:
        if self.size_window < 0:
            raise ValueError(f"size_window must be >= 0, got {self.size_window}")


class BeladyPolicy(Policy):
    """Evicts the block whose next use is farthest away (Belady's MIN). Replay only.

    Structure: a SortedKeys of (next use, block id), farthest last, plus each block's
    current key. A block's next use changes only when it is used, and a use of a block in
    this tier reaches the policy as ``access`` (or ``insert`` when it moves in), so keys
    are exact without rescans. Next uses come from ``ctx.future``, which replay builds from
    the whole stream before running. With equal block sizes and a cache that must take every
    missed block, this is the optimum hit count, the upper bound every report shows.
    """

    name = "belady"
    description = "offline optimum: evicts the block used farthest in the future (replay only)"
    Params = BeladyParams
    offline = True

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        if ctx.future is None:
            raise PolicyError("belady needs the future of the stream: it runs in replay only, not live")
        self._future = ctx.future
        self._order = SortedKeys()
        self._key: dict[str, tuple[int, str]] = {}
        self._blocks: dict[str, Block] = {}

    def _add(self, block: Block) -> None:
        key = (self._future.next_use(block.block_id), block.block_id)
        self._key[block.block_id] = key
        self._blocks[block.block_id] = block
        self._order.add(key)

    def insert(self, block: Block) -> None:
        self._add(block)

    def access(self, block: Block) -> None:
        self._order.remove(self._key[block.block_id])
        self._add(block)

    def remove(self, block: Block) -> None:
        key = self._key.pop(block.block_id, None)
        if key is None:
            raise self._unknown(block)
        del self._blocks[block.block_id]
        self._order.remove(key)

    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
        blocks = self._blocks
        order: Iterator[Block] = (blocks[bid] for _, bid in reversed(self._order) if bid not in protected)
        window = self.params.size_window
        if window:
            # Size-aware variant: a big block used a little sooner can free more for longer.
            head = list(itertools.islice(order, window))
            now = self.ctx.clock.event_index
            head.sort(key=lambda b: (-(self._key[b.block_id][0] - now) * b.size, b.block_id))
            order = itertools.chain(head, order)
        return take_until(order, bytes_needed, frozenset())

    def score(self, block: Block) -> float:
        key = self._key.get(block.block_id)
        return float(key[0]) if key else 0.0

    def __len__(self) -> int:
        return len(self._key)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._key
