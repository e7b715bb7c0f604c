"""Shared base of the score-ordered policies, and the intent terms the seeds' formulas use.

A score-ordered policy keeps every block it holds under a sort key and evicts the smallest
key first; a block's key is computed when the block is inserted, read or updated, and kept
until its next event. The seeds' time-dependent terms (recency, deadlines) are mapped here
once, so that every policy maps them the same way.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Any, Protocol

from policies.base import Block, Policy, PolicyContext, take_until
from policies.structures import SortedKeys

Key = tuple[Any, ...]
Entry = tuple[Key, str]


class ScoredPolicy(Policy):
    """Evicts the block with the smallest ``key`` first; subclasses define the key.

    Structures: a ``SortedKeys`` of ``(key, block id)`` entries, smallest first, and a dict
    block id -> (its current entry, the block). The dict gives each block's current entry,
    so re-keying or removing a block is one O(log n) ``SortedKeys.remove`` plus one ``add``;
    the block id closes every tie, so the order is total.

    1. ``insert``, ``access``, ``update``: compute the key now, replace the block's entry.
    2. ``remove`` / ``evicted``: drop the entry (an unknown block raises ``PolicyError``).
    3. ``choose_victims``: walk the entries from the smallest, skipping protected blocks,
       until enough bytes; nothing changes.
    """

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._order = SortedKeys()
        self._held: dict[str, tuple[Entry, Block]] = {}

    @abstractmethod
    def key(self, block: Block) -> Key:
        """The block's sort key now; the smallest key leaves first."""

    def _place(self, block: Block) -> None:
        """Key the block now; replaces its entry if it already has one."""
        old = self._held.get(block.block_id)
        if old is not None:
            self._order.remove(old[0])
        entry = (self.key(block), block.block_id)
        self._order.add(entry)
        self._held[block.block_id] = (entry, block)

    def _drop(self, block: Block) -> None:
        held = self._held.pop(block.block_id, None)
        if held is None:
            raise self._unknown(block)
        self._order.remove(held[0])

    def _require(self, block: Block) -> None:
        if block.block_id not in self._held:
            raise self._unknown(block)

    def stored_key(self, block_id: str) -> Key | None:
        """The key the block holds in the order (None if the policy does not hold it)."""
        held = self._held.get(block_id)
        return None if held is None else held[0][0]

    def insert(self, block: Block) -> None:
        self._place(block)

    def access(self, block: Block) -> None:
        self._require(block)
        self._place(block)

    def update(self, block: Block) -> None:
        self._require(block)
        self._place(block)

    def remove(self, block: Block) -> None:
        self._drop(block)

    def _coldest_first(self) -> Iterator[Block]:
        held = self._held
        for _, block_id in self._order:
            yield held[block_id][1]

    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
        return take_until(self._coldest_first(), bytes_needed, protected)

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._held


# ---- the seeds' intent terms on our Block ---------------------------------------------------


def recency(block: Block, now_us: int, horizon_us: int) -> float:
    """The seed's recency_score (0..1, 1 = just read): linear decay over ``horizon_us``."""
    return max(0.0, 1.0 - (now_us - block.last_access_us) / horizon_us)


def until_deadline(block: Block, now_us: int) -> int | None:
    """The seed's relative deadline (time until the block is needed), from our absolute one.

    None when the block has no deadline; a deadline already passed counts as 0 (due now),
    since the seed's relative deadline is never negative.
    """
    if block.deadline_us is None:
        return None
    return max(0, block.deadline_us - now_us)


class SeedLabels(Protocol):
    """kv_deadline_scheduler's own per-block labels, for the kvds compatibility replay
    (``broker.replay.kvds_compat``), where a ported policy reads them instead of deriving
    them from event time."""

    def terms(self, block_id: str) -> tuple[float, float, int | None, float | None]:
        """(recency_score as decayed so far, steps since last_access_step, the static
        deadline_us label, steps to target_decode_step, or None for an unset label)."""
        ...

    def last_access_step(self, block_id: str) -> int:
        """The seed's last_access_step label."""
        ...


def descending(text: str) -> tuple[int, ...]:
    """A key under which strings sort in reverse order (the seed's ``max`` tie rule on ids).

    The trailing 1 is above every negated code point, so a string sorts after its own
    extensions, as reversed order wants."""
    return (*(-ord(c) for c in text), 1)


def step_of(ctx: PolicyContext) -> int:
    """The kv-hierarchy-lab's global step: the ordinal of the event being applied (>= 0)."""
    return max(0, ctx.clock.event_index)


class StepScoredPolicy(ScoredPolicy):
    """Base of the kv-hierarchy-lab policies: keys from the block's reads and its last step.

    The lab's "step" is its global access counter; here it is ``clock.event_index`` (a
    lower tier's policy never sees the accesses of the other tiers, so it cannot count
    them itself), and freq is ``block.accesses``, which the core counts on every read.
    Structures, beyond ``ScoredPolicy``'s: a dict block id -> step of its last insert or
    read. Intent is ignored: ``update`` keeps the order.
    """

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._last: dict[str, int] = {}

    def last_step(self, block: Block) -> int:
        """Step of the block's last insert or read (the current step if not held)."""
        return self._last.get(block.block_id, step_of(self.ctx))

    def insert(self, block: Block) -> None:
        self._last[block.block_id] = step_of(self.ctx)
        self._place(block)

    def access(self, block: Block) -> None:
        self._require(block)
        self._last[block.block_id] = step_of(self.ctx)
        self._place(block)

    def update(self, block: Block) -> None:
        self._require(block)

    def remove(self, block: Block) -> None:
        self._drop(block)
        del self._last[block.block_id]

    def score(self, block: Block) -> float:
        """The lab's score (higher = kept), as the block is keyed (now, if not held)."""
        key = self.stored_key(block.block_id)
        return float((self.key(block) if key is None else key)[0])
