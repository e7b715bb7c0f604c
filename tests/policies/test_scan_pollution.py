"""The scan-pollution scenario of vLLM's GPU block pool, against every policy.

A tier of 256 equal blocks caches a 64-block hot prefix that is read three more times;
then a burst of 1,984 blocks, each used once, streams through (harness.scan_burst). LRU
lets the burst flush the prefix: it is the problem the scan-resistant policies solve.
"""

from __future__ import annotations

import pytest

from tests.policies.harness import HOT, scan_burst

KEEPS_HOT_PREFIX = {
    "two_queue": True,  # the prefix is in the active queue; the burst churns the inactive one
    "arc": True,  # the prefix is in T2; no ghost hit ever moves p off 0
    "s3fifo": True,  # the prefix moved to M; the burst dies in S
    "sieve": True,  # the hand clears the prefix once, then never wraps back to it
    "lfu": True,  # frequency 4 against 1, and no aging during a read-free burst
    "lru_k": True,  # the burst has one reference each: infinite 2-distance, first out
    "lru": False,  # reads only delay the prefix: 1,984 newer blocks push it out
    "fifo": False,  # reads do not count at all
    "priority_lru": False,  # no intent given, so it is LRU
}


@pytest.mark.parametrize("name", sorted(KEEPS_HOT_PREFIX))
def test_hot_prefix_against_a_burst(name: str) -> None:
    tier = scan_burst(name)
    kept = set(HOT) & tier.resident()
    if KEEPS_HOT_PREFIX[name]:
        assert kept == set(HOT), f"{name} lost {len(HOT) - len(kept)} hot blocks"
    else:
        assert kept == set(), f"{name} kept {len(kept)} hot blocks"


def test_lru_loses_the_whole_prefix_early() -> None:
    # With LRU the prefix is gone after 256 - 64 + 64 = 256 burst blocks, an eighth of the burst.
    tier = scan_burst("lru")
    assert tier.evictions[:64] == HOT
