"""S3-FIFO: a small probation FIFO, a main FIFO and a ghost FIFO (Yang et al., SOSP'23)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from policies.base import Block, Policy, PolicyContext
from policies.params import bounded

MAX_FREQ = 3  # the paper's two-bit counter
VARIANTS = ("paper", "libcachesim")

# What one step of the eviction loop does to a block.
PROMOTE = 0  # oldest of S was read: it moves to the newest end of M, its counter spent
REINSERT = 1  # oldest of M was read: it goes round M again with its counter decremented
EVICT_SMALL = 2  # oldest of S leaves the tier; its id joins the ghost FIFO
EVICT_MAIN = 3  # oldest of M leaves the tier

Step = tuple[int, Block]


@dataclasses.dataclass(frozen=True)
class S3FIFOParams:
    """``small_ratio`` and ``ghost_ratio``: bytes of S and of the ghost FIFO as fractions of
    the tier's capacity; ``move_to_main_threshold``: reads in S that earn a place in M;
    ``variant``: "paper" (Yang et al.) or "libcachesim" (libCacheSim's ``S3FIFO``): until
    the first eviction, a new block goes to M once S holds its share, and S's share is
    counted in whole blocks (the class docstring says more)."""

    small_ratio: float = bounded(0.1, 0.0, 1.0, lo_open=True, hi_open=True)
    ghost_ratio: float = bounded(0.9, 0.0, 1024.0)
    move_to_main_threshold: int = bounded(1, 1, MAX_FREQ)
    variant: str = "paper"

    def __post_init__(self) -> None:
        if not isinstance(self.small_ratio, (int, float)) or not 0.0 < self.small_ratio < 1.0:
            raise ValueError(f"small_ratio must be in (0, 1), got {self.small_ratio!r}")
        if not isinstance(self.ghost_ratio, (int, float)) or self.ghost_ratio < 0.0:
            raise ValueError(f"ghost_ratio must be >= 0, got {self.ghost_ratio!r}")
        threshold = self.move_to_main_threshold
        if not isinstance(threshold, int) or not 1 <= threshold <= MAX_FREQ:
            raise ValueError(f"move_to_main_threshold must be an integer in [1, {MAX_FREQ}], got {threshold!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")


class S3FIFOPolicy(Policy):
    """Quick demotion of one-hit blocks through a small FIFO; lazy promotion in a main FIFO.

    Structures: three OrderedDicts, oldest first: S (small, probation) and M (main) hold
    resident blocks; G (ghost) holds id -> size of blocks evicted from S. A read counter per
    resident block, capped at 3. Sizes are bytes.

    1. ``insert``: a block whose id is in G joins M (it was evicted from S too early);
       any other joins S (in the libCacheSim variant, M while the tier has never evicted
       and S is at its share). Counter 0.
    2. ``access``: counter + 1, capped at 3. Nothing moves: that is the lazy promotion.
    3. The eviction loop, one victim per round. Evict from S if S is at its share, at
       least ``small_ratio`` of the capacity (or M has nothing to give), else from M.
       S: its oldest block moves to M (counter reset) if read at least
       ``move_to_main_threshold`` times, else it is the victim and its id joins G;
       repeat until a victim. M: its oldest block goes round again with its counter
       decremented if it was read, else it is the victim; repeat until a victim.
    4. G keeps at most ``ghost_ratio`` x capacity bytes, oldest dropped first.

    Atomic eviction. The loop moves blocks, so ``choose_victims`` runs it on a read-only
    overlay (``_plan``): cursors over S and M, the blocks the plan sent to M's newest end in
    a side deque with their counters as the plan left them. Protected blocks that the loop
    would evict are stepped over and stay where they are. ``evicted(v)`` runs the same plan
    again, now stepping over every would-be victim that is not ``v`` (exactly the protected
    ones the first plan stepped over, since any other would have been named before ``v``),
    and applies the moves up to and including ``v``. So the victims named are the ones
    S3-FIFO evicts, and the reorganisation happens only when they really leave. The cost
    of a plan is the loop's own work (amortised O(1) per victim: a reinsertion spends a
    read) plus the protected blocks stepped over.

    Paper or libCacheSim (``variant``). The paper (and this policy by default) puts every
    new block in S, so until the tier first fills, S grows past its share and the first
    evictions all come from S: the blocks of the fill that were not read again leave
    first, however recent. libCacheSim's ``S3FIFO`` (0.3.5; its ``S3FIFOv0`` is the
    paper's) sends new blocks to M once S is at its share and nothing was evicted yet, so
    the fill's later blocks live in M and go round it like any other. It also sizes S in
    whole objects (floor(small_ratio x objects)); in bytes that is: S is at its share
    when one more block (the size of S's oldest, or of the block being inserted) would
    take it past ``small_ratio`` x capacity. ``variant=libcachesim`` (``--param
    s3fifo.variant=libcachesim``) does both; with ``move_to_main_threshold=2``
    (libCacheSim's default; the paper's pseudocode moves a block read more than once) it
    is libCacheSim's S3FIFO decision for decision on uniform blocks:
    ``tests/policies/test_libcachesim.py`` checks it at three sizes.

    Deviations: the paper's evictS also calls evictM when moving a block fills M; here
    each round makes exactly one victim and the next round's choice of queue accounts for
    M having grown (libCacheSim's structure). A block moved from S to M starts M with
    counter 0, as in libCacheSim (the read that promoted it is spent).
    """

    name = "s3fifo"
    description = "S3-FIFO: small probation FIFO, main FIFO with reinsertion, ghost FIFO of ids"
    Params = S3FIFOParams

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        capacity = ctx.tier.capacity_bytes
        self._small_target = int(self.params.small_ratio * capacity)
        self._ghost_cap = int(self.params.ghost_ratio * capacity)
        self._threshold: int = self.params.move_to_main_threshold
        # libCacheSim's variant: S is full when one more block would not fit in its share.
        self._libcachesim: bool = self.params.variant == "libcachesim"
        self._has_evicted = False
        self._small: OrderedDict[str, Block] = OrderedDict()
        self._main: OrderedDict[str, Block] = OrderedDict()
        self._ghost: OrderedDict[str, int] = OrderedDict()
        self._freq: dict[str, int] = {}
        self._small_bytes = 0
        self._main_bytes = 0
        self._ghost_bytes = 0

    # ---- queries -------------------------------------------------------------------------

    def queue_of(self, block_id: str) -> str | None:
        """Where ``block_id`` is: "S", "M", "G" (a ghost) or None."""
        if block_id in self._small:
            return "S"
        if block_id in self._main:
            return "M"
        if block_id in self._ghost:
            return "G"
        return None

    def queue_ids(self) -> dict[str, list[str]]:
        """Ids of S, M and G, oldest first (a full copy: for tests and inspection only)."""
        return {"S": list(self._small), "M": list(self._main), "G": list(self._ghost)}

    def freq(self, block_id: str) -> int:
        return self._freq[block_id]

    def score(self, block: Block) -> float:
        return float(self._freq.get(block.block_id, 0))

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._freq

    # ---- events --------------------------------------------------------------------------

    def insert(self, block: Block) -> None:
        bid = block.block_id
        ghost_size = self._ghost.pop(bid, None)
        if ghost_size is not None:
            self._ghost_bytes -= ghost_size
            self._main[bid] = block
            self._main_bytes += block.size
        elif self._libcachesim and not self._has_evicted and self._small_bytes + block.size > self._small_target:
            self._main[bid] = block
            self._main_bytes += block.size
        else:
            self._small[bid] = block
            self._small_bytes += block.size
        self._freq[bid] = 0

    def access(self, block: Block) -> None:
        bid = block.block_id
        self._freq[bid] = min(MAX_FREQ, self._freq[bid] + 1)

    def remove(self, block: Block) -> None:
        bid = block.block_id
        if self._freq.pop(bid, None) is None:
            raise self._unknown(block)
        held = self._small.pop(bid, None)
        if held is not None:
            self._small_bytes -= held.size
        else:
            self._main_bytes -= self._main.pop(bid).size

    # ---- eviction ------------------------------------------------------------------------

    def _plan(self, skip: Callable[[Block], bool]) -> Iterator[Step]:
        """The eviction loop on a read-only overlay, as an endless stream of steps.

        ``skip(block)`` says a block the loop would evict must stay (it is stepped over).
        Ends when neither queue has anything left to give. The caller must stop using the
        stream before changing the policy.
        """
        freq = self._freq
        threshold = self._threshold
        small_iter = iter(self._small.values())
        main_iter = iter(self._main.values())
        # Blocks the plan put at M's newest end, in order, with their counters by then.
        requeued: deque[tuple[Block, int]] = deque()

        def next_main() -> tuple[Block, int] | None:
            block = next(main_iter, None)
            if block is not None:
                return block, freq[block.block_id]
            return requeued.popleft() if requeued else None

        s_next = next(small_iter, None)
        m_next = next_main()
        small_bytes = self._small_bytes
        while s_next is not None or m_next is not None:
            if s_next is not None and (self._small_at_share(small_bytes, s_next.size) or m_next is None):
                while s_next is not None:
                    block, s_next = s_next, next(small_iter, None)
                    if freq[block.block_id] >= threshold:
                        small_bytes -= block.size
                        requeued.append((block, 0))
                        if m_next is None:
                            m_next = next_main()
                        yield PROMOTE, block
                    elif not skip(block):
                        small_bytes -= block.size
                        yield EVICT_SMALL, block
                        break
            else:
                while m_next is not None:
                    (block, count), m_next = m_next, next_main()
                    if count > 0:
                        requeued.append((block, min(count, MAX_FREQ) - 1))
                        if m_next is None:
                            m_next = next_main()
                        yield REINSERT, block
                    elif not skip(block):
                        yield EVICT_MAIN, block
                        break

    def _small_at_share(self, small_bytes: int, oldest: int) -> bool:
        if self._libcachesim:
            return small_bytes + oldest > self._small_target
        return small_bytes >= self._small_target

    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
        victims: list[Block] = []
        if bytes_needed <= 0:
            return victims
        available = self._small_bytes + self._main_bytes
        for bid in protected:
            held = self._small.get(bid) or self._main.get(bid)
            if held is not None:
                available -= held.size
        if available < bytes_needed:
            return None  # without walking every queue round to find out
        got = 0
        for kind, block in self._plan(lambda b: b.block_id in protected):
            if kind in (EVICT_SMALL, EVICT_MAIN):
                victims.append(block)
                got += block.size
                if got >= bytes_needed:
                    return victims
        return None

    def evicted(self, block: Block) -> None:
        """Apply the plan's moves up to ``block``, then evict it (its id joins G if from S)."""
        self._has_evicted = True
        target = block.block_id
        steps: list[Step] = []
        for step in self._plan(lambda b: b.block_id != target):
            steps.append(step)
            if step[1].block_id == target and step[0] in (EVICT_SMALL, EVICT_MAIN):
                break
        else:
            # Not a victim this policy would name: leave the order alone, evict just it.
            steps = [(EVICT_SMALL if target in self._small else EVICT_MAIN, block)]
        for kind, moved in steps:
            self._apply(kind, moved)

    def _apply(self, kind: int, block: Block) -> None:
        bid = block.block_id
        if kind == PROMOTE:
            promoted = self._small.pop(bid)
            self._small_bytes -= promoted.size
            self._main[bid] = promoted
            self._main_bytes += promoted.size
            self._freq[bid] = 0
        elif kind == REINSERT:
            self._main.move_to_end(bid)
            self._freq[bid] = min(self._freq[bid], MAX_FREQ) - 1
        elif kind == EVICT_SMALL:
            held = self._small.pop(bid, None)
            if held is None:
                raise self._unknown(block)
            self._small_bytes -= held.size
            del self._freq[bid]
            self._ghost[bid] = held.size
            self._ghost_bytes += held.size
            while self._ghost_bytes > self._ghost_cap:
                self._ghost_bytes -= self._ghost.popitem(last=False)[1]
        else:
            held = self._main.pop(bid, None)
            if held is None:
                raise self._unknown(block)
            self._main_bytes -= held.size
            del self._freq[bid]
