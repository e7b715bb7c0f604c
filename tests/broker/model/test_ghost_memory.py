"""The history the core keeps of freed blocks (ghosts, ``history.ghosts``) is bounded: a long
run that stores and evicts far more chunks than the bound holds keeps the ghost count at the
bound, and the memory it grows by is what the same run grows by with no ghosts at all (issue
30), with the default policy deciding."""

from __future__ import annotations

import multiprocessing
import tracemalloc

from bench.ghost_memory import churn
from broker.config.settings import DEFAULT_POLICY
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.settings import OffloadSettings

CAPACITY = 500
GHOSTS = 8.0
BOUND = int(GHOSTS * CAPACITY)
WARM = CAPACITY + 2 * BOUND  # the tier full, then the ghosts at their bound
LONG = 10 * BOUND  # 40,000 evictions past the bound


def held(ghosts: float) -> tuple[int, int, int]:
    """(bytes allocated since the warm-up and still held after LONG / 2 and after LONG
    evictions past it, ghosts kept at the end)."""
    core = EmbeddedCore(OffloadSettings(policy=DEFAULT_POLICY, history_ghosts=ghosts), CAPACITY, journal=False)
    churn(core, 0, WARM, CAPACITY)
    tracemalloc.start()
    try:
        churn(core, WARM, LONG // 2, CAPACITY)
        half, _ = tracemalloc.get_traced_memory()
        churn(core, WARM + LONG // 2, LONG // 2, CAPACITY)
        whole, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(core.core.tiers[0].policy) == CAPACITY
    return half, whole, len(core.core.ghosts)


def test_a_long_run_keeps_the_ghosts_at_their_bound_and_their_memory_flat() -> None:
    # Each run in a fresh process: the interpreter's own caches grow a little with the
    # first ids a process sees, the same with ghosts or without, but only once a process.
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        (half, whole, kept), (half_0, whole_0, none) = pool.map(held, [GHOSTS, 0.0], chunksize=1)
    assert kept == BOUND and none == 0
    # What the ghosts hold is what the run holds beyond the same run with none. Kept without
    # a bound, the second half's 20,000 ghosts would add about 5 MB to it (256 bytes each,
    # bench/ghost_memory.py); bounded, they replace one another and it stays where it was.
    ghosts_half, ghosts_whole = half - half_0, whole - whole_0
    assert ghosts_whole - ghosts_half < 200_000, f"the ghosts held {ghosts_half} bytes, then {ghosts_whole} after 20,000 evictions more"
