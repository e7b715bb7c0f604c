"""broker.replay.belady_prefix: Belady's choice through prefix lookups."""

from __future__ import annotations

import random

import pytest

from broker.replay.belady_prefix import belady_prefix_hits


def classic_belady_hits(stream: list[int], capacity: int) -> int:
    """Belady with bypass on single accesses, by brute force: on a miss, the held chunk or
    the newcomer whose next use is farthest is left out."""
    held: set[int] = set()
    hits = 0
    for n, x in enumerate(stream):
        if x in held:
            hits += 1
            continue
        held.add(x)
        if len(held) > capacity:

            def next_use(c: int, n: int = n) -> int:
                for m in range(n + 1, len(stream)):
                    if stream[m] == c:
                        return m
                return len(stream) + 1

            held.remove(max(held, key=lambda c: (next_use(c), c == x)))
    return hits


@pytest.mark.parametrize("seed", range(20))
def test_one_chunk_per_request_is_classic_belady(seed: int) -> None:
    rng = random.Random(seed)
    stream = [rng.randrange(12) for _ in range(300)]
    capacity = rng.randrange(1, 8)
    assert belady_prefix_hits([[x] for x in stream], capacity) == classic_belady_hits(stream, capacity)


def test_hits_stop_at_the_first_miss() -> None:
    # [1, 2] stored; then [9, 1, 2]: 9 misses first, so 1 and 2 are held but not hits.
    assert belady_prefix_hits([[1, 2], [9, 1, 2], [1, 2]], 10) == 2


def test_the_farthest_next_use_leaves_and_a_newcomer_may_not_enter() -> None:
    # Capacity 2: [1, 2] held; 3 is used never again, so it is not kept and 1, 2 both hit.
    assert belady_prefix_hits([[1, 2], [3], [1, 2]], 2) == 2
    # 1 is next used sooner than 2: storing [3] (used again next) drops 2.
    assert belady_prefix_hits([[1, 2], [3], [3], [1], [2]], 2) == 2


def test_refuses_a_tier_of_no_chunks() -> None:
    with pytest.raises(ValueError, match="num_chunks"):
        belady_prefix_hits([[1]], 0)
