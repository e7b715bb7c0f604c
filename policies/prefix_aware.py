"""prefix_aware: chain tails first, then blocks no later prompt has brought back, then the
reused prefixes; a burst of one-time prompts cannot flush the shared ones."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from policies.base import Block, Policy, PolicyContext, take_until
from policies.params import bounded

TAIL, PROBATION, REUSED = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class PrefixAwareParams:
    # A block joins the reused segment once later prompts brought it back this many times.
    reuse_threshold: int = bounded(1, 1, 2**32)
    # The reused segment may hold at most this share of the tier's bytes; its least recent
    # blocks overflow to the probation segment, so reuse that stopped does not squat.
    reused_share: float = bounded(0.8, 0.0, 1.0, lo_open=True)

    def __post_init__(self) -> None:
        if self.reuse_threshold < 1:
            raise ValueError(f"reuse_threshold must be >= 1, got {self.reuse_threshold}")
        if not 0 < self.reused_share <= 1:
            raise ValueError(f"reused_share must be in (0, 1], got {self.reused_share}")


class PrefixAwarePolicy(Policy):
    """Segmented LRU over the prefix-chain structure of KV blocks.

    Structures: three LRU OrderedDicts, evicted in this order:
      TAIL      blocks with no live child and never reused: the end of a prompt's chain.
                A chain's last block is usually partial, and the next turn of the
                conversation hashes it differently, so it is almost never reused (on the
                Mooncake trace: 5% of last blocks, 66% of the others).
      PROBATION blocks with a child, not (yet) brought back by a later prompt; and reused
                blocks pushed out of REUSED by its cap.
      REUSED    blocks a later prompt brought back at least ``reuse_threshold`` times:
                shared system prompts, documents and conversation history, the blocks
                reuse concentrates on. Capped at ``reused_share`` of the tier's bytes.

    Steps:
      1. insert / access: the block goes to the most recent end of its segment (REUSED if
         ``block.reuses`` >= threshold, else TAIL if ``block.children`` == 0, else PROBATION).
      2. update (the core calls it when a block gains its first child or loses its last):
         a block whose segment changed moves, as its most recent entry.
      3. While REUSED holds more than its share, its least recent block moves to PROBATION.
      4. choose_victims walks TAIL, then PROBATION, then REUSED, each least recent first.
    The chain facts come from the core (``children`` counts live child blocks through
    ``parent_id``; ``reuses`` counts prompts that brought the block again), so every step
    is O(1).
    """

    name = "prefix_aware"
    description = "prefix chains: tails first, then unreused blocks, then reused prefixes (segmented LRU)"
    Params = PrefixAwareParams

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._segments: tuple[OrderedDict[str, Block], ...] = (OrderedDict(), OrderedDict(), OrderedDict())
        self._where: dict[str, int] = {}
        self._reused_bytes = 0
        self._reused_cap = int(ctx.tier.capacity_bytes * self.params.reused_share)

    def _segment_of(self, block: Block) -> int:
        if block.reuses >= self.params.reuse_threshold:
            return REUSED
        return TAIL if block.children == 0 else PROBATION

    def _put(self, block: Block, segment: int) -> None:
        self._segments[segment][block.block_id] = block
        self._where[block.block_id] = segment
        if segment == REUSED:
            self._reused_bytes += block.size
            reused = self._segments[REUSED]
            while self._reused_bytes > self._reused_cap and len(reused) > 1:
                _, oldest = reused.popitem(last=False)
                self._reused_bytes -= oldest.size
                self._segments[PROBATION][oldest.block_id] = oldest
                self._where[oldest.block_id] = PROBATION

    def _take(self, block: Block) -> int:
        segment = self._where.pop(block.block_id, None)
        if segment is None:
            raise self._unknown(block)
        del self._segments[segment][block.block_id]
        if segment == REUSED:
            self._reused_bytes -= block.size
        return segment

    def insert(self, block: Block) -> None:
        self._put(block, self._segment_of(block))

    def access(self, block: Block) -> None:
        self._take(block)
        self._put(block, self._segment_of(block))

    def update(self, block: Block) -> None:
        current = self._where.get(block.block_id)
        wanted = self._segment_of(block)
        # A reused block demoted by the cap stays in probation until it is used again.
        if current is not None and current != wanted and not (current == PROBATION and wanted == REUSED):
            self._take(block)
            self._put(block, wanted)

    def remove(self, block: Block) -> None:
        self._take(block)

    def _coldest_first(self) -> Iterator[Block]:
        for segment in self._segments:
            yield from segment.values()

    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
        return take_until(self._coldest_first(), bytes_needed, protected)

    def score(self, block: Block) -> float:
        return float(self._where.get(block.block_id, -1))

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._where
