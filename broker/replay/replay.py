"""Replay a journal through one or more policies, on the same core as the live broker.

Each policy gets a fresh core built from the same config (tiers, margins) with only the
policy changed, and sees exactly the batches the live broker applied, in the same order.
For the policy the broker ran, ``verify`` compares every directive with the ones the
broker journaled (when it journaled them): replay must reproduce the live run exactly.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from google.protobuf.message import DecodeError

from broker.config import ConfigError, CoreConfig, core_from_json, format_size, with_policy
from broker.journal import JournalError, JournalSource
from broker.journal.payloads import batch_problem, config_problem
from broker.journal.records import JournalRecord, RecordKind
from broker.journal.redis_urls import is_redis_url
from broker.model.apply import apply_batch
from broker.model.arms import Driving
from broker.model.core import Directive
from broker.model.stats import merged
from broker.model.wire import A_BLOCK_ID, ACCESSED, ALLOCATED, X_REFRESH_ONLY, BatchReader, directive_to_pb, read_batch
from broker.replay import progress as sweep_progress
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb
from policies.registry import policy_class


@dataclasses.dataclass
class ReplayResult:
    policy: str
    batches: int
    events: int
    directives: int
    seconds: float
    metrics: dict[str, Any]
    # None: not verified; else the number of directives that differed from the journal's.
    mismatches: int | None = None
    first_mismatch: str = ""

    @classmethod
    def of_engine(cls, core: Any, seconds: float, metrics: dict[str, Any]) -> ReplayResult:
        """What a replay engine (``--engine``: broker/replay/engines.py) ran, from the core
        its policy decided in: the counts are the core's, the figures the engine's."""
        stats = core.stats
        return cls(
            policy=core.policy_name,
            batches=stats.batches,
            events=sum(stats.events.values()),
            directives=sum(stats.directives.values()),
            seconds=seconds,
            metrics=metrics,
        )

    def as_record(self) -> dict[str, Any]:
        """Flat JSON record with stable names (a contract for scripts and dashboards)."""
        m = self.metrics
        return {
            "policy": self.policy,
            "batches": self.batches,
            "events": self.events,
            "accesses": m["accesses"],
            "hit_rate": m["hit_rate"],
            "prefix_hit_rate": m["prefix_hit_rate"],
            "prefix_hit_rate_any_tier": m["prefix_hit_rate_any_tier"],
            "prompt_blocks": m["prompt_blocks"],
            "prefix_hits": m["prefix_hits"],
            "accesses_by_tier": m["accesses_by_tier"],
            "dc_accesses": m["dc_accesses"],
            "dc_misses": m["dc_misses"],
            "dc_miss_rate": m["dc_miss_rate"],
            "demotions": m["demotions"],
            "evictions": m["evictions"],
            "prefetches": m["prefetches"],
            "recomputes": m["recomputes"],
            "bytes_up": m["bytes_up"],
            "bytes_down": m["bytes_down"],
            "bytes_moved": m["bytes_moved"],
            "directives": self.directives,
            "rejected_events": m["rejected_events"],
            "p50_us": m["p50_us"],
            "p95_us": m["p95_us"],
            "p99_us": m["p99_us"],
            "mean_us": m["mean_us"],
            "deadline_accesses": m["deadline_accesses"],
            "deadline_misses": m["deadline_misses"],
            "deadline_miss_rate": m["deadline_miss_rate"],
            "latency_hist": {str(k): v for k, v in sorted(m["latency_hist"].items())},
            "events_per_s": self.events / self.seconds if self.seconds > 0 else 0.0,
            "verified": None if self.mismatches is None else self.mismatches == 0,
            "mismatches": self.mismatches,
        }


def journal_config(source: JournalSource) -> CoreConfig | None:
    """The first core config the journal recorded, if any. Raises JournalError naming the
    record when it is not a config."""
    for record in source.configs():
        try:
            return core_from_json(record.payload.decode())
        except (ConfigError, UnicodeDecodeError) as exc:
            raise JournalError(f"{source.where(0, RecordKind.CONFIG)}: {config_problem(exc)}") from None
    return None


BatchSource = Callable[[], Iterable[tuple[int, Any]]]
"""A re-iterable stream of (config generation, batch) from a journal or an imported trace;
a batch is an IntentBatch, its serialized bytes or a ``broker.model.wire`` reader of them. A
journal's later config changes come in place as (generation, CoreConfig)."""


class JournalBatches:
    """The journal's batches as the broker journaled them (bytes, read by ``broker.model.wire``:
    no protobuf message is built), with its later config changes in place (CoreConfig items):
    a BatchSource that can say where in the journal its n-th item is."""

    def __init__(self, source: JournalSource) -> None:
        self.source = source

    def __call__(self) -> Iterator[tuple[int, bytes | CoreConfig]]:
        first = True
        for i, r in enumerate(self.source.ordered()):
            if r.kind == RecordKind.BATCH:
                yield r.generation, r.payload
            elif first:
                first = False  # the starting config: the caller's base
            else:
                try:
                    config = core_from_json(r.payload.decode())
                except (ConfigError, UnicodeDecodeError) as exc:
                    raise JournalError(f"{self.source.where(i)}: {config_problem(exc)}") from None
                yield r.generation, config

    def where(self, item: int) -> str:
        """Where the ``item``-th (0-based) item this source gives is in the journal."""
        first = True
        n = -1
        for i, r in enumerate(self.source.ordered()):
            if r.kind != RecordKind.BATCH and first:
                first = False
                continue
            n += 1
            if n == item:
                return self.source.where(i)
        return f"item {item + 1} of {self.source.url}"


def journal_batches(source: JournalSource) -> BatchSource:
    return JournalBatches(source)


def read_item(batches: BatchSource, item: int, batch: BatchReader | pb.IntentBatch | bytes) -> BatchReader:
    """``as_reader(batch)``; a payload that is no IntentBatch raises JournalError naming the
    record (its number and byte offset in a file journal) instead of protobuf's traceback."""
    try:
        return as_reader(batch)
    except DecodeError as exc:
        where = batches.where(item) if isinstance(batches, JournalBatches) else f"batch item {item + 1} of the source"
        repair = " (`kvbroker repair` cuts it)" if isinstance(batches, JournalBatches) and not is_redis_url(batches.source.url) else ""
        raise JournalError(f"{where}: {batch_problem(exc)}{repair}") from None


def future_uses(batches: BatchSource) -> dict[str, list[int]]:
    """For every block id, the ordinals of the events that allocate or read it (an access;
    not a refresh, ``refresh_only``: no hit to be had there).

    Ordinals count every event of every batch, as the core's clock.event_index does, so
    offline policies can ask when a block is used next.
    """
    uses: dict[str, list[int]] = {}
    ordinal = -1
    for item, (_, batch) in enumerate(batches()):
        if isinstance(batch, CoreConfig):
            continue
        for event in read_item(batches, item, batch).events():
            ordinal += 1
            kind = event[0]
            if kind == ACCESSED:
                if event[X_REFRESH_ONLY]:
                    continue
                for block_id in event[4]:  # without a block dict, the ids
                    uses.setdefault(block_id, []).append(ordinal)
            elif kind == ALLOCATED:
                uses.setdefault(event[A_BLOCK_ID], []).append(ordinal)
    return uses


def directives_of(record: JournalRecord, index: int) -> list[dpb.Directive]:
    """The directives of the ``index``-th (0-based) journaled DIRECTIVES record."""
    try:
        return list(dpb.DirectiveBatch.FromString(record.payload).directives)
    except DecodeError as exc:
        raise JournalError(f"journaled directives record {index + 1}: its payload is not a valid DirectiveBatch ({exc})") from None


def as_reader(batch: BatchReader | pb.IntentBatch | bytes) -> BatchReader:
    """A batch of a BatchSource, read (a reader is read once per policy run: each run
    reads its events again from the one scan)."""
    return read_batch(batch) if isinstance(batch, (bytes, pb.IntentBatch)) else batch


def replay(
    batches: BatchSource,
    config: CoreConfig,
    policy: str | None,
    params: dict[str, Any] | None = None,
    *,
    expected: Iterable[JournalRecord] | None = None,
    sink: list[Directive] | None = None,
    progress: bool = False,
    total_batches: int | None = None,
    total_events: int | None = None,
    ablate_intent: bool = False,
) -> ReplayResult:
    """Run the batches through a fresh core with ``policy``.

    With ``expected`` (the journal's DIRECTIVES records), every DirectiveBatch the replay
    produces is compared, in order, with the journaled one. ``sink`` collects every
    directive the replay decides. ``policy`` None follows the journal exactly: its own
    policy and every config change as the live broker applied it (what verification needs);
    its result is then named by the policies it followed, ``lru->adaptive->arc`` when the
    journal switched policy (a reload of ``kvbroker serve``, a settings file inside vLLM).
    """
    core_config = config if policy is None else with_policy(config, policy, params)
    live_params = params
    offline = policy_class(core_config.policy.name).offline
    # The journal's own policy goes through the same routing as the live broker (a split's
    # clients to their arms); another policy drives every client, as a one-policy broker.
    driving = Driving(core_config, 1, ablate_intent=ablate_intent, future_uses=future_uses(batches) if offline else None)
    expect: Iterator[JournalRecord] | None = iter(expected) if expected is not None else None
    mismatches = 0
    first = ""
    expected_read = 0
    n_batches = n_events = n_directives = 0
    started = time.perf_counter()
    bar = ProgressBar(driving.policy_name, total_batches, total_events=total_events) if progress else None
    # In a worker of a parallel sweep: events go to the sweep's shared counter (its progress).
    counted = sweep_progress.counting()
    reported = 0
    followed = [driving.policy_name]
    for item, (generation, batch) in enumerate(batches()):
        if isinstance(batch, CoreConfig):
            driving.follow(batch if policy is None else with_policy(batch, policy, live_params), generation)
            if driving.policy_name != followed[-1]:
                followed.append(driving.policy_name)
            continue
        batch = read_item(batches, item, batch)
        core = driving.core_for(batch.client_id)
        core.generation = generation
        outcome = apply_batch(core, batch)
        n_batches += 1
        n_events += batch.count
        n_directives += len(outcome.directives)
        if sink is not None:
            sink.extend(outcome.directives)
        if n_batches % 16 == 0:
            if bar is not None:
                bar.show(n_batches, n_events)
            if counted:
                sweep_progress.add_events(n_events - reported)
                reported = n_events
        if expect is not None and outcome.directives:
            got = [directive_to_pb(d) for d in outcome.directives]
            want_record = next(expect, None)
            want = directives_of(want_record, expected_read) if want_record else []
            expected_read += 1
            if got != want:
                bad = sum(1 for g, w in zip(got, want, strict=False) if g != w) + abs(len(got) - len(want))
                mismatches += bad
                if not first:
                    first = f"batch {batch.client_id}#{batch.batch_seq}: replay gave {len(got)} directives, journal has {len(want)}"
    if expect is not None:
        extra = sum(len(directives_of(r, expected_read + k)) for k, r in enumerate(expect))
        if extra:
            mismatches += extra
            first = first or f"journal holds {extra} directives the replay never produced"
    seconds = time.perf_counter() - started
    if counted:
        sweep_progress.add_events(n_events - reported)
    if bar is not None:
        bar.done(n_batches, n_events)
    tier_names = [t.name for t in driving.core.tiers]
    cores = list(driving.cores().values())
    return ReplayResult(
        policy="->".join(followed),
        batches=n_batches,
        events=n_events,
        directives=n_directives,
        seconds=seconds,
        metrics=(cores[0].stats if len(cores) == 1 else merged([c.stats for c in cores])).as_dict(tier_names),
        mismatches=mismatches if expect is not None else None,
        first_mismatch=first,
    )


class ProgressBar:
    """A progress line on stderr for long replays: a bar and percentage when the length is
    known (journals), else the count; events, events/s, elapsed and ETA. The share done is
    of events when their total is known (a file journal), else of batches (a Redis one):
    batches differ a thousandfold in events, so a share of batches misjudged the time left
    (6 s left said at 27 s of a 36 s replay). Redrawn at most twice a second, so it costs
    nothing measurable. On a terminal the line is redrawn in place; elsewhere (``--progress
    2>log``, CI) a whole line every ``LINE_S`` seconds, as the sweep's overall progress
    does: a log of ``\r``-joined updates read as one line thousands of columns wide."""

    WIDTH = 30
    DRAW_S = 0.5
    LINE_S = 10.0

    def __init__(
        self, label: str, total_batches: int | None, stream: Any = None, *, total_events: int | None = None, tty: bool | None = None
    ) -> None:
        self.label = label
        self.total = total_batches if total_batches else None
        self.total_events = total_events if total_events else None
        self.stream = stream if stream is not None else sys.stderr
        self.tty = _isatty(self.stream) if tty is None else tty
        self.every = self.DRAW_S if self.tty else self.LINE_S
        self.started = time.perf_counter()
        self.next_draw = self.started + self.every

    def line(self, batches: int, events: int, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        rate = events / elapsed
        head = f"{self.label}: "
        if self.total is not None or self.total_events is not None:
            frac = min(events / self.total_events if self.total_events else batches / (self.total or 1), 1.0)
            filled = int(frac * self.WIDTH)
            eta = elapsed * (1 - frac) / frac if frac > 0 else 0.0
            head += f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {frac:4.0%} "
            tail = f" ETA {eta:,.0f}s"
        else:
            head += f"{batches:,} batches "
            tail = ""
        return f"{head}{events:,} events {rate:,.0f} events/s {elapsed:,.1f}s{tail}"

    def show(self, batches: int, events: int) -> None:
        now = time.perf_counter()
        if now < self.next_draw:
            return
        self.next_draw = now + self.every
        if self.tty:
            print("\r" + self.line(batches, events, now), end="", file=self.stream, flush=True)
        else:
            print(self.line(batches, events, now), file=self.stream, flush=True)

    def done(self, batches: int, events: int) -> None:
        if self.total is not None:
            self.total = max(self.total, batches)  # the bar ends full even if the count was an estimate
            batches = self.total
        if self.total_events:
            self.total_events = events
        print(("\r" if self.tty else "") + self.line(batches, events, time.perf_counter()) + " done", file=self.stream, flush=True)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or stand-in stream: no terminal
        return False


def replay_source(
    source: JournalSource,
    policies: list[str],
    config: CoreConfig | None = None,
    *,
    verify: bool = False,
) -> list[ReplayResult]:
    """Replay a journal through each policy; verify the live policy's directives if asked."""
    source.check()
    recorded = journal_config(source)
    cfg = config or recorded
    if cfg is None:
        raise ConfigError("the journal holds no config record; pass --config with the broker's config")
    live_policy = recorded.policy.name if recorded is not None else None
    results = []
    for name in policies:
        check = verify and name == live_policy
        if check:
            results.append(replay(journal_batches(source), cfg, None, expected=source.directives()))
        else:
            results.append(replay(journal_batches(source), cfg, name))
    return results


def format_table(records: list[dict[str, Any]]) -> str:
    """A terminal table, one row per record (policy; source, parameters and capacity when
    they vary)."""
    caps = [r.get("capacity_bytes") for r in records]
    show_caps = len({str(c) for c in caps}) > 1
    show_source = len({r.get("source") for r in records}) > 1
    swept = _varying_params(records)
    headers = ["source"] if show_source else []
    headers.append("policy")
    if swept:
        headers.append("params")
    if show_caps:
        headers.append("capacity")
    # In vLLM's CPU tier every access is to a chunk vLLM holds: hit_rate is 1.0 on every row
    # there, and vLLM's figure is prefix_hit (chunks its prefix lookups hit over chunks asked).
    show_hit_rate = not records or not all(r.get("capacity_chunks") for r in records)
    headers += ["events", "accesses", *(["hit_rate"] if show_hit_rate else []), "prefix_hit", "dc_miss", "dl_miss", "p50_us", "p99_us"]
    headers += ["demotes", "drops", "prefetch", "MiB_moved", "verified"]
    rows = []
    for rec in records:
        verified = _verified_label(rec)
        row = [_source_label(rec)] if show_source else []
        row.append(rec["policy"] + (" -intent" if rec.get("intent") == "stripped" else ""))
        if swept:
            row.append(",".join(f"{k}={v}" for k, v in (rec.get("params") or {}).items() if k in swept.get(rec["policy"], ())) or "-")
        if show_caps:
            row.append(_capacity_label(rec))
        row += [
            str(rec["events"]),
            str(rec["accesses"]),
            *([f"{rec['hit_rate']:.4f}"] if show_hit_rate else []),
            f"{rec['prefix_hit_rate']:.4f}" if rec["prompt_blocks"] else "-",
            f"{rec['dc_miss_rate']:.4f}" if rec["dc_accesses"] else "-",
            f"{rec['deadline_miss_rate']:.4f}" if rec["deadline_accesses"] else "-",
            str(rec["p50_us"]),
            str(rec["p99_us"]),
            str(rec["demotions"]),
            str(rec["evictions"]),
            str(rec["prefetches"]),
            f"{rec['bytes_moved'] / 2**20:.1f}",
            verified,
        ]
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths, strict=True)))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    if any(rec["p50_us"] > QUEUED_US or rec["p99_us"] > QUEUED_US for rec in records):
        lines.append(QUEUED_NOTE)
    return "\n".join(lines)


def _verified_label(rec: dict[str, Any]) -> str:
    """yes, NO (directives that differ), CUT (batches the journal lacks: ``--verify`` counts
    them against the writer's trailer) or tail? (whether the tail is whole cannot be told)."""
    if rec["verified"] is None:
        return "-"
    if not rec["verified"]:
        return f"NO ({rec['mismatches']})"
    tail = rec.get("tail")
    if tail == "cut":
        return f"CUT ({rec['missing_batches']})"
    return "tail?" if tail == "unknown" else "yes"


# A read's simulated latency is the end of its copy on the tier's shared channels, queue
# included, and a replay is open loop: the source's timestamps do not wait for the copies.
# When reads ask for more than the channels carry, the queue grows for the whole replay and
# p50_us/p99_us become its length. The Mooncake trace imported with the default tiers (16 GiB
# HBM), decode mode, lru: p50_us 1,946,157,056 (32 min), as its 3.2M reads from DRAM of 64 MiB
# blocks need 4,337 s of copying on two 25 GB/s channels, for arrivals over 1,022 s. One copy
# of a block takes milliseconds, never a second: past that the table says what the figure is.
QUEUED_US = 1_000_000
QUEUED_NOTE = (
    "note: p50_us/p99_us over 1 s are copy queues, not reads: replay is open loop (the source's timestamps do not\n"
    "      slow down while copies wait), so when reads ask more of a tier's copy channels than they carry, the queue\n"
    "      grows for the whole replay (a larger top tier, fewer reads per step, or more bandwidth or channels)"
)


def _varying_params(records: list[dict[str, Any]]) -> dict[str, set[str]]:
    """policy -> the parameters whose value differs between its records (a --param sweep)."""
    seen: dict[str, dict[str, set[str]]] = {}
    for rec in records:
        for key, value in (rec.get("params") or {}).items():
            seen.setdefault(rec["policy"], {}).setdefault(key, set()).add(repr(value))
    varying = {policy: {k for k, values in keys.items() if len(values) > 1} for policy, keys in seen.items()}
    return {policy: keys for policy, keys in varying.items() if keys}


def _source_label(rec: dict[str, Any]) -> str:
    """A short name of a record's source: the stream key, the file's name, or the fleet."""
    source = str(rec.get("source", ""))
    if source == "fleet":
        return f"fleet ({rec.get('sources', '?')})"
    if "stream=" in source:
        return source.rpartition("stream=")[2]
    return source.rstrip("/").rpartition("/")[2] or source


def capacity_text(capacity_bytes: int, bytes_per_token: int | None) -> str:
    """One way of naming a size, in the table and in the progress lines: tokens when the
    source is a trace (its sizes are given and studied in tokens), else bytes."""
    if bytes_per_token:
        return f"{capacity_bytes // bytes_per_token:,}tok"
    return format_size(capacity_bytes)


def _capacity_label(rec: dict[str, Any]) -> str:
    tokens = rec.get("capacity_tokens")
    first = next(iter(rec["capacity_bytes"]))
    chunks = rec.get("capacity_chunks")
    if chunks:  # vLLM's CPU tier counts chunks (broker.replay.sweep.chunk_capacities)
        return f"{first}={chunks[first]:,} chunks"
    if tokens:
        return f"{first}={tokens[first]:,}tok"
    return f"{first}={capacity_text(rec['capacity_bytes'][first], None)}"
