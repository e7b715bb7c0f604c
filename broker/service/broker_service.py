"""The broker as a protobuf-level service: core + journal, without gRPC.

The gRPC servicer (broker.service.server) only moves bytes and statuses; everything it answers is
decided here, synchronously, so a batch is applied and queued for the journal in one step
of the event loop: apply order and journal order are the same by construction.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import NamedTuple

from google.protobuf.message import DecodeError

from broker.config import (
    BrokerConfig,
    ConfigError,
    CoreConfig,
    config_to_toml,
    core_from_json,
    core_to_json,
    load_config,
    parse_config,
    with_policy,
)
from broker.journal import Journal, JournalRecord, RecordKind
from broker.journal.base import NullJournal
from broker.journal.file import FileJournal
from broker.journal.payloads import BadRecord, batch_problem, config_problem
from broker.journal.records import JournalError
from broker.journal.snapshots import load_state
from broker.journal.snapshots import parse as parse_snapshot
from broker.journal.trailer import TrailerTally
from broker.model.apply import BatchOutcome, apply_batch, client_key
from broker.model.arms import Driving, SplitArms
from broker.model.core import Core
from broker.model.stats import CoreStats
from broker.model.wire import BatchReader, directive_to_pb, read_batch
from broker.service.policy_counters import PolicyBaseline
from broker.service.shadow_builds import CATCH_UP_PER_BATCH, ShadowBuild, check_shadow_config, fresh_shadow, start_build
from broker.service.snapshot_writer import SnapshotWriter
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb
from policies.base import Block

answer_native: ModuleType | None
try:
    from broker.model import _answer as answer_native
except ImportError:  # not built (KVBROKER_PURE_PYTHON=1): the protobuf runtime writes every answer
    answer_native = None

log = logging.getLogger("kvbroker.service")

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


def outcome_to_pb(batch: BatchReader | pb.IntentBatch, outcome: BatchOutcome, generation: int) -> dpb.DirectiveBatch:
    return dpb.DirectiveBatch(
        client_id=batch.client_id,
        batch_seq=batch.batch_seq,
        directives=[directive_to_pb(d) for d in outcome.directives],
        rejections=[dpb.EventRejection(event_index=r.index, field=r.field, reason=r.reason, code=r.code) for r in outcome.rejections],
        accepted_events=outcome.accepted,
        duplicate=outcome.duplicate,
        config_generation=generation,
    )


class Answer(NamedTuple):
    """A batch's answer as it leaves: the serialized DirectiveBatch, and the counts telemetry
    reports of it (so that nothing parses it again)."""

    data: bytes
    directives: int
    rejections: int
    duplicate: bool


def answer_bytes(batch: BatchReader | pb.IntentBatch, outcome: BatchOutcome, generation: int) -> bytes:
    """``outcome_to_pb(batch, outcome, generation).SerializeToString()``, the same bytes.

    Written by the native writer (broker/model/_answer.c) when it is built and the batch has no
    rejections: the protobuf runtime took about 3 us a directive (a message built from
    eleven keyword arguments, then serialized), the native writer about 0.3
    (tests/broker/model/test_answer.py holds the two equal). Rejections, rare, go through the
    protobuf runtime."""
    if answer_native is None or outcome.rejections:
        return outcome_to_pb(batch, outcome, generation).SerializeToString()
    encode = answer_native.encode_answer
    return encode(batch.client_id, batch.batch_seq, outcome.directives, outcome.accepted, outcome.duplicate, generation)


def arm_stats(name: str, role: str, core: Core, stats: CoreStats | None = None) -> spb.ArmStats:
    """What one policy did: the primary arm or a shadow, side by side in GetStats
    (``stats``: the counters to report, by default the core's)."""
    s = core.stats if stats is None else stats
    return spb.ArmStats(
        name=name,
        policy=core.policy_name,
        role=role,
        accesses=s.accesses,
        hit_rate=s.hit_rate(),
        decode_critical_accesses=s.dc_accesses,
        decode_critical_misses=s.dc_misses,
        mean_latency_us=s.latency_total_us / s.accesses if s.accesses else 0.0,
        p99_latency_us=s.latency_percentile(0.99),
        evictions=s.evictions,
        demotions=s.demotions,
        prefetches=s.prefetches,
        bytes_moved=s.bytes_up + s.bytes_down,
        deadline_misses=s.deadline_misses,
        clients=len(core.client_seq),
    )


def recovered_config(record: JournalRecord, index: int) -> CoreConfig:
    """The config of the CONFIG record ``record`` (the ``index``-th read); BadRecord if it is none."""
    try:
        return core_from_json(record.payload.decode())
    except (ConfigError, UnicodeDecodeError) as exc:
        raise BadRecord(index, config_problem(exc)) from None


class UnreadableSnapshot(JournalError):
    """The snapshot a restart was to start from cannot be read back: the start reads the
    journal from its first record instead (broker.service.server)."""


class BrokerService:
    def __init__(
        self,
        config: BrokerConfig,
        journal: Journal,
        recovered: Iterable[JournalRecord] = (),
        config_path: str | None = None,
        overrides: Callable[[BrokerConfig], BrokerConfig] | None = None,
    ) -> None:
        """``recovered``: the journal's BATCH and CONFIG records so far, applied first (crash
        recovery); ``config_path``: the file a reload without text reads again."""
        self.config = config
        self.config_path = config_path
        self.overrides = overrides
        self.journal = journal
        self.recovered_batches = 0
        # Read as a stream (a journal's records are never all in memory): only the records
        # before the first CONFIG wait for it (none, but in a journal written before CONFIG
        # records were).
        records = iter(recovered)
        held: list[JournalRecord] = []
        first = None
        # A restart from a snapshot (JournalSource.recovery): its state record comes first,
        # then the records after its mark.
        self.recovered_snapshot: int | None = None
        for record in records:
            if record.kind == RecordKind.CONFIG or record.kind == RecordKind.SNAPSHOT:
                first = record
                break
            held.append(record)
        if first is not None and first.kind == RecordKind.SNAPSHOT:
            try:
                self.driving = load_state(first.payload)
            except JournalError as exc:
                raise UnreadableSnapshot(str(exc)) from None
            self.recovered_snapshot = parse_snapshot(first.payload)[0]
            ordered: Iterable[JournalRecord] = records
        else:
            start = recovered_config(first, len(held)) if first is not None else config.core
            self.driving = Driving(start, first.generation if first is not None else 1)
            ordered = itertools.chain(held, [first] if first is not None else [], records)
        self.policy_baseline = PolicyBaseline()  # kvbroker ab: the primary's counters since its policy took over
        for i, record in enumerate(ordered):
            # The same path as live and replay, so the rebuilt state is the state the
            # broker had; the directives were sent before the restart and are not again.
            if record.kind == RecordKind.SNAPSHOT:
                continue
            if record.kind == RecordKind.CONFIG:
                self._follow(recovered_config(record, i), record.generation)
                continue
            try:
                batch = read_batch(record.payload)
            except DecodeError as exc:
                raise BadRecord(i, batch_problem(exc)) from None
            core = self.core_for(batch.client_id)
            core.generation = record.generation
            apply_batch(core, batch)
            core.take_directives()
            self.recovered_batches += 1
        self.shadows: dict[str, Core] = {}
        # Shadows a reload added, being copied off the event loop (broker.service.shadow_builds):
        # they join ``shadows`` once their copy has arrived and caught up.
        self.shadow_builds: dict[str, ShadowBuild] = {}
        self.journal_directives = config.journal.directives
        self.ack_after_journal = config.journal.ack_after == "journal"
        self.streams = 0
        self.reloads = 0
        # Batches refused whole by the servicer (limits, tenant, journal), by reason.
        self.refused_batches: dict[str, int] = {}
        # Set by the servicer: streams refused at open by reason, and ended by a revoked token.
        self.refused_streams: dict[str, int] = {}
        self.revoked_streams = 0
        # The batches this process journaled, by client: the trailers a clean stop writes
        # (write_trailers), so that replay --verify can tell the journal's tail is whole.
        # Recovered batches are not counted: the process that journaled them did (or not).
        self.tally = TrailerTally()
        every = config.journal.snapshot_batches if isinstance(journal, FileJournal) else 0
        self.snapshots = SnapshotWriter(journal, every, SCHEMA_MAJOR)
        if first is None or config.core != self.core_config:
            generation = self.generation + 1 if first is not None else self.generation
            self._follow(config.core, generation, force=first is None)
            self._journal_config()
        self._set_shadows(config.core, at_start=True)

    @property
    def core(self) -> Core:
        """The core that drives every client, or in a split the first arm's (the arms share
        one generation)."""
        return self.driving.core

    @property
    def split(self) -> SplitArms | None:
        return self.driving.split

    @property
    def core_config(self) -> CoreConfig:
        return self.driving.config

    def _follow(self, config: CoreConfig, generation: int, force: bool = False) -> None:
        before = self.policy_baseline.around_change(self.core)
        self.driving.follow(config, generation, force=force)
        self.policy_baseline.after_change(before, self.core)

    def driving_cores(self) -> dict[str, Core]:
        """The cores that drive clients: the one core, or every split arm by name."""
        return self.driving.cores()

    def core_for(self, client_id: str) -> Core:
        """The core that drives this client (its arm's, in a split)."""
        return self.driving.core_for(client_id)

    @property
    def policy_name(self) -> str:
        return self.driving.policy_name

    def arm_cores(self) -> dict[str, tuple[str, Core]]:
        """Every core that reports, by arm key: role "primary" (no split), "split" (one per
        arm) or "shadow"."""
        if self.split is not None:
            return {f"split:{name}": ("split", core) for name, core in self.split.cores.items()}
        arms: dict[str, tuple[str, Core]] = {"primary": ("primary", self.core)}
        arms.update((f"shadow:{name}", ("shadow", core)) for name, core in self.shadows.items())
        return arms

    def ab_arms(self) -> list[spb.ArmStats]:
        """``kvbroker ab``'s rows: the primary's counters since its policy took over (after
        deadline_edf -> arc -> lru, lru's alone), each shadow's, but not a shadow of the
        primary's own policy, a twin of the primary row."""
        rows = []
        for key, (role, core) in self.arm_cores().items():
            if role == "shadow" and core.policy_name == self.core.policy_name:
                continue
            stats = self.policy_baseline.stats(core) if role == "primary" else core.stats
            rows.append(arm_stats(key.partition(":")[2] or core.policy_name, role, core, stats))
        return rows

    def _journal_config(self) -> None:
        self.journal.append(JournalRecord(RecordKind.CONFIG, SCHEMA_MAJOR, self.generation, core_to_json(self.core_config).encode()))

    def _set_shadows(self, core_config: CoreConfig, *, at_start: bool = False) -> None:
        """Shadows follow config changes with their own policy, exactly as a replay of the
        journal through that policy does; one added later starts from a copy of the
        primary's residency, taken off the event loop (broker.service.shadow_builds), or here
        ``at_start``, before anything is served."""
        shadows: dict[str, Core] = {}
        builds: dict[str, ShadowBuild] = {}
        for name in core_config.policy.shadows:  # refuse a policy before copying for any
            if name not in self.shadows and name not in self.shadow_builds:
                check_shadow_config(with_policy(core_config, name))
        for name in core_config.policy.shadows:
            shadow_config = with_policy(core_config, name)
            current = self.shadows.get(name)
            build = self.shadow_builds.get(name)
            if current is not None:
                current.follow(shadow_config, self.generation)
                shadows[name] = current
            elif build is not None:
                build.follow(shadow_config, self.generation)
                builds[name] = build
            elif at_start:
                shadows[name] = fresh_shadow(self.core, shadow_config, self.generation)
            else:
                started = start_build(name, self.core, shadow_config, self.generation)
                if isinstance(started, Core):
                    shadows[name] = started
                else:
                    builds[name] = started
        self.shadows = shadows
        self.shadow_builds = builds

    def _shadow_names(self) -> tuple[str, ...]:
        """The shadows in force, in config order, copied or still being copied."""
        return tuple(name for name in self.core_config.policy.shadows if name in self.shadows or name in self.shadow_builds)

    def advance_shadow_builds(self, budget: int = CATCH_UP_PER_BATCH) -> None:
        """Let the shadows being copied catch up by up to ``budget`` entries each; one that
        has caught up joins ``shadows`` (a new dict, in config order)."""
        ready: dict[str, Core] = {}
        for name, build in self.shadow_builds.items():
            shadow = build.catch_up(self.core, budget)
            if shadow is not None:
                ready[name] = shadow
        if ready:
            for name in ready:
                del self.shadow_builds[name]
            joined = {**self.shadows, **ready}
            self.shadows = {name: joined[name] for name in self.core_config.policy.shadows if name in joined}
            for name in ready:
                log.info("shadow %s: copied off the event loop, reporting from generation %d", name, self.generation)

    def reload(self, text: str | None = None) -> spb.ReloadResponse:
        """Apply a new config (TOML text, or the config file read again) between batches.
        Validated in full first; a refused one changes nothing and says why."""
        try:
            if text:
                new = parse_config(text)
            elif self.config_path:
                new = load_config(self.config_path)
            else:
                raise ConfigError("no config text given and the broker runs without a config file")
            if self.overrides is not None:
                new = self.overrides(new)  # the command line wins, as it did at start
            for key, old_value, new_value in (
                ("broker.id", self.config.broker_id, new.broker_id),
                ("broker.listen", self.config.listen, new.listen),
                ("journal", self.config.journal, new.journal),
                ("telemetry", self.config.telemetry, new.telemetry),
                ("health", self.config.health, new.health),
                ("security", self.config.security, new.security),
                ("limits.max_message_bytes", self.config.limits.max_message_bytes, new.limits.max_message_bytes),
            ):
                if old_value != new_value:
                    raise ConfigError(f"{key}: cannot change while running (restart the broker to change it)")
            if new.core != self.core_config or new.core.policy.shadows != self._shadow_names():
                previous, generation = self.core_config, self.generation
                baseline = self.policy_baseline.base
                self._follow(new.core, generation + 1, force=True)
                try:
                    self._set_shadows(new.core)
                except ConfigError:
                    self._follow(previous, generation, force=True)
                    self.policy_baseline.base = baseline  # as if the refused reload never was
                    raise
                self._journal_config()
        except ConfigError as exc:
            log.warning("config reload refused: %s", exc)
            return spb.ReloadResponse(ok=False, config_generation=self.generation, error=str(exc), policy=self.policy_name)
        self.config = new
        self.reloads += 1
        log.info("config reloaded: generation %d, policy %s", self.generation, self.policy_name)
        return spb.ReloadResponse(ok=True, config_generation=self.generation, policy=self.policy_name)

    def get_config(self) -> spb.GetConfigResponse:
        return spb.GetConfigResponse(
            config_toml=config_to_toml(self.config),
            config_generation=self.generation,
            policy=self.policy_name,
            config_path=self.config_path or "",
        )

    @property
    def generation(self) -> int:
        return self.core.generation

    def hello(self, hello: spb.Hello, tenant: str = "") -> spb.HelloReply:
        """``tenant``: the tenant the stream acts for (broker.service.security.stream_tenant)."""
        check_hello(hello)
        core = self.core_for(hello.client_id)  # in a split, the client learns its arm
        return spb.HelloReply(
            served_majors=SERVED_MAJORS,
            schema_minor=SCHEMA_MINOR,
            broker_id=self.config.broker_id,
            last_batch_seq=core.client_seq.get(client_key(tenant, hello.client_id), 0),
            policy=core.policy_name,
            config_generation=self.generation,
            max_events_per_batch=self.config.limits.max_events_per_batch,
            max_batch_seq_gap=self.config.limits.max_batch_seq_gap,
        )

    def submit(self, batch: BatchReader, raw: bytes) -> tuple[Answer, int]:
        """Apply one batch (``raw`` read by ``broker.model.wire.read_batch``) and journal ``raw``
        when it was applied. Returns the answer and the journal ordinal to wait for
        (``journal.durable``) before it may leave: the batch's last record when ack_after =
        "journal" and it was applied, else 0 (answer at once)."""
        outcome = apply_batch(self.core_for(batch.client_id), batch)
        for shadow in self.shadows.values():
            apply_batch(shadow, batch)
            shadow.take_directives()
        if self.shadow_builds:
            for build in self.shadow_builds.values():
                build.pending.append(raw)
            self.advance_shadow_builds()
        generation = self.generation
        data = answer_bytes(batch, outcome, generation)
        answer = Answer(data, len(outcome.directives), len(outcome.rejections), outcome.duplicate)
        if not outcome.applied:
            return answer, 0
        ordinal = self.journal.append(JournalRecord(RecordKind.BATCH, SCHEMA_MAJOR, generation, raw))
        self.tally.add(client_key(batch.tenant, batch.client_id), batch.batch_seq)
        if self.journal_directives and outcome.directives:
            ordinal = self.journal.append(JournalRecord(RecordKind.DIRECTIVES, SCHEMA_MAJOR, generation, data))
        self.snapshots.after_batch(self.driving, generation)
        return answer, ordinal if self.ack_after_journal else 0

    def write_trailers(self) -> int:
        """Queue one trailer per client this process journaled batches of (broker.journal.trailer),
        after its last batch: the clean stop's, once no call can submit any more (a batch
        journaled after them would be counted by none, and read as a tail that cannot be told,
        not as a whole one). Returns how many."""
        if isinstance(self.journal, NullJournal):
            return 0
        trailers = self.tally.trailers()
        self.tally = TrailerTally()  # a second stop writes none again
        for trailer in trailers:
            self.journal.append(trailer.record(SCHEMA_MAJOR, self.generation))
        return len(trailers)

    def tier_usage(self) -> list[tuple[str, int, int, int, int]]:
        """(name, blocks, bytes, capacity, pinned bytes) per tier, summed over split arms."""
        usages = [core.tier_usage() for core in self.driving_cores().values()]
        return [(rows[0][0], *(sum(row[i] for row in rows) for i in range(1, 5))) for rows in zip(*usages, strict=True)]

    def tiers_pb(self) -> list[spb.TierUsage]:
        return [
            spb.TierUsage(name=name, blocks=blocks, bytes=used, capacity_bytes=cap, pinned_bytes=pinned)
            for name, blocks, used, cap, pinned in self.tier_usage()
        ]

    def find_block(self, block_id: str) -> Block | None:
        for core in self.driving_cores().values():
            block = core.blocks.get(block_id)
            if block is not None:
                return block
        return None

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

    def residency(self, request: spb.GetResidencyRequest, tenant: str | None = None) -> spb.GetResidencyResponse | None:
        """None when the named block does not exist. With ``tenant`` (a tenant token's
        query): only that tenant's blocks, another tenant's block is as unknown, and the
        broker-wide tier totals are left out."""
        query = request.WhichOneof("query")
        cores = self.driving_cores().values()
        if tenant is None:
            response = spb.GetResidencyResponse(tiers=self.tiers_pb(), dropped_blocks=sum(c.dropped_blocks() for c in cores))
        else:
            response = spb.GetResidencyResponse()
        if query == "block_id":
            block = self.find_block(request.block_id)
            if block is None or (tenant is not None and block.tenant != tenant):
                return None
            response.blocks.append(self.block_pb(block))
        elif query == "request_id":
            for core in cores:
                blocks = core.request_blocks(request.request_id)
                response.blocks.extend(self.block_pb(b) for b in blocks if tenant is None or b.tenant == tenant)
        return response

    def stats(self) -> spb.GetStatsResponse:
        if self.shadow_builds:
            self.advance_shadow_builds()
        cores = list(self.driving_cores().values())
        names = [t.name for t in self.core.tiers]
        events: dict[str, int] = {}
        directives: dict[str, int] = {}
        by_index = [0] * (len(names) + 1)
        for core in cores:  # a split's arms together are the broker
            s = core.stats
            for kind, n in s.events.items():
                events[kind] = events.get(kind, 0) + n
            for kind, n in s.directives.items():
                directives[kind] = directives.get(kind, 0) + n
            by_index = [a + b for a, b in zip(by_index, s.accesses_by_tier, strict=True)]
        by_tier = {name: by_index[i] for i, name in enumerate(names)}
        by_tier[""] = by_index[-1]
        return spb.GetStatsResponse(
            broker_id=self.config.broker_id,
            policy=self.policy_name,
            config_generation=self.generation,
            tiers=self.tiers_pb(),
            events=events,
            directives=directives,
            batches=sum(c.stats.batches for c in cores),
            duplicate_batches=sum(c.stats.duplicate_batches for c in cores),
            rejected_events=sum(c.stats.rejected_events for c in cores),
            accesses_by_tier=by_tier,
            decode_critical_accesses=sum(c.stats.dc_accesses for c in cores),
            decode_critical_misses=sum(c.stats.dc_misses for c in cores),
            journal_pending=self.journal.pending,
            journal_written=self.journal.written,
            journal_errors=self.journal.errors,
            journal_spool_records=self.journal.spool_records,
            journal_spool_bytes=self.journal.spool_bytes,
            journal_dropped=self.journal.dropped,
            journal=self.journal.description,
            clients=self.streams,
            outstanding_directives=sum(len(c.outstanding) for c in cores),
            max_outstanding_directives=self.core_config.max_outstanding_directives,
            refused_batches=self.refused_batches,
            refused_streams=self.refused_streams,
            revoked_streams=self.revoked_streams,
            arms=self.ab_arms(),
        )
