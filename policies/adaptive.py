"""adaptive: prefix-chain classes, an ARC-sized probation and two regret-weighted experts
(recency and LFU with dynamic aging) for the reused blocks, and a duel with LRU that makes
the tier follow LRU's order while LRU would serve more; every knob is learned online."""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from policies.base import Block, Policy, PolicyContext, take_until
from policies.params import bounded
from policies.structures import SortedKeys

TAIL, PROBATION, MAIN = 0, 1, 2
RECENCY, FREQUENCY = 0, 1
SEGMENT_NAMES = ("tail", "probation", "main")
EXPERT_NAMES = ("recency", "frequency")

# Recency key (stamp, -position, id) and frequency key (priority, stamp, -position, id).
RecencyKey = tuple[int, int, str]
FrequencyKey = tuple[int, int, int, str]


@dataclasses.dataclass(frozen=True)
class AdaptiveParams:
    """``learning_rate``: how far one regret moves the experts' weights (a ghost hit on an
    expert's victim multiplies its weight by exp(-learning_rate)). 0.45 is LeCaR's (Vietri
    et al., HotStorage'18), taken from the paper, not fitted to any trace: the weights are
    renormalised after every regret, so the rate sets how fast the choice can flip, not
    where it settles."""

    learning_rate: float = bounded(0.45, 0.0, 10.0, lo_open=True)

    def __post_init__(self) -> None:
        if not isinstance(self.learning_rate, (int, float)) or not 0.0 < self.learning_rate <= 10.0:
            raise ValueError(f"learning_rate must be in (0, 10], got {self.learning_rate!r}")


class AdaptivePolicy(Policy):
    """Three classes by what the prefix structure says; the sizes and the order learned online.

    Classes (a block's class follows the core's ``reuses`` and ``children``, kept for every
    block the broker knows, evicted or not):
      TAIL       never reused, released, and nothing hangs off it: a prompt's last block,
                 which the next turn usually hashes differently. Least recent first.
      PROBATION  never reused, with a child: a prompt's new blocks. Least recent first.
      MAIN       brought back by a later prompt at least once. The core remembers reuses
                 across evictions, so a block that comes back after leaving joins MAIN at
                 once: this is the history ARC's second list approximates with ghosts.

    Sizes (ARC, Megiddo and Modha FAST'03, in bytes): PROBATION gets a target ``p``.
    Victims come from TAIL first, then from PROBATION while it holds more than ``p``, else
    from MAIN (PROBATION once MAIN is empty). Ghosts remember victims: B1 those of
    PROBATION, B2 those of MAIN (with the expert that chose them), each with the bytes
    evicted from its list so far; |PROBATION| + |B1| <= c and |B1| + |B2| <= c (c the
    tier's capacity). A block that comes back while in B1 grows ``p``, one in B2 shrinks
    it, by ARC's step (its size times max(1, |other ghost| / |own ghost|)) scaled by how
    marginal the evidence is: a ghost hit g bytes after the eviction counts min(1, L / g),
    L the size of the list it left (``p`` for PROBATION, c - p for MAIN). A hit that a list
    one block larger would have caught counts fully; one that needed the list to grow
    tenfold counts a tenth. Plain ARC counts every ghost hit alike, which overgrows the
    probation when many new blocks come back much later than any probation could hold
    them; the scaling needs no constant and still lets ``p`` grow from 0 under any reuse
    distance below c.

    Order within MAIN, two experts (LeCaR, Vietri et al. HotStorage'18; Cacheus FAST'21):
      RECENCY    least recently used first; blocks touched in the same run of one request
                 count as touched together, the deeper (later) ones first, so a prefix
                 never loses its head before its tail (a child is only ever read after its
                 parent, so the parent is the better block to keep).
      FREQUENCY  LFU with dynamic aging (LFUDA, Arlitt et al. 2000): priority = L + the
                 block's reuses, L the priority of the last block this expert evicted;
                 ties by recency as above.
    Each has a weight (0.5 at start); victims come from the heavier one (recency on a
    tie). A block that comes back while in B2 was evicted too early by the expert that
    chose it: that expert's weight is multiplied by exp(-learning_rate), then both are
    renormalised.

    Duel with LRU (``_Duel``): an id-only LRU directory and a shadow copy of this policy
    without the duel each simulate the tier on the same requests; while LRU's shadow
    serves significantly more (over a window of the tier's capacity, and by more than
    what switching has cost so far) the victims come in LRU's order. This is what keeps
    the policy from losing to LRU where its own rules are wrong for the workload (a chat
    trace whose every first turn comes back once and fits in the tier).

    Every step is O(log n) (two SortedKeys for MAIN, OrderedDicts elsewhere; the duel
    doubles the work and the memory of ids) and deterministic (no randomness; integer
    bytes; the weights and the duel's counts are floats updated in a fixed order).
    ``choose_victims`` changes nothing, except that its first call after the tier leaves
    LRU's order adopts the shadow's learned state; ``evicted`` files the ghost, moves L.
    """

    name = "adaptive"
    description = "prefix classes + ARC-sized probation + recency/LFUDA experts weighted by regret + a duel with LRU (the adaptive default)"
    Params = AdaptiveParams

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._c = ctx.tier.capacity_bytes
        self._decay = math.exp(-self.params.learning_rate)
        self._tails: OrderedDict[str, Block] = OrderedDict()
        self._probation: OrderedDict[str, Block] = OrderedDict()
        self._probation_bytes = 0
        self._main: dict[str, Block] = {}
        self._main_bytes = 0
        self._keys: dict[str, tuple[RecencyKey, FrequencyKey]] = {}
        self._orders = (SortedKeys(), SortedKeys())
        self._segment: dict[str, int] = {}
        # Ghosts: id -> (size, bytes evicted from the list when it left[, expert]).
        self._b1: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._b2: OrderedDict[str, tuple[int, int, int]] = OrderedDict()
        self._b1_bytes = 0
        self._b2_bytes = 0
        self._evicted_probation = 0
        self._evicted_main = 0
        self.p = 0
        self.weights = [0.5, 0.5]
        self.aging = 0  # LFUDA's L
        # Touch stamps: one per run of touches by one request.
        self._stamp = 0
        self._position = 0
        self._request = ""
        # The duel with LRU (see ``_Duel``); the shadow copy of this policy runs without one.
        self._duel = _Duel(ctx, params) if self.duels else None
        # Resident blocks, least recently requested first: the order followed while LRU wins.
        self._recent: OrderedDict[str, Block] = OrderedDict()

    # Whether this instance duels with LRU; False for the shadow the duel runs.
    duels = True

    # ---- queries -------------------------------------------------------------------------

    def segment_of(self, block_id: str) -> str | None:
        """ "tail", "probation", "main", "B1"/"B2" (a ghost) or None."""
        segment = self._segment.get(block_id)
        if segment is not None:
            return SEGMENT_NAMES[segment]
        if block_id in self._b1:
            return "B1"
        if block_id in self._b2:
            return "B2"
        return None

    def following_lru(self) -> bool:
        """Whether victims come in LRU's order now (LRU won the duel's recent window)."""
        return self._duel is not None and self._duel.following

    def duel_switches(self) -> int:
        """How many times the tier has switched to LRU's order so far."""
        return 0 if self._duel is None else self._duel.switches

    def expert(self) -> int:
        """The expert MAIN's victims come from now (RECENCY on a tie)."""
        return FREQUENCY if self.weights[FREQUENCY] > self.weights[RECENCY] else RECENCY

    def score(self, block: Block) -> float:
        return float(self._segment.get(block.block_id, -1))

    def __len__(self) -> int:
        return len(self._segment)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._segment

    # ---- filing --------------------------------------------------------------------------

    @staticmethod
    def _class_of(block: Block) -> int:
        if block.reuses > 0:
            return MAIN
        # A block its request still holds is not a tail yet: the request may be about to
        # extend it (the prompt's next block links to it only after it is placed).
        return TAIL if block.children == 0 and block.released else PROBATION

    def _touch_stamp(self) -> tuple[int, int]:
        return self._stamp, -self._position

    def _advance(self, block: Block) -> None:
        """A touch: a new stamp unless it continues the current request's run."""
        if block.request_id and block.request_id == self._request:
            self._position += 1
        else:
            self._stamp += 1
            self._position = 0
            self._request = block.request_id

    def _file(self, block: Block, segment: int, stamp: tuple[int, int]) -> None:
        bid = block.block_id
        self._segment[bid] = segment
        if segment == TAIL:
            self._tails[bid] = block
        elif segment == PROBATION:
            self._probation[bid] = block
            self._probation_bytes += block.size
        else:
            self._main[bid] = block
            self._main_bytes += block.size
            recency: RecencyKey = (stamp[0], stamp[1], bid)
            frequency: FrequencyKey = (self.aging + block.reuses, stamp[0], stamp[1], bid)
            self._keys[bid] = (recency, frequency)
            self._orders[RECENCY].add(recency)
            self._orders[FREQUENCY].add(frequency)

    def _unfile(self, block: Block) -> int:
        bid = block.block_id
        segment = self._segment.pop(bid, None)
        if segment is None:
            raise self._unknown(block)
        if segment == TAIL:
            del self._tails[bid]
        elif segment == PROBATION:
            del self._probation[bid]
            self._probation_bytes -= block.size
        else:
            del self._main[bid]
            self._main_bytes -= block.size
            recency, frequency = self._keys.pop(bid)
            self._orders[RECENCY].remove(recency)
            self._orders[FREQUENCY].remove(frequency)
        return segment

    # ---- events --------------------------------------------------------------------------

    def insert(self, block: Block) -> None:
        if self._duel is not None:
            self._duel.request(block, False)
            self._recent[block.block_id] = block
        bid, size = block.block_id, block.size
        ghost1 = self._b1.pop(bid, None)
        if ghost1 is not None:
            self._b1_bytes -= ghost1[0]
            evidence = self._marginal(self._evicted_probation - ghost1[1] + size, self.p + size)
            self.p = min(self._c, self.p + self._step(size, self._b2_bytes, self._b1_bytes + ghost1[0], evidence))
        else:
            ghost2 = self._b2.pop(bid, None)
            if ghost2 is not None:
                self._b2_bytes -= ghost2[0]
                evidence = self._marginal(self._evicted_main - ghost2[1] + size, self._c - self.p + size)
                self.p = max(0, self.p - self._step(size, self._b1_bytes, self._b2_bytes + ghost2[0], evidence))
                self._regret(ghost2[2])
        self._advance(block)
        self._file(block, self._class_of(block), self._touch_stamp())

    @staticmethod
    def _marginal(ghost_age: int, list_bytes: int) -> tuple[int, int]:
        """min(1, list_bytes / ghost_age) as a fraction (numerator, denominator)."""
        return (list_bytes, ghost_age) if ghost_age > list_bytes else (1, 1)

    @staticmethod
    def _step(size: int, other_ghost: int, own_ghost: int, evidence: tuple[int, int]) -> int:
        """ARC's step for a ghost hit, in bytes (integer arithmetic: replay is exact)."""
        ratio = max(1, other_ghost // max(1, own_ghost))
        return size * ratio * evidence[0] // evidence[1]

    def _regret(self, expert: int) -> None:
        weights = self.weights
        weights[expert] *= self._decay
        total = weights[RECENCY] + weights[FREQUENCY]
        weights[RECENCY] /= total
        weights[FREQUENCY] /= total

    def access(self, block: Block) -> None:
        if self._duel is not None:
            self._duel.request(block, True)
            self._recent.move_to_end(block.block_id)
        self._unfile(block)
        self._advance(block)
        self._file(block, self._class_of(block), self._touch_stamp())

    def update(self, block: Block) -> None:
        segment = self._segment.get(block.block_id)
        # Only a change of class moves a block (released with no child: a tail; a tail
        # that gained a child); any other intent change keeps its place.
        if segment is not None and segment != MAIN and self._class_of(block) != segment:
            self._unfile(block)
            self._file(block, self._class_of(block), self._touch_stamp())
        if self._duel is not None:
            self._duel.update(block)

    def remove(self, block: Block) -> None:
        self._unfile(block)
        if self._duel is not None:
            del self._recent[block.block_id]
            self._duel.remove(block)

    def evicted(self, block: Block) -> None:
        if self._duel is not None:
            del self._recent[block.block_id]
            if self._duel.following:
                # LRU's order chose this victim: no ghost, no regret, no aging (they would
                # teach this order's learning about choices it did not make).
                self._unfile(block)
                return
        bid, size = block.block_id, block.size
        keys = self._keys.get(bid)
        segment = self._unfile(block)
        if segment == PROBATION:
            self._evicted_probation += size
            self._b1[bid] = (size, self._evicted_probation)
            self._b1_bytes += size
        elif segment == MAIN:
            expert = self.expert()
            if expert == FREQUENCY and keys is not None:
                # LFUDA's aging: the next priorities start from the one just evicted.
                self.aging = max(self.aging, keys[FREQUENCY][0])
            self._evicted_main += size
            self._b2[bid] = (size, self._evicted_main, expert)
            self._b2_bytes += size
        self._trim_ghosts()

    def _adopt(self, duel: _Duel) -> None:
        """Back from LRU's order: take what the OWN shadow learned meanwhile (``p``, the
        experts' weights, LFUDA's L), since this tier's own learning paused while LRU chose."""
        duel.adopt = False
        own = duel.own
        self.p = own.p
        self.weights = list(own.weights)
        self.aging = max(self.aging, own.aging)

    def _trim_ghosts(self) -> None:
        while self._b1 and self._probation_bytes + self._b1_bytes > self._c:
            self._b1_bytes -= self._b1.popitem(last=False)[1][0]
        while self._b1_bytes + self._b2_bytes > self._c:
            if self._b2:
                self._b2_bytes -= self._b2.popitem(last=False)[1][0]
            else:
                self._b1_bytes -= self._b1.popitem(last=False)[1][0]

    # ---- victims -------------------------------------------------------------------------

    def _main_order(self) -> Iterator[Block]:
        main = self._main
        for key in self._orders[self.expert()]:
            yield main[key[-1]]

    def _first_unprotected(self, protected: AbstractSet[str]) -> Block | None:
        """The first victim after the tails: PROBATION's oldest while it holds more than
        ``p`` (or MAIN has none to give), else MAIN's first in the expert's order."""
        if self._probation_bytes > self.p:
            for block in self._probation.values():
                if block.block_id not in protected:
                    return block
        main = self._main
        for key in self._orders[self.expert()]:
            if key[-1] not in protected:
                return main[key[-1]]
        for block in self._probation.values():
            if block.block_id not in protected:
                return block
        return None

    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
        if self._duel is not None and self._duel.adopt:
            self._adopt(self._duel)
        if self._duel is not None and self._duel.following:
            return take_until(self._recent.values(), bytes_needed, protected)
        victims: list[Block] = []
        if bytes_needed <= 0:
            return victims
        got = 0
        for block in self._tails.values():
            if block.block_id not in protected:
                victims.append(block)
                got += block.size
                if got >= bytes_needed:
                    return victims
        if not victims:
            # The usual case, one block from PROBATION or MAIN makes the room: found without
            # the general walk's generators (a third of this method's time in a replay).
            first = self._first_unprotected(protected)
            if first is not None and first.size >= bytes_needed:
                return [first]
        probation = (b for b in self._probation.values() if b.block_id not in protected)
        main = (b for b in self._main_order() if b.block_id not in protected)
        next_probation = next(probation, None)
        next_main = next(main, None)
        probation_bytes = self._probation_bytes
        while got < bytes_needed:
            if next_probation is not None and (probation_bytes > self.p or next_main is None):
                victim, next_probation = next_probation, next(probation, None)
                probation_bytes -= victim.size
            elif next_main is not None:
                victim, next_main = next_main, next(main, None)
            else:
                return None
            victims.append(victim)
            got += victim.size
        return victims


class AdaptiveWithoutDuel(AdaptivePolicy):
    """adaptive without the duel: the shadow the duel runs to know what its own order earns."""

    duels = False


class _LruGhost:
    """What LRU would hold in a tier of ``capacity`` bytes: ids and sizes only, no blocks."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0

    def request(self, block_id: str, size: int) -> bool:
        """A prompt asks for the block: True if LRU would have it (a hit), then it is the
        most recent; else it is placed and the least recent leave until it fits."""
        sizes = self._sizes
        if block_id in sizes:
            sizes.move_to_end(block_id)
            return True
        sizes[block_id] = size
        self._bytes += size
        while self._bytes > self._capacity:
            self._bytes -= sizes.popitem(last=False)[1]
        return False

    def remove(self, block_id: str) -> None:
        size = self._sizes.pop(block_id, None)
        if size is not None:
            self._bytes -= size


class _Duel:
    """Set dueling (Qureshi et al., ISCA'07) between adaptive's own order and LRU's, over
    the whole tier instead of sampled sets. Two shadows see every request the tier sees:

      LRU   an id-only LRU directory of the tier's capacity (``_LruGhost``);
      OWN   adaptive without the duel (``AdaptiveWithoutDuel``) simulating a tier of its
            own: its victims come by the same rules, over the blocks it would hold.

    Each counts the blocks it would have served, in a decayed window. The shadows, not the
    real tier, are compared: while the tier follows LRU its own hits say nothing about
    what adaptive's order would have earned.

    Window: every requested byte multiplies the counts by (1 - 1/c), c the tier's capacity
    in bytes (a hit's weight halves every 0.69 c bytes of requests). A block is worth
    keeping only if it comes back before about c bytes of other blocks pass (no order
    holds more), so c bytes of requests is the shortest span over which an order's choices
    show in its hits; a longer memory keeps following an order after the workload has
    changed. It is the tier's size, not a constant fitted to a trace.

    Entering LRU's order needs evidence beyond noise and beyond the price of switching:
      * noise: only requests where exactly one shadow hits tell the orders apart; if they
        were equally good, LRU's lead would be a difference of coin flips, of standard
        deviation sqrt(disagreements). LRU must lead by two of them (the usual 95% level).
      * price: the real tier holds what adaptive kept, not what LRU kept, so following
        LRU earns LRU's hits only after its content has turned over, and a lead seen in
        the window may be over by then. The price is measured, not assumed: the hits the
        real tier has fallen behind the OWN shadow (which never switched), per switch so
        far. LRU's lead must also exceed that (0 before the first switch).
    Leaving: as soon as LRU's decayed count no longer leads, or OWN has served more
    requests than the real tier since the switch (following LRU is not paying: the lead
    was a phase already over); then the counts restart from zero so that the stale lead
    does not bring the tier straight back.

    While the tier follows LRU its victims leave without ghosts (no regret, no aging, no
    change of ``p``): those choices were LRU's, and adaptive's learning should not be
    taught by them. On leaving, the tier adopts what OWN learned meanwhile (``p``, the
    weights, LFUDA's L): without it, ``two_turn_chat`` at 1.5M tokens lost 3,200 hits
    after one early switch, the tier returning with a ``p`` 19,000 requests stale.

    Cost: one shadow adaptive (O(log n) per event, the ids of one more tier) and one
    OrderedDict (O(1) per event). Deterministic: the counts are floats updated in a fixed
    order, the rest integers.
    """

    def __init__(self, ctx: PolicyContext, params: Any) -> None:
        self._capacity = max(1, ctx.tier.capacity_bytes)
        self._lru = _LruGhost(ctx.tier.capacity_bytes)
        self.own = AdaptiveWithoutDuel(ctx, params)
        self._own_bytes = 0
        # Set on leaving LRU's order: the tier then adopts OWN's learned state.
        self.adopt = False
        # Decayed counts: LRU's hits, OWN's hits, requests where exactly one of them hit.
        self.lru_hits = 0.0
        self.own_hits = 0.0
        self.disagreements = 0.0
        # Undecayed: hits of the real tier and of OWN, to price a switch.
        self._real_total = 0
        self._own_total = 0
        self.switches = 0
        self.following = False
        # Since the last switch to LRU's order: hits of the real tier and of OWN.
        self._real_since = 0
        self._own_since = 0

    def request(self, block: Block, real_hit: bool) -> None:
        """A request the real tier served (``real_hit``) or placed; updates the shadows,
        then whether the tier follows LRU."""
        lru_hit = self._lru.request(block.block_id, block.size)
        own_hit = self._own_request(block)
        keep = max(0.0, 1.0 - block.size / self._capacity)
        self.lru_hits = self.lru_hits * keep + lru_hit
        self.own_hits = self.own_hits * keep + own_hit
        self.disagreements = self.disagreements * keep + (lru_hit != own_hit)
        self._real_total += real_hit
        self._own_total += own_hit
        lead = self.lru_hits - self.own_hits
        if not self.following:
            price = max(0, self._own_total - self._real_total) / max(1, self.switches)
            if lead > 2.0 * math.sqrt(self.disagreements) + price:
                self.following = True
                self.switches += 1
                self._real_since = self._own_since = 0
            return
        self._real_since += real_hit
        self._own_since += own_hit
        if self._own_since > self._real_since:
            self.following = False
            self.adopt = True
            self.lru_hits = self.own_hits = self.disagreements = 0.0
        elif lead <= 0:
            self.following = False
            self.adopt = True

    def _own_request(self, block: Block) -> bool:
        own = self.own
        if block.block_id in own:
            own.access(block)
            return True
        excess = self._own_bytes + block.size - self._capacity
        if excess > 0:
            for victim in own.choose_victims(excess, frozenset()) or ():
                own.evicted(victim)
                self._own_bytes -= victim.size
        own.insert(block)
        self._own_bytes += block.size
        return False

    def update(self, block: Block) -> None:
        if block.block_id in self.own:
            self.own.update(block)

    def remove(self, block: Block) -> None:
        self._lru.remove(block.block_id)
        if block.block_id in self.own:
            self.own.remove(block)
            self._own_bytes -= block.size
