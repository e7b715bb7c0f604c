"""A tier without the broker: one policy instance, and capacity handled the way the core does.

``SimTier`` mirrors the core's calls: an insert that does not fit first tells the policy
which block arrives (``incoming``), asks it for victims (protecting the incoming block),
tells it ``evicted`` for each, then inserts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from policies.base import Block, Clock, FutureUses, Policy, PolicyContext, TierInfo
from policies.registry import make_params, policy_class


class SimTier:
    """One tier of ``capacity`` bytes driven by the policy named ``policy``.

    Offline policies (Belady) need the future of the stream: ``future`` maps block ids to
    the ordinals of the steps that use them, and the driver sets ``clock.event_index`` to
    the current step's ordinal. Without it an offline policy sees no future uses at all.
    """

    def __init__(
        self,
        policy: str,
        capacity: int,
        params: dict[str, Any] | None = None,
        future: dict[str, list[int]] | None = None,
    ) -> None:
        info = TierInfo(0, "hbm", capacity, 0.0, 1000.0)
        cls = policy_class(policy)
        self.clock = Clock()
        uses = None
        if future is not None or cls.offline:
            uses = FutureUses(future or {}, self.clock)
        ctx = PolicyContext(info, (info,), self.clock, uses)
        self.policy: Policy = cls(ctx, make_params(cls, params))
        self.capacity = capacity
        self.used = 0
        self.blocks: dict[str, Block] = {}
        self.evictions: list[str] = []  # every victim so far, in eviction order

    def insert(self, block_id: str, size: int = 1) -> list[str]:
        """Make ``block_id`` resident, evicting first if it does not fit; returns the victims."""
        assert block_id not in self.blocks, f"{block_id} is already resident"
        over = self.used + size - self.capacity
        victims: list[str] = []
        block = Block(block_id, size)
        if over > 0:
            self.policy.incoming(block)
            chosen = self.policy.choose_victims(over, {block_id})
            assert chosen is not None, f"no room for {block_id}: policy found no victims for {over} bytes"
            victims = self.evict(chosen)
        self.policy.insert(block)
        self.blocks[block_id] = block
        self.used += size
        assert self.used <= self.capacity, f"over capacity: {self.used} > {self.capacity}"
        return victims

    def evict(self, victims: Iterable[Block]) -> list[str]:
        """The core's half of an eviction: each victim leaves the tier, then ``evicted``."""
        ids = []
        for victim in victims:
            del self.blocks[victim.block_id]
            self.used -= victim.size
            self.policy.evicted(victim)
            self.evictions.append(victim.block_id)
            ids.append(victim.block_id)
        return ids

    def make_room(self, bytes_needed: int, protected: Iterable[str] = ()) -> list[str] | None:
        """Evict at least ``bytes_needed`` bytes as a watermark would; None if impossible."""
        chosen = self.policy.choose_victims(bytes_needed, frozenset(protected))
        return None if chosen is None else self.evict(chosen)

    def victims(self, bytes_needed: int, protected: Iterable[str] = ()) -> list[str] | None:
        """The ids the policy would evict for ``bytes_needed`` now (nothing changes)."""
        chosen = self.policy.choose_victims(bytes_needed, frozenset(protected))
        return None if chosen is None else [b.block_id for b in chosen]

    def order(self) -> list[str]:
        """The whole eviction order, coldest first (read-only)."""
        return self.victims(self.used) or []

    def access(self, *block_ids: str) -> None:
        for block_id in block_ids:
            self.policy.access(self.blocks[block_id])

    def update(self, block_id: str, **fields: Any) -> None:
        block = self.blocks[block_id]
        for name, value in fields.items():
            setattr(block, name, value)
        self.policy.update(block)

    def remove(self, block_id: str) -> None:
        block = self.blocks.pop(block_id)
        self.used -= block.size
        self.policy.remove(block)

    def resident(self) -> set[str]:
        return set(self.blocks)


BLOCK = 4096
HOT = [f"hot{i}" for i in range(64)]
BURST = [f"scan{i}" for i in range(1984)]


def scan_burst(policy: str) -> SimTier:
    """The scan-pollution scenario of vLLM's GPU block pool, on a tier of 256 blocks.

    A 64-block hot prefix (a shared system prompt) is cached and read three more times, then
    a burst of 1,984 blocks that are each used once streams through. Returns the tier after
    the burst; a scan-resistant policy still holds the hot prefix.
    """
    tier = SimTier(policy, 256 * BLOCK)
    for block_id in HOT:
        tier.insert(block_id, BLOCK)
    for _ in range(3):
        tier.access(*HOT)
    for block_id in BURST:
        tier.insert(block_id, BLOCK)
    return tier
