"""libCacheSim as the referee: kvbroker's replay and libCacheSim agree hit for hit.

The first 600 requests of the bundled Mooncake trace (prompt blocks only, one tier) go
through kvbroker's importer; kvbroker replays the batches with a policy, and libCacheSim
(the ``libcachesim`` dev dependency) runs the same algorithm on the block ids the batches
allocate, in order. Blocks are uniform, so libCacheSim counts blocks (object size 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import libcachesim
import pytest

from broker.replay.replay import replay
from broker.replay.sweep import single_tier
from broker.replay.traces import TraceOptions, read_trace
from kvbroker.v1 import intent_pb2 as pb
from tests.golden import MOONCAKE

REQUESTS = 600
SIZES_BLOCKS = (100, 300, 1000)


@pytest.fixture(scope="module")
def batches(tmp_path_factory: pytest.TempPathFactory) -> list[pb.IntentBatch]:
    path: Path = tmp_path_factory.mktemp("mooncake") / "head.jsonl"
    path.write_text("".join(MOONCAKE.read_text().splitlines(keepends=True)[:REQUESTS]))
    return list(read_trace(str(path), "mooncake", TraceOptions(decode=False)))


def allocated_ids(batches: list[pb.IntentBatch]) -> tuple[list[int], int]:
    ids: dict[str, int] = {}
    seq: list[int] = []
    size = 0
    for batch in batches:
        for event in batch.events:
            if event.WhichOneof("kind") == "allocated":
                seq.append(ids.setdefault(event.allocated.intent.block_id, len(ids)))
                size = event.allocated.intent.size_bytes
    return seq, size


def referee_hits(algorithm: str, seq: list[int], blocks: int, **params: Any) -> int:
    never = 2**62
    next_use = [never] * len(seq)
    last: dict[int, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        next_use[i] = last.get(seq[i], never)
        last[seq[i]] = i
    cache = getattr(libcachesim, algorithm)(blocks, **params)
    request = libcachesim.Request
    return sum(bool(cache.get(request(obj_size=1, obj_id=obj, next_access_vtime=next_use[i], clock_time=i))) for i, obj in enumerate(seq))


def kvbroker_hits(batches: list[pb.IntentBatch], policy: str, capacity: int, params: dict[str, Any] | None = None) -> int:
    def source() -> Iterator[tuple[int, pb.IntentBatch]]:
        return ((1, b) for b in batches)

    return int(replay(source, single_tier(capacity), policy, params).metrics["prefix_hits"])


@pytest.mark.parametrize(("policy", "algorithm"), [("lru", "LRU"), ("fifo", "FIFO"), ("belady", "Belady")])
def test_kvbroker_and_libcachesim_agree_exactly(batches: list[pb.IntentBatch], policy: str, algorithm: str) -> None:
    seq, block_bytes = allocated_ids(batches)
    assert len(seq) > 10 * SIZES_BLOCKS[-1]  # every size sees evictions
    found = {blocks: kvbroker_hits(batches, policy, blocks * block_bytes) for blocks in SIZES_BLOCKS}
    expected = {blocks: referee_hits(algorithm, seq, blocks) for blocks in SIZES_BLOCKS}
    assert found == expected
    # Not a vacuous agreement: the sizes differ in hits.
    assert len(set(found.values())) == len(SIZES_BLOCKS)
