"""What offline policies (belady) see of the future: the events that allocate or read a
block, by ordinal; a refresh (``refresh_only``: used, not read) is no use to plan for."""

from __future__ import annotations

from broker.replay.replay import future_uses
from kvbroker.v1 import intent_pb2 as pb


def test_reads_and_allocations_are_uses_and_a_refresh_is_not() -> None:
    def alloc(block_id: str) -> pb.Event:
        return pb.Event(ts_us=1, allocated=pb.BlockAllocated(intent=pb.MemoryIntent(block_id=block_id, size_bytes=1)))

    events = [
        alloc("a"),  # 0
        alloc("b"),  # 1
        pb.Event(ts_us=2, accessed=pb.BlocksAccessed(block_ids=["a", "b"])),  # 2
        pb.Event(ts_us=3, accessed=pb.BlocksAccessed(block_ids=["a"], refresh_only=True)),  # 3: not a read
        pb.Event(ts_us=4, accessed=pb.BlocksAccessed(block_ids=["b"], scope="r", token_positions=[16])),  # 4
    ]
    raw = pb.IntentBatch(client_id="c", batch_seq=1, events=events).SerializeToString()
    assert future_uses(lambda: [(0, raw)]) == {"a": [0, 2], "b": [1, 2, 4]}
