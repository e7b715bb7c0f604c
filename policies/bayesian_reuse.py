"""bayesian_reuse: Beta-Bernoulli reuse predictor per (block type, transition); the block
least likely to be reused within the horizon leaves first."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from enum import IntEnum
from typing import Any

from sortedcontainers import SortedList

from policies.base import Block, Policy, PolicyContext, take_until


class Transition(IntEnum):
    """What last happened to a block, as this tier's policy saw it."""

    ALLOCATED = 0  # inserted, never read nor brought back by a prompt: a new block
    PROMOTED_IN = 1  # entered the top tier from below (a read, a prefetch) or was unpinned there
    DEMOTED_IN = 2  # entered a lower tier: pushed down from above
    PREFIX_REUSE = 3  # read because a later prompt brought it again (block.reuses grew)
    READ = 4  # any other read: a decode or prefill step
    RELEASED = 5  # its last reference was dropped: cached, evictable


# (phase, priority, is_draft, has children, transition)
Cell = tuple[int, int, bool, bool, int]


@dataclasses.dataclass(frozen=True)
class BayesianReuseParams:
    """``prior_alpha`` / ``prior_beta``: the Beta prior of every cell (1/1: uniform);
    ``horizon_us``: a reuse counts as a success when it comes within this much event time
    of the block's last event."""

    prior_alpha: float = 1.0
    prior_beta: float = 1.0
    horizon_us: int = 1_000_000

    def __post_init__(self) -> None:
        for name in ("prior_alpha", "prior_beta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if not isinstance(self.horizon_us, int) or isinstance(self.horizon_us, bool) or self.horizon_us <= 0:
            raise ValueError(f"horizon_us must be an integer > 0, got {self.horizon_us!r}")


class _Trial:
    """A held block's open question, "reused within the horizon?", and its sort key."""

    __slots__ = ("accesses", "block", "cell", "entry", "released", "reuses", "since_us", "transition")

    def __init__(self, block: Block) -> None:
        self.block = block
        self.cell: Cell = (0, 0, False, False, 0)
        self.transition = Transition.ALLOCATED
        self.since_us = 0
        self.accesses = 0
        self.reuses = 0
        self.released = False
        self.entry: tuple[float, int, str] | None = None  # its entry in the order


class BayesianReusePolicy(Policy):
    """Evicts the block with the lowest posterior probability of reuse within the horizon.

    The multi-tier KV-cache reuse predictors, as a Beta-Bernoulli model: blocks are typed
    by (phase, priority, is_draft, has children), and what last happened to a block (its
    ``Transition``) says much about whether it is read again soon: a fresh decode block
    will be, a released chain tail rarely is, a demoted prefix sometimes.

    Structures:
      ``_cells``  dict (block type, transition) -> [successes, failures]; the cell's
                  posterior is Beta(prior_alpha + successes, prior_beta + failures).
      ``_trials`` dict block id -> its open trial: the cell and time of its last
                  transition, its read / reuse counts then, and its current sort entry.
      ``_order``  SortedList of (posterior mean, last_access_us, block id): lowest
                  probability first, then least recently read, then id. Total, so the
                  order is deterministic.

    Steps:
      1. ``insert``: open a trial at now in cell (type, ALLOCATED if the block was never
         read nor reused, else DEMOTED_IN in a lower tier, RELEASED if released, else
         PROMOTED_IN).
      2. ``access``: close the trial as a success if within ``horizon_us`` of its start,
         else a failure (it aged past the horizon first); open a new one as PREFIX_REUSE
         if ``block.reuses`` grew since, else READ.
      3. ``update``: if the block was released since its last event, close the trial (a
         failure if past the horizon, else no outcome: the question is still open but is
         superseded) and open a RELEASED trial. Either way re-key with its current type.
      4. ``evicted``: close the trial as a failure (the tier lost it unread).
         ``remove``: if it was read since (the core moves a read block up, and removes it
         here), a success or failure by the horizon as in step 2; if it is being pinned
         (``block.pinned``, set by the core before it removes), no outcome (it is in use,
         not idle); otherwise (freed) a failure.
      5. The sort key of a block is the posterior mean of its cell when keyed, at its own
         last event: it is fixed between the block's events, while the cells keep learning
         from every other block; a block picks up what was learnt at its next event.
         Outcomes are observed lazily, at the block's own events, never by a scan. The
         price: while a cell's estimate drifts, blocks keyed earlier keep the older
         estimate, so the order between old and new blocks of one cell follows the drift.
      6. ``choose_victims``: ``_order`` from the lowest, skipping protected blocks.

    Every step is O(log n) (one SortedList removal and insertion) plus O(1) dict work.
    """

    name = "bayesian_reuse"
    description = "Beta posterior of reuse within a horizon per (block type, transition); least likely reused leaves first"
    Params = BayesianReuseParams

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._cells: dict[Cell, list[int]] = {}
        self._trials: dict[str, _Trial] = {}
        self._order = SortedList()

    # ---- the model -----------------------------------------------------------------------

    @staticmethod
    def block_type(block: Block) -> tuple[int, int, bool, bool]:
        return (block.phase, block.priority, block.is_draft, block.children > 0)

    def cell_of(self, block: Block, transition: Transition) -> Cell:
        return (*self.block_type(block), int(transition))

    def posterior(self, cell: Cell) -> tuple[float, float]:
        """The Beta(alpha, beta) of the cell."""
        counts = self._cells.get(cell)
        p = self.params
        if counts is None:
            return (p.prior_alpha, p.prior_beta)
        return (p.prior_alpha + counts[0], p.prior_beta + counts[1])

    def probability(self, cell: Cell) -> float:
        """The posterior mean probability of reuse within the horizon."""
        alpha, beta = self.posterior(cell)
        return alpha / (alpha + beta)

    def _observe(self, cell: Cell, reused: bool) -> None:
        counts = self._cells.get(cell)
        if counts is None:
            counts = self._cells[cell] = [0, 0]
        counts[0 if reused else 1] += 1

    # ---- trials --------------------------------------------------------------------------

    def _open(self, trial: _Trial, transition: Transition) -> None:
        block = trial.block
        trial.transition = transition
        trial.cell = self.cell_of(block, transition)
        trial.since_us = self.ctx.clock.now_us
        trial.accesses = block.accesses
        trial.reuses = block.reuses
        trial.released = block.released
        self._rekey(trial)

    def _rekey(self, trial: _Trial) -> None:
        block = trial.block
        if trial.entry is not None:
            self._order.remove(trial.entry)
        trial.entry = (self.probability(self.cell_of(block, trial.transition)), block.last_access_us, block.block_id)
        self._order.add(trial.entry)

    def _close_read(self, trial: _Trial, read_at_us: int) -> None:
        self._observe(trial.cell, read_at_us - trial.since_us <= self.params.horizon_us)

    def _take(self, block: Block) -> _Trial:
        trial = self._trials.pop(block.block_id, None)
        if trial is None:
            raise self._unknown(block)
        assert trial.entry is not None  # keyed at insert
        self._order.remove(trial.entry)
        return trial

    def _get(self, block: Block) -> _Trial:
        trial = self._trials.get(block.block_id)
        if trial is None:
            raise self._unknown(block)
        return trial

    # ---- the interface -------------------------------------------------------------------

    def insert(self, block: Block) -> None:
        if block.accesses == 0 and block.reuses == 0:
            transition = Transition.ALLOCATED
        elif self.ctx.tier.index > 0:
            transition = Transition.DEMOTED_IN
        elif block.released:
            transition = Transition.RELEASED
        else:
            transition = Transition.PROMOTED_IN
        trial = _Trial(block)
        self._trials[block.block_id] = trial
        self._open(trial, transition)

    def access(self, block: Block) -> None:
        trial = self._get(block)
        self._close_read(trial, self.ctx.clock.now_us)
        self._open(trial, Transition.PREFIX_REUSE if block.reuses > trial.reuses else Transition.READ)

    def update(self, block: Block) -> None:
        trial = self._get(block)
        if block.released and not trial.released:
            if self.ctx.clock.now_us - trial.since_us > self.params.horizon_us:
                self._observe(trial.cell, False)
            self._open(trial, Transition.RELEASED)
            return
        trial.released = block.released
        self._rekey(trial)

    def remove(self, block: Block) -> None:
        trial = self._take(block)
        if block.accesses > trial.accesses:
            self._close_read(trial, block.last_access_us)
        elif not block.pinned:
            self._observe(trial.cell, False)

    def evicted(self, block: Block) -> None:
        trial = self._take(block)
        self._observe(trial.cell, False)

    def transition(self, block: Block) -> Transition:
        """What last happened to a held block: the transition its open trial is about."""
        return self._get(block).transition

    def _coldest_first(self) -> Iterator[Block]:
        trials = self._trials
        for entry in self._order:
            yield trials[entry[2]].block

    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
        return take_until(self._coldest_first(), bytes_needed, protected)

    def score(self, block: Block) -> float:
        """The block's reuse probability as keyed (now, from its cell, if not held)."""
        trial = self._trials.get(block.block_id)
        if trial is None or trial.entry is None:
            return self.probability(self.cell_of(block, Transition.READ))
        return trial.entry[0]

    def __len__(self) -> int:
        return len(self._trials)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._trials
