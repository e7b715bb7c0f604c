"""Broker configuration: a TOML file, validated in full before anything uses it.

Every error names the key and the reason, so a refused reload says exactly what is wrong.
Keys and defaults are a contract documented in README.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from typing import Any, Final

from broker.config.errors import ConfigError, parse_size
from broker.config.health import HealthConfig, health_config_from_dict
from broker.config.limits import LimitsConfig, limits_config_from_dict
from broker.config.security import SecurityConfig, security_config_from_dict
from broker.config.telemetry import TelemetryConfig, telemetry_config_from_dict
from policies.base import TierInfo

# tiers[].channels at most: one list entry each in the cost model.
MAX_CHANNELS = 1024


@dataclasses.dataclass(frozen=True)
class TierConfig:
    name: str
    capacity_bytes: int
    read_latency_us: float
    bandwidth_gb_per_s: float
    high_watermark: float = 0.95
    low_watermark: float = 0.90
    # Copies out of this tier that can run at once; more queue (the cost model's contention).
    channels: int = 2

    @property
    def bandwidth_bytes_per_us(self) -> float:
        return self.bandwidth_gb_per_s * 1000.0

    def info(self, index: int) -> TierInfo:
        return TierInfo(index, self.name, self.capacity_bytes, self.read_latency_us, self.bandwidth_bytes_per_us)


DEFAULT_TIERS = (
    TierConfig("hbm", 16 * 2**30, read_latency_us=0.0, bandwidth_gb_per_s=2000.0),
    TierConfig("dram", 64 * 2**30, read_latency_us=2.0, bandwidth_gb_per_s=25.0),
    TierConfig("nvme", 1024 * 2**30, read_latency_us=80.0, bandwidth_gb_per_s=6.0),
)


# The policy a broker runs when its config names none (serve, and vLLM's CachePolicy
# through vllm_integration/decisions_to_vllm/settings.py). history_arc was lru until issue 30: lru is what the
# engines already do, and history_arc measured best or close to it on every trace the
# project has, inside vLLM and in replay (docs/policies.md, "The default").
DEFAULT_POLICY = "history_arc"


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    name: str = DEFAULT_POLICY
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Policies that see the same events on their own copy of residency and only report.
    shadows: tuple[str, ...] = ()
    # Live A/B split: (policy, share) arms; each client is driven by the arm its id hashes
    # to (broker/model/arms.py), on that share of every tier. Empty: ``name`` drives everyone.
    split: tuple[tuple[str, float], ...] = ()


# journal.spool_max_bytes at least: the spool header and a few records.
MIN_SPOOL_BYTES = 1024


@dataclasses.dataclass(frozen=True)
class JournalConfig:
    # file://PATH, redis://HOST:PORT/DB or "none".
    url: str = "file://kvbroker.journal"
    # Redis stream key; "{id}" is replaced by broker.id. On a Redis Cluster
    # (redis+cluster://) the default is CLUSTER_STREAM, and a key must carry a hash tag.
    stream: str = "kvbroker:{id}:journal"
    # Redis retention: approximate MAXLEN of the stream.
    maxlen: int = 10_000_000
    # Also journal the directives sent, so replay can verify itself.
    directives: bool = True
    # File journal: fsync after each written group of records.
    fsync: bool = False
    # Records written per pipeline / write call at most.
    max_group: int = 512
    # On start, rebuild residency and each client's last batch_seq from the journal.
    recover: bool = True
    # "journal": answer a batch only once its journal record is written (a crash then loses
    # no answered batch); "memory": answer at once and journal behind (lower latency).
    ack_after: str = "journal"
    # Redis journal: while Redis is unreachable, records go to an append-only spool file in
    # this directory (created when first needed) and drain to Redis, in order, once it is
    # back. A spooled record counts as written (fsynced when journal.fsync). "" = no spool:
    # records wait in memory and answers wait with them (ack_after = "journal").
    spool_dir: str = "kvbroker.spool"
    # Bound of the spool file on disk, in bytes.
    spool_max_bytes: int = 1 << 30
    # Spool full while Redis is unreachable: "refuse" new batches (UNAVAILABLE, not applied)
    # or "drop" their journal records (counted in journal_dropped and logged).
    spool_full: str = "refuse"
    # Redis Cluster journal: a write counts (and its batches are answered) once this many
    # replicas of the shard hold it (WAIT), so a master's failover loses none; 0 = do not wait.
    wait_replicas: int = 1
    # Redis journal: the longest one write (or connect) may take before Redis counts as
    # unreachable and records go to the spool. A hung Redis stalls answers this long.
    redis_timeout_s: float = 0.5
    # Redis journal: one writer per stream. The broker holds the lease KEY:lease (with a
    # fencing token) for this long, renewed every lease_s / 3; another broker is refused
    # while it runs and may take the stream over only once it expired. 0 = no lease.
    lease_s: float = 10.0
    # serve: append a snapshot of the state (broker.journal.snapshots) after this many
    # batches, so that a restart applies at most about this many; 0 = never.
    snapshot_batches: int = 1_000_000


# journal.snapshot_batches: 0 (never), else within these (a snapshot forks the broker and
# writes its whole state: more often than every 1,000 batches is all snapshots).
SNAPSHOT_BATCHES_RANGE = (1_000, 1_000_000_000)


# The default stream key on a Redis Cluster: the broker id in braces is the key's hash tag,
# so the stream and its directives stream (KEY:directives) share a slot (one MULTI/EXEC).
CLUSTER_STREAM = "kvbroker:{{id}}:journal"
_CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


# history.ghosts by default (CoreConfig.history_ghosts); journals written before the key
# existed replay with 0, as they ran.
DEFAULT_HISTORY_GHOSTS: Final = 8.0
MAX_HISTORY_GHOSTS: Final = 1024.0
# history.max_ghosts by default: the count bound beside history.ghosts' bytes bound (a ghost
# costs about 240 bytes, whatever its block's size: bench/ghost_memory.py --broker). Journals
# written before the key replay without it (0), as they ran.
DEFAULT_MAX_GHOSTS: Final = 1_000_000
MAX_MAX_GHOSTS: Final = 2**40


@dataclasses.dataclass(frozen=True)
class CoreConfig:
    """The part of the config the deterministic core depends on."""

    tiers: tuple[TierConfig, ...] = DEFAULT_TIERS
    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
    # A block is prefetched when its deadline is within transfer time plus this margin.
    prefetch_margin_us: int = 500
    # Outstanding (unacknowledged) directives remembered for acks; the oldest are forgotten.
    max_outstanding_directives: int = 1_000_000
    # Cost model: time to recompute a dropped block whose intent gives no recompute cost.
    recompute_us: int = 5_000
    # KV quantization: scales block footprints and adds a dequantization time per transfer.
    quant: str = "fp16"
    # limits.max_blocks_per_tenant (0 = none): here because the core enforces it, so replay
    # and recovery (which see the journaled CoreConfig) refuse the same allocations.
    max_blocks_per_tenant: int = 0
    # limits.max_clock_skew_us (0 = off): how far an event's ts_us may run ahead of the
    # broker's clock, measured against the time the broker received its batch (stamped in
    # the journaled batch, so replay decides the same). Here because the core enforces it.
    max_clock_skew_us: int = 60_000_000
    # history.ghosts: how much history of freed blocks the core keeps (a block's reuses and
    # reads, by block id), as a multiple of the tiers' total capacity in bytes; 0 keeps none.
    # An engine that frees what it evicts (vLLM's CPU tier) stores a chunk again under the
    # same id: with a ghost, that store is a re-reference, as in a replay where the dropped
    # block stays known. docs/configuration.md says how the default was chosen.
    history_ghosts: float = DEFAULT_HISTORY_GHOSTS
    # history.max_ghosts: at most this many ghosts, whatever their sizes (0: the bytes bound
    # alone). The bytes bound alone let one client allocate and free 1-byte blocks until the
    # ghosts held ~8.6e9 entries (docs/configuration.md, "Block history"); the oldest go first.
    history_max_ghosts: int = DEFAULT_MAX_GHOSTS


# bytes per scalar relative to fp16, and dequantization time per transfer (kv-hierarchy-lab)
QUANT: dict[str, tuple[float, int]] = {"fp16": (1.0, 0), "fp8": (0.5, 10), "int4": (0.25, 30), "int2": (0.125, 60)}


@dataclasses.dataclass(frozen=True)
class BrokerConfig:
    broker_id: str = "kvbroker"
    listen: str = "127.0.0.1:50051"
    core: CoreConfig = dataclasses.field(default_factory=CoreConfig)
    journal: JournalConfig = dataclasses.field(default_factory=JournalConfig)
    telemetry: TelemetryConfig = dataclasses.field(default_factory=TelemetryConfig)
    health: HealthConfig = dataclasses.field(default_factory=HealthConfig)
    security: SecurityConfig = dataclasses.field(default_factory=SecurityConfig)
    limits: LimitsConfig = dataclasses.field(default_factory=LimitsConfig)

    def stream_key(self) -> str:
        stream = self.journal.stream
        if stream == JournalConfig.stream and self.journal.url.startswith(_CLUSTER_SCHEMES):
            stream = CLUSTER_STREAM
        return stream.replace("{id}", self.broker_id)


def with_policy(config: CoreConfig, name: str, params: dict[str, Any] | None = None) -> CoreConfig:
    """The config running ``name`` instead (with its configured parameters when it is the
    configured policy). Replays of other policies and shadows follow config changes so."""
    if params is None:
        params = dict(config.policy.params) if name == config.policy.name else {}
    return dataclasses.replace(config, policy=PolicyConfig(name, params))


def core_to_json(core: CoreConfig) -> str:
    """The core config as JSON, as journaled in CONFIG records."""
    return json.dumps(dataclasses.asdict(core), sort_keys=True)


def core_from_json(text: str) -> CoreConfig:
    """Inverse of ``core_to_json``."""
    try:
        data = json.loads(text)
        tiers = tuple(TierConfig(**t) for t in data.pop("tiers"))
        raw_policy = data.pop("policy")
        raw_policy["shadows"] = tuple(raw_policy.get("shadows", ()))
        raw_policy["split"] = tuple((str(name), float(share)) for name, share in raw_policy.get("split", ()))
        policy = PolicyConfig(**raw_policy)
        # A journal from before history.ghosts ran without ghosts: it replays so.
        data.setdefault("history_ghosts", 0.0)
        data.setdefault("history_max_ghosts", 0)  # nor a count bound before history.max_ghosts
        return CoreConfig(tiers=tiers, policy=policy, **data)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"journaled config is not readable: {exc}") from exc


def check_history_ghosts(value: float, key: str) -> float:
    """A ghost bound: a number in [0, MAX_HISTORY_GHOSTS] (NaN and infinities refused)."""
    if not 0.0 <= value <= MAX_HISTORY_GHOSTS:
        raise ConfigError(
            f"{key}: must be a multiple of the tiers' capacity in 0..{MAX_HISTORY_GHOSTS:g} (0: keep no history), got {value!r}"
        )
    return value


def check_listen(listen: str, key: str = "broker.listen") -> None:
    """``HOST:PORT`` with a port in 1..65535, or 0 (pick a free one); else ConfigError."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{key}: expected HOST:PORT, got {listen!r}")
    if not port.isdigit():
        raise ConfigError(f"{key}: port {port!r} is not a number (HOST:PORT, port 1..65535, or 0 for a free one)")
    if int(port) > 65535:
        raise ConfigError(f"{key}: port {int(port)} is out of range (1..65535, or 0 for a free one)")


def _take(table: dict[str, Any], key: str, where: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = table.pop(key, default)
    if value is default:
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and kind is not bool:
        raise ConfigError(f"{where}{key}: expected {getattr(kind, '__name__', kind)}, got {value!r}")
    if not isinstance(value, kind):
        name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ConfigError(f"{where}{key}: expected {name}, got {value!r}")
    return value


def _no_extra(table: dict[str, Any], where: str) -> None:
    if table:
        raise ConfigError(f"unknown key(s) {', '.join(where + k for k in sorted(table))}")


def _table(root: dict[str, Any], key: str) -> dict[str, Any]:
    value = root.pop(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a table, got {value!r}")
    return dict(value)


def _tier(raw: Any, i: int) -> TierConfig:
    where = f"tiers[{i}]."
    if not isinstance(raw, dict):
        raise ConfigError(f"tiers[{i}]: expected a table")
    t = dict(raw)
    name = _take(t, "name", where, str, None)
    if not name:
        raise ConfigError(f"{where}name: required, a non-empty string")
    if "capacity" not in t:
        raise ConfigError(f"{where}capacity: required (bytes, or a size such as 16GiB)")
    capacity = parse_size(t.pop("capacity"), where + "capacity")
    latency = _take(t, "read_latency_us", where, float, 0.0)
    bandwidth = _take(t, "bandwidth_gb_per_s", where, float, 25.0)
    high = _take(t, "high_watermark", where, float, 0.95)
    low = _take(t, "low_watermark", where, float, 0.90)
    channels = _take(t, "channels", where, int, 2)
    _no_extra(t, where)
    if not 1 <= channels <= MAX_CHANNELS:
        raise ConfigError(f"{where}channels: must be in 1..{MAX_CHANNELS}, got {channels}")
    if not 0 <= latency < math.inf:  # NaN fails too
        raise ConfigError(f"{where}read_latency_us: must be a finite number >= 0, got {latency}")
    if not 0 < bandwidth < math.inf:
        raise ConfigError(f"{where}bandwidth_gb_per_s: must be a finite number > 0, got {bandwidth}")
    if not 0 < high <= 1:
        raise ConfigError(f"{where}high_watermark: must be in (0, 1], got {high}")
    if not 0 < low <= high:
        raise ConfigError(f"{where}low_watermark: must be in (0, high_watermark={high}], got {low}")
    return TierConfig(name, capacity, latency, bandwidth, high, low, channels)


def config_from_dict(data: dict[str, Any]) -> BrokerConfig:
    """Validate a parsed TOML document and build the config; unknown keys are errors."""
    root = dict(data)
    broker = _table(root, "broker")
    broker_id = _take(broker, "id", "broker.", str, "kvbroker")
    listen = _take(broker, "listen", "broker.", str, "127.0.0.1:50051")
    _no_extra(broker, "broker.")
    if not broker_id:
        raise ConfigError("broker.id: must be non-empty")
    check_listen(listen)

    raw_tiers = root.pop("tiers", None)
    tiers: tuple[TierConfig, ...]
    if raw_tiers is None:
        tiers = DEFAULT_TIERS
    else:
        if not isinstance(raw_tiers, list) or not raw_tiers:
            raise ConfigError("tiers: expected a non-empty array of tables ([[tiers]])")
        tiers = tuple(_tier(t, i) for i, t in enumerate(raw_tiers))
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise ConfigError(f"tiers: names must be unique, got {names}")

    pol = _table(root, "policy")
    policy_name = _take(pol, "name", "policy.", str, DEFAULT_POLICY)
    params = _take(pol, "params", "policy.", dict, {})
    shadows = _take(pol, "shadows", "policy.", list, [])
    split = _split(_take(pol, "split", "policy.", dict, {}))
    _no_extra(pol, "policy.")
    for i, shadow in enumerate(shadows):
        if not isinstance(shadow, str) or not shadow:
            raise ConfigError(f"policy.shadows[{i}]: expected a policy name, got {shadow!r}")
    if split and shadows:
        raise ConfigError("policy.split: cannot be combined with policy.shadows (run a split or shadows, not both)")

    cost = _table(root, "cost")
    recompute_us = _take(cost, "recompute_us", "cost.", int, 5_000)
    quant = _take(cost, "quant", "cost.", str, "fp16")
    _no_extra(cost, "cost.")
    if recompute_us < 0:
        raise ConfigError(f"cost.recompute_us: must be >= 0, got {recompute_us}")
    if quant not in QUANT:
        raise ConfigError(f"cost.quant: unknown {quant!r} (one of {', '.join(QUANT)})")

    history = _table(root, "history")
    ghosts = check_history_ghosts(_take(history, "ghosts", "history.", float, DEFAULT_HISTORY_GHOSTS), "history.ghosts")
    max_ghosts = _take(history, "max_ghosts", "history.", int, DEFAULT_MAX_GHOSTS)
    _no_extra(history, "history.")
    if not 0 <= max_ghosts <= MAX_MAX_GHOSTS:
        raise ConfigError(f"history.max_ghosts: must be in 0..{MAX_MAX_GHOSTS} (0: the history.ghosts bytes bound alone), got {max_ghosts}")

    pre = _table(root, "prefetch")
    margin = _take(pre, "margin_us", "prefetch.", int, 500)
    _no_extra(pre, "prefetch.")
    if margin < 0:
        raise ConfigError(f"prefetch.margin_us: must be >= 0, got {margin}")

    jr = _table(root, "journal")
    journal = JournalConfig(
        url=_take(jr, "url", "journal.", str, JournalConfig.url),
        stream=_take(jr, "stream", "journal.", str, JournalConfig.stream),
        maxlen=_take(jr, "maxlen", "journal.", int, JournalConfig.maxlen),
        directives=_take(jr, "directives", "journal.", bool, JournalConfig.directives),
        fsync=_take(jr, "fsync", "journal.", bool, JournalConfig.fsync),
        max_group=_take(jr, "max_group", "journal.", int, JournalConfig.max_group),
        recover=_take(jr, "recover", "journal.", bool, JournalConfig.recover),
        ack_after=_take(jr, "ack_after", "journal.", str, JournalConfig.ack_after),
        spool_dir=_take(jr, "spool_dir", "journal.", str, JournalConfig.spool_dir),
        # A size like the tiers' capacities: bytes, or "512MiB".
        spool_max_bytes=parse_size(jr.pop("spool_max_bytes"), "journal.spool_max_bytes")
        if "spool_max_bytes" in jr
        else JournalConfig.spool_max_bytes,
        spool_full=_take(jr, "spool_full", "journal.", str, JournalConfig.spool_full),
        wait_replicas=_take(jr, "wait_replicas", "journal.", int, JournalConfig.wait_replicas),
        redis_timeout_s=_take(jr, "redis_timeout_s", "journal.", float, JournalConfig.redis_timeout_s),
        lease_s=_take(jr, "lease_s", "journal.", float, JournalConfig.lease_s),
        snapshot_batches=_take(jr, "snapshot_batches", "journal.", int, JournalConfig.snapshot_batches),
    )
    if journal.ack_after not in ("journal", "memory"):
        raise ConfigError(f'journal.ack_after: must be "journal" or "memory", got {journal.ack_after!r}')
    _no_extra(jr, "journal.")
    if journal.maxlen <= 0:
        raise ConfigError(f"journal.maxlen: must be > 0, got {journal.maxlen}")
    if journal.max_group <= 0:
        raise ConfigError(f"journal.max_group: must be > 0, got {journal.max_group}")
    if journal.wait_replicas < 0:
        raise ConfigError(f"journal.wait_replicas: must be >= 0, got {journal.wait_replicas}")
    if journal.spool_max_bytes < MIN_SPOOL_BYTES:
        raise ConfigError(f"journal.spool_max_bytes: must be >= {MIN_SPOOL_BYTES}, got {journal.spool_max_bytes}")
    if journal.spool_full not in ("refuse", "drop"):
        raise ConfigError(f'journal.spool_full: must be "refuse" or "drop", got {journal.spool_full!r}')
    if not 0.001 <= journal.redis_timeout_s <= 600:  # NaN fails too
        raise ConfigError(f"journal.redis_timeout_s: must be in 0.001..600 seconds, got {journal.redis_timeout_s}")
    if not (journal.lease_s == 0 or 1 <= journal.lease_s <= 86400):  # NaN fails too
        raise ConfigError(f"journal.lease_s: must be 0 (no lease) or in 1..86400 seconds, got {journal.lease_s}")
    low, high = SNAPSHOT_BATCHES_RANGE
    if journal.snapshot_batches != 0 and not low <= journal.snapshot_batches <= high:
        raise ConfigError(f"journal.snapshot_batches: must be 0 (never) or in {low:,}..{high:,} batches, got {journal.snapshot_batches}")
    if "\0" in journal.spool_dir:
        raise ConfigError("journal.spool_dir: must not contain NUL")
    telemetry = telemetry_config_from_dict(_table(root, "telemetry"))
    health = health_config_from_dict(_table(root, "health"))
    security = security_config_from_dict(_table(root, "security"))
    limits = limits_config_from_dict(_table(root, "limits"))
    _no_extra(root, "")

    core = CoreConfig(
        tiers=tiers,
        policy=PolicyConfig(policy_name, dict(params), tuple(shadows), split),
        prefetch_margin_us=margin,
        recompute_us=recompute_us,
        quant=quant,
        max_blocks_per_tenant=limits.max_blocks_per_tenant,
        max_clock_skew_us=limits.max_clock_skew_us,
        max_outstanding_directives=limits.max_outstanding_directives,
        history_ghosts=ghosts,
        history_max_ghosts=max_ghosts,
    )
    config = BrokerConfig(
        broker_id=broker_id,
        listen=listen,
        core=core,
        journal=journal,
        telemetry=telemetry,
        health=health,
        security=security,
        limits=limits,
    )
    validate_policy(core)
    return config


def _split(raw: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    """``{arc = 0.5, lru = 0.5}``: shares in (0, 1] summing to 1, at least two arms."""
    if not raw:
        return ()
    arms: list[tuple[str, float]] = []
    for name, share in raw.items():
        if isinstance(share, bool) or not isinstance(share, (int, float)):
            raise ConfigError(f"policy.split.{name}: expected a share such as 0.5, got {share!r}")
        if not 0 < share <= 1:
            raise ConfigError(f"policy.split.{name}: must be in (0, 1], got {share!r}")
        arms.append((name, float(share)))
    if len(arms) < 2:
        raise ConfigError(f"policy.split: needs at least two arms, got {len(arms)}")
    total = sum(share for _, share in arms)
    if abs(total - 1.0) > 1e-6:
        raise ConfigError(f"policy.split: shares must sum to 1, got {total:g}")
    return tuple(arms)


def validate_policy(core: CoreConfig, *, may_import: bool = True) -> None:
    """Resolve the policy and its parameters now, and build the policy for each tier, so a
    bad one is refused before use: what validates is what runs (``may_import=False``:
    built-in names only, policies.registry.policy_class)."""
    from policies.base import Clock, PolicyContext, PolicyError
    from policies.registry import make_params, policy_class

    try:
        cls = policy_class(core.policy.name, may_import=may_import)
    except PolicyError as exc:
        raise ConfigError(f"policy.name: {exc}") from exc
    try:
        params = make_params(cls, core.policy.params)
    except PolicyError as exc:
        raise ConfigError(f"policy.params: {exc}") from exc
    if not cls.offline:
        infos = tuple(t.info(i) for i, t in enumerate(core.tiers))
        for info in infos:
            try:
                cls(PolicyContext(info, infos, Clock()), params)
            except Exception as exc:  # a policy's own refusal, or a parameter its arithmetic cannot take
                raise ConfigError(f"policy.params: policy {cls.name} at tier {info.name!r}: {exc}") from exc
    for i, shadow in enumerate(core.policy.shadows):
        try:
            shadow_cls = policy_class(shadow, may_import=may_import)
        except PolicyError as exc:
            raise ConfigError(f"policy.shadows[{i}]: {exc}") from exc
        if shadow_cls.offline:
            raise ConfigError(f"policy.shadows[{i}]: {shadow} needs the future of the stream; it runs in replay only")
    for arm, _ in core.policy.split:
        try:
            arm_cls = policy_class(arm, may_import=may_import)
        except PolicyError as exc:
            raise ConfigError(f"policy.split.{arm}: {exc}") from exc
        if arm_cls.offline:
            raise ConfigError(f"policy.split.{arm}: {arm} needs the future of the stream; it runs in replay only")
    if cls.offline:
        raise ConfigError(f"policy.name: {cls.name} needs the future of the stream; it runs in replay only, not live")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def config_to_toml(config: BrokerConfig) -> str:
    """The config as TOML that ``parse_config`` reads back to an equal config."""
    core, journal = config.core, config.journal
    lines = [
        "[broker]",
        f"id = {_toml_value(config.broker_id)}",
        f"listen = {_toml_value(config.listen)}",
        "",
        "[policy]",
        f"name = {_toml_value(core.policy.name)}",
        f"params = {_toml_value(core.policy.params)}",
        f"shadows = {_toml_value(list(core.policy.shadows))}",
        f"split = {_toml_value(dict(core.policy.split))}",
        "",
        "[prefetch]",
        f"margin_us = {core.prefetch_margin_us}",
        "",
        "[cost]",
        f"recompute_us = {core.recompute_us}",
        f"quant = {_toml_value(core.quant)}",
        "",
        "[history]",
        f"ghosts = {_toml_value(core.history_ghosts)}",
        f"max_ghosts = {core.history_max_ghosts}",
        "",
        "[journal]",
    ]
    for field in dataclasses.fields(JournalConfig):
        lines.append(f"{field.name} = {_toml_value(getattr(journal, field.name))}")
    for tier in core.tiers:
        lines += ["", "[[tiers]]"]
        for field in dataclasses.fields(TierConfig):
            key = "capacity" if field.name == "capacity_bytes" else field.name
            lines.append(f"{key} = {_toml_value(getattr(tier, field.name))}")
    lines += ["", *config.telemetry.toml_lines(), "", *config.health.toml_lines()]
    lines += ["", *config.security.toml_lines(), "", *config.limits.toml_lines()]
    return "\n".join(lines) + "\n"


def _check_ints(value: Any, key: str) -> None:
    """TOML integers are 64-bit signed; tomllib reads larger ones, refused here by key."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_ints(v, f"{key}.{k}" if key else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_ints(v, f"{key}[{i}]")
    elif isinstance(value, int) and not -(2**63) <= value < 2**63:
        raise ConfigError(f"{key}: {value} is out of TOML's 64-bit integer range")


def parse_config(text: str) -> BrokerConfig:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"malformed TOML: {exc}") from exc
    _check_ints(data, "")
    return config_from_dict(data)


def load_config(path: str | None) -> BrokerConfig:
    """Load a config file, or the defaults when ``path`` is None."""
    if path is None:
        return BrokerConfig()
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read config {path}: not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    return parse_config(text)
