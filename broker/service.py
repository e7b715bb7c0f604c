"""The broker as a protobuf-level service: core + journal, without gRPC.

The gRPC servicer (broker.server) only moves bytes and statuses; everything it answers is
decided here, synchronously, so a batch is applied and queued for the journal in one step
of the event loop: apply order and journal order are the same by construction.
"""

from __future__ import annotations

from collections.abc import Iterable

from broker.apply import BatchOutcome, apply_batch
from broker.config import BrokerConfig, core_to_json
from broker.core import Core, Directive
from broker.journal import Journal, JournalRecord, RecordKind
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb
from policies.base import Block

SCHEMA_MAJOR = 1
SCHEMA_MINOR = 0
SERVED_MAJORS = (1,)


class VersionError(Exception):
    """The client speaks a schema major version this broker does not serve."""


def check_hello(hello: spb.Hello) -> None:
    if hello.schema_major not in SERVED_MAJORS:
        served = ", ".join(f"kvbroker.v{m}" for m in SERVED_MAJORS)
        raise VersionError(
            f"schema major version {hello.schema_major} is not served; this broker serves {served} "
            f"(schema_major {', '.join(map(str, SERVED_MAJORS))})"
        )
    if not hello.client_id:
        raise VersionError("hello.client_id: required, a non-empty string")


def directive_to_pb(d: Directive) -> dpb.Directive:
    return dpb.Directive(
        directive_id=d.directive_id,
        kind=int(d.kind),  # type: ignore[arg-type]
        block_id=d.block_id,
        from_tier=d.from_tier,
        to_tier=d.to_tier,
        policy=d.policy,
        score=d.score,
        reason=d.reason,
        arrive_by_us=d.arrive_by_us,
        size_bytes=d.size,
        config_generation=d.generation,
    )


def outcome_to_pb(batch: pb.IntentBatch, outcome: BatchOutcome, generation: int) -> dpb.DirectiveBatch:
    return dpb.DirectiveBatch(
        client_id=batch.client_id,
        batch_seq=batch.batch_seq,
        directives=[directive_to_pb(d) for d in outcome.directives],
        rejections=[dpb.EventRejection(event_index=r.index, field=r.field, reason=r.reason, code=r.code) for r in outcome.rejections],
        accepted_events=outcome.accepted,
        duplicate=outcome.duplicate,
        config_generation=generation,
    )


class BrokerService:
    def __init__(self, config: BrokerConfig, journal: Journal, recovered: Iterable[JournalRecord] = ()) -> None:
        """``recovered``: the journal's batches so far, applied first (crash recovery)."""
        self.config = config
        self.journal = journal
        self.core = Core(config.core)
        self.recovered_batches = 0
        for record in recovered:
            # The same path as live and replay, so the rebuilt state is the state the
            # broker had; the directives were sent before the restart and are not again.
            self.core.generation = record.generation
            apply_batch(self.core, pb.IntentBatch.FromString(record.payload))
            self.core.take_directives()
            self.recovered_batches += 1
        self.journal_directives = config.journal.directives
        self.ack_after_journal = config.journal.ack_after == "journal"
        # Whether the last submitted batch was applied, and the ordinal of its last record.
        self.last_applied = False
        self.last_ordinal = 0
        self.streams = 0
        self.journal.append(JournalRecord(RecordKind.CONFIG, SCHEMA_MAJOR, self.generation, core_to_json(config.core).encode()))

    @property
    def generation(self) -> int:
        return self.core.generation

    def hello(self, hello: spb.Hello) -> spb.HelloReply:
        check_hello(hello)
        return spb.HelloReply(
            served_majors=SERVED_MAJORS,
            schema_minor=SCHEMA_MINOR,
            broker_id=self.config.broker_id,
            last_batch_seq=self.core.client_seq.get(hello.client_id, 0),
            policy=self.core.policy_name,
            config_generation=self.generation,
        )

    def submit(self, batch: pb.IntentBatch, raw: bytes) -> dpb.DirectiveBatch:
        """Apply one batch and journal it (as received) when it was applied."""
        outcome = apply_batch(self.core, batch)
        generation = self.generation
        result = outcome_to_pb(batch, outcome, generation)
        self.last_applied = outcome.applied
        if outcome.applied:
            self.last_ordinal = self.journal.append(JournalRecord(RecordKind.BATCH, SCHEMA_MAJOR, generation, raw))
            if self.journal_directives and outcome.directives:
                payload = result.SerializeToString()
                self.last_ordinal = self.journal.append(JournalRecord(RecordKind.DIRECTIVES, SCHEMA_MAJOR, generation, payload))
        return result

    async def submit_durable(self, batch: pb.IntentBatch, raw: bytes) -> dpb.DirectiveBatch:
        """``submit``, answered only once journaled when ack_after = "journal"."""
        result = self.submit(batch, raw)
        if self.ack_after_journal and self.last_applied:
            await self.journal.durable(self.last_ordinal)
        return result

    def tiers_pb(self) -> list[spb.TierUsage]:
        return [
            spb.TierUsage(name=name, blocks=blocks, bytes=used, capacity_bytes=cap, pinned_bytes=pinned)
            for name, blocks, used, cap, pinned in self.core.tier_usage()
        ]

    def block_pb(self, block: Block) -> spb.BlockResidency:
        out = spb.BlockResidency(
            block_id=block.block_id,
            request_id=block.request_id,
            tier=self.core.tier_name(block.tier),
            size_bytes=block.size,
            pinned=block.pinned,
            phase=int(block.phase),  # type: ignore[arg-type]
            priority=int(block.priority),  # type: ignore[arg-type]
            tenant=block.tenant,
        )
        if block.deadline_us is not None:
            out.deadline_us = block.deadline_us
        return out

    def residency(self, request: spb.GetResidencyRequest) -> spb.GetResidencyResponse | None:
        """None when the named block does not exist."""
        query = request.WhichOneof("query")
        response = spb.GetResidencyResponse(tiers=self.tiers_pb(), dropped_blocks=self.core.dropped_blocks())
        if query == "block_id":
            block = self.core.blocks.get(request.block_id)
            if block is None:
                return None
            response.blocks.append(self.block_pb(block))
        elif query == "request_id":
            response.blocks.extend(self.block_pb(b) for b in self.core.request_blocks(request.request_id))
        return response

    def stats(self) -> spb.GetStatsResponse:
        core = self.core
        s = core.stats
        names = [t.name for t in core.tiers]
        by_tier = {name: s.accesses_by_tier[i] for i, name in enumerate(names)}
        by_tier[""] = s.accesses_by_tier[-1]
        return spb.GetStatsResponse(
            broker_id=self.config.broker_id,
            policy=core.policy_name,
            config_generation=self.generation,
            tiers=self.tiers_pb(),
            events=s.events,
            directives=s.directives,
            batches=s.batches,
            duplicate_batches=s.duplicate_batches,
            rejected_events=s.rejected_events,
            accesses_by_tier=by_tier,
            decode_critical_accesses=s.dc_accesses,
            decode_critical_misses=s.dc_misses,
            journal_pending=self.journal.pending,
            journal_written=self.journal.written,
            journal_errors=self.journal.errors,
            journal=self.journal.description,
            clients=self.streams,
        )
