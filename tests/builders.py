"""Terse builders of protobuf events for tests, and a driver that applies them to a core."""

from __future__ import annotations

from typing import Any

from broker.config import BrokerConfig
from broker.model.apply import BatchOutcome, apply_batch
from broker.model.core import Core, Directive
from kvbroker.v1 import intent_pb2 as pb


def alloc(block_id: str, size: int = 100, ts: int = 0, tier: str = "", reuse: bool = False, **intent: Any) -> pb.Event:
    mi = pb.MemoryIntent(block_id=block_id, size_bytes=size, **intent)
    return pb.Event(ts_us=ts, allocated=pb.BlockAllocated(intent=mi, tier=tier, reuse=reuse))


def access(*block_ids: str, ts: int = 0) -> pb.Event:
    return pb.Event(ts_us=ts, accessed=pb.BlocksAccessed(block_ids=block_ids))


def update(block_id: str, ts: int = 0, **changes: Any) -> pb.Event:
    return pb.Event(ts_us=ts, intent_updated=pb.IntentUpdated(block_id=block_id, **changes))


def release(*block_ids: str, ts: int = 0) -> pb.Event:
    return pb.Event(ts_us=ts, released=pb.BlocksReleased(block_ids=block_ids))


def free(*block_ids: str, ts: int = 0) -> pb.Event:
    return pb.Event(ts_us=ts, freed=pb.BlocksFreed(block_ids=block_ids))


def clear(ts: int = 0) -> pb.Event:
    return pb.Event(ts_us=ts, cleared=pb.AllBlocksCleared())


def ack(directive_id: int, *, failed: bool = False, actual: str = "", ts: int = 0) -> pb.Event:
    status = pb.ACK_STATUS_FAILED if failed else pb.ACK_STATUS_DONE
    return pb.Event(ts_us=ts, acked=pb.DirectiveAcked(directive_id=directive_id, status=status, actual_tier=actual))


class Driver:
    """Applies batches to a core as one client would, numbering batch_seq."""

    def __init__(self, config: BrokerConfig, client: str = "c") -> None:
        self.core = Core(config.core)
        self.client = client
        self.seq = 0
        self.directives: list[Directive] = []

    def send(self, *events: pb.Event, client: str | None = None) -> BatchOutcome:
        self.seq += 1
        batch = pb.IntentBatch(client_id=client or self.client, batch_seq=self.seq, events=events)
        outcome = apply_batch(self.core, batch)
        self.directives.extend(outcome.directives)
        return outcome

    def where(self, block_id: str) -> str:
        """Tier name of a block, "" if dropped."""
        return self.core.tier_name(self.core.blocks[block_id].tier)

    def used(self) -> list[int]:
        return [t.used for t in self.core.tiers]


def evict_request(count: int, *protected: str, tier: str = "", ts: int = 0) -> pb.Event:
    return pb.Event(ts_us=ts, eviction_requested=pb.EvictionRequested(tier=tier, count=count, protected_block_ids=protected))
