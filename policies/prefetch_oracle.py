"""prefetch_oracle: Belady's eviction plus prefetch of the blocks the stream reads next
(replay only). A heuristic oracle, not an optimum."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable
from typing import Any

from policies.base import Block, PolicyContext
from policies.belady import BeladyParams, BeladyPolicy
from policies.params import bounded


@dataclasses.dataclass(frozen=True)
class PrefetchOracleParams(BeladyParams):
    """``lookahead_events``: how far ahead, in events of the stream, a block's next read
    makes it a prefetch candidate (the events of about one engine iteration by default)."""

    lookahead_events: int = bounded(64, 1, 10**9)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.lookahead_events, int) or self.lookahead_events < 1:
            raise ValueError(f"lookahead_events must be an integer >= 1, got {self.lookahead_events!r}")


class PrefetchOraclePolicy(BeladyPolicy):
    """Belady's MIN for eviction, plus prefetch with the stream's future. Replay only.

    What it is: a *heuristic* oracle. It knows every future use of every block (the
    ordinals replay gives ``ctx.future``), evicts the block used farthest ahead, and asks
    the core to prefetch each block whose next use comes within ``lookahead_events``
    events, admitting a prefetch only when every block that must leave for it is used
    later than it (so a prefetch never pushes out a block needed sooner). It is not an
    optimum: the best schedule of prefetches over copy channels with transfer times is a
    hard offline problem (Belady's MIN is optimal only for demand caching of equal-size
    blocks), this one is greedy, and a policy may beat it. It is the reference for the
    prefetching policies, which ``belady`` (never prefetching) does not bound.

    Copy channels: the oracle only proposes; the core books every prefetch it carries out
    on the source tier's copy channels, as for any policy, so a prefetch that cannot
    arrive in time is late in the report like anyone's.

    Structures: ``BeladyPolicy``'s, plus (top tier only, built once from ``ctx.future``)
    every future use as a sorted list of (ordinal, block id) and a cursor into it.

    1. ``insert`` / ``access`` / ``remove`` / ``choose_victims``: Belady's.
    2. ``after_access`` (the core calls it on the top tier's policy after each read): on the
       first read of an event, the window end moves to ``event + lookahead_events``; every
       use that entered the window since the last move is proposed once (its block, if it
       is live below the top tier, is offered to ``admit_prefetch`` by the core). O(1)
       amortised per use of the stream.
    3. ``admit_prefetch(candidate, victims)``: yes when the candidate is used again and
       every victim's next use is strictly later than the candidate's.
    """

    name = "prefetch_oracle"
    description = "offline heuristic oracle: Belady eviction plus prefetch of the blocks read within the lookahead (replay only)"
    Params = PrefetchOracleParams

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._uses: list[tuple[int, str]] | None = None  # built on the first proposal (top tier only)
        self._cursor = 0
        self._proposed_at = -1

    def _index(self) -> list[tuple[int, str]]:
        uses = self._uses
        if uses is None:
            uses = self._uses = sorted((o, b) for b, ordinals in self._future.table().items() for o in ordinals)
        return uses

    def after_access(self, block: Block) -> Iterable[str]:
        now = self.ctx.clock.event_index
        if now == self._proposed_at:
            return ()
        self._proposed_at = now
        uses = self._index()
        start = max(self._cursor, bisect.bisect_right(uses, (now, "\U0010ffff")))
        end = bisect.bisect_right(uses, (now + self.params.lookahead_events, "\U0010ffff"), lo=start)
        self._cursor = end
        return dict.fromkeys(b for _, b in uses[start:end])

    def admit_prefetch(self, candidate: Block, victims: list[Block]) -> bool:
        future = self._future
        mine = future.next_use(candidate.block_id)
        if mine == future.NEVER:
            return False
        # A victim needed within the lookahead would have to come back over the same
        # channels: only blocks needed later than that (and later than the candidate) go.
        horizon = max(mine, self.ctx.clock.event_index + self.params.lookahead_events)
        return all(future.next_use(v.block_id) > horizon for v in victims)
