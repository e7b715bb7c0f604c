"""A check of the broker's tier for a sidecar rank: a misconfiguration is said in the log,
never a reason to stop vLLM."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from clients.admin import get_residency
from clients.broker_client import ClientSecurity
from kvbroker.v1 import broker_service_pb2 as spb
from vllm_integration.decisions_to_vllm.link import BrokerLink

log = logging.getLogger("vllm.kvbroker.sidecar")


def tier_problem(tiers: Sequence[spb.TierUsage], tier: str, chunks: int) -> str | None:
    """What is wrong with the broker's tier for this rank (GetResidency totals), or None."""
    if not tiers:
        return None  # a tenant token sees no broker-wide totals: nothing to check
    found = next((t for t in tiers if t.name == tier), None) if tier else tiers[0]
    if found is None:
        names = ", ".join(t.name for t in tiers)
        return (
            f"the broker has no tier {tier!r} (its tiers: {names}): it refuses every chunk and every eviction request; "
            "set kvbroker_broker_tier to one of them, or add the tier to the broker's config"
        )
    if found.capacity_bytes < chunks:
        return (
            f"the broker's tier {found.name!r} holds {found.capacity_bytes} bytes, vLLM's CPU tier {chunks} chunks of one byte: "
            f"the broker would evict on its own; give the tier capacity = {chunks} and watermarks of 1.0"
        )
    return None


def check_tier(link: BrokerLink, security: ClientSecurity, tier: str, chunks: int, wait_s: float = 60.0) -> None:
    """Once connected, say in the log if the broker's tier for this rank cannot work (a
    thread of its own: it waits for the broker, vLLM does not)."""

    def run() -> None:
        if not link.wait_connected(wait_s):
            return
        try:
            totals = get_residency(link.target, spb.GetResidencyRequest(totals=True), security=security)
        except Exception as exc:  # a check: never a reason to stop
            log.debug("kvbroker sidecar %s: tier check skipped: %s", link.client_id, exc)
            return
        problem = tier_problem(totals.tiers, tier, chunks)
        if problem:
            log.error("kvbroker sidecar %s: %s", link.client_id, problem)

    threading.Thread(target=run, name=f"kvbroker-tier-check-{link.client_id}", daemon=True).start()
