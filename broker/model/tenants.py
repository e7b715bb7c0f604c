"""Blocks per tenant, for ``limits.max_blocks_per_tenant``: counted by the core's own
state, so the live broker, recovery and replay refuse alike (broker.model.apply keeps them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from broker.model.core import Core


def tenant_counts(core: Core) -> dict[str, int] | None:
    """Blocks per tenant of ``core`` (``core.tenant_blocks``), or None when its config sets
    no limit (then nothing is counted, and the count is rebuilt when a limit comes back).

    Built by one pass over the core's blocks when first needed (a fresh core, a limit turned
    on by a reload), then kept by broker.model.apply on every allocation and free: a pure function
    of the core's state, so the live broker, recovery and replay count alike."""
    if not core.config.max_blocks_per_tenant:
        core.tenant_blocks = None
        return None
    counts = core.tenant_blocks
    if counts is None:
        counts = {}
        for block in core.blocks.values():
            if block.tenant:
                counts[block.tenant] = counts.get(block.tenant, 0) + 1
        core.tenant_blocks = counts
    return counts


def tenant_full(counts: dict[str, int], tenant: str, limit: int) -> str | None:
    """Why one more block of ``tenant`` is refused, or None. Names no other tenant."""
    held = counts.get(tenant, 0)
    if held >= limit:
        return f"tenant {tenant!r} holds {held} blocks, limits.max_blocks_per_tenant = {limit}; free some first"
    return None


def count_block(counts: dict[str, int], tenant: str, delta: int) -> None:
    if not tenant:
        return
    n = counts.get(tenant, 0) + delta
    if n > 0:
        counts[tenant] = n
    else:
        counts.pop(tenant, None)
