"""history_arc: ARC whose frequency side also takes the blocks the core's history has seen
before, however long ago they left (the default policy)."""

from __future__ import annotations

from policies.arc import ARCPolicy
from policies.base import Block


class HistoryARCPolicy(ARCPolicy):
    """ARC (policies/arc.py), with two changes for blocks that come back after ARC forgot
    them, which the core's history still knows:

    1. A block inserted that the core's history says was used before joins T2, the
       frequency side, as a block ARC's own ghosts know does.
    2. If that history says the block had been reused before it left (it was on the
       frequency side then), p (T1's target) shrinks by the block's size, as a B2 ghost hit
       shrinks it: the frequency side lost a block it should have kept.

    Why: ARC's ghosts (B1, B2) hold at most a tier's capacity of evicted ids, so a prefix
    that comes back after more than a tier's worth of evictions looks new to ARC: it
    enters T1, the recency side, where the next burst of new prompts flushes it, and ARC
    never learns that its frequency side was too small. Prefix caches see exactly that
    pattern: a conversation's next turn and a shared document's next reader come back
    after many other requests. The core keeps a freed block's history as a ghost for
    ``history.ghosts`` tier capacities (8 by default; vLLM's ``kvbroker_history_ghosts``)
    and counts a block stored again as one more reuse (``block.reuses`` >= 1 at insert,
    >= 2 if it had been reused before it left), so this policy reads that longer memory
    rather than keeping a second one. A return of a block never reused before it left
    (a prompt seen once, back once) joins T2 but does not move p: with every block reused
    once at most (two-turn chat), counting those returns as frequency evidence would
    shrink T1 to nothing and lose the recency that serves them (measured: 4% of LRU's
    hits instead of 215%).

    Everything else is ARC's, decision for decision: with no block returning from the
    core's history (a history bound of 0 inside vLLM, or every block new) it is ``arc``.
    docs/policies.md has the measurements and the command behind them.
    """

    name = "history_arc"
    description = "ARC + the core's history: a block back after ARC forgot it joins the frequency side (the default)"

    def insert(self, block: Block) -> None:
        bid = block.block_id
        if self._apply_ghost_hit(block) or self._ghost_hit == bid:
            t2 = True  # ARC's own case II or III: p already adapted
        elif block.reuses > 0:
            t2 = True
            if block.reuses > 1:
                self.p = max(0.0, self.p - block.size)
        else:
            t2 = False
        if t2:
            self._t2[bid] = block
            self._t2_bytes += block.size
        else:
            self._t1[bid] = block
            self._t1_bytes += block.size
        self._ghost_hit = ""
        self._arriving = None
