"""The kvbroker CachePolicy's settings: ``kv_connector_extra_config`` keys, environment
variables as the fallback, checked at once with errors that name the key.

vLLM users configure a connector in ``--kv-transfer-config``; vLLM hands its
``kv_connector_extra_config`` to the offloading spec, and the keys below (all prefixed
``kvbroker_``) ride along beside vLLM's own (``cpu_bytes_to_use``, ``eviction_policy``,
``cache_policy_module_path``, ...). A key missing there is read from the environment variable
``KVBROKER_VLLM_<KEY>`` (``kvbroker_policy`` -> ``KVBROKER_VLLM_POLICY``), then the default.

A ``kvbroker_`` key this module does not know is an error (a typo must not silently run
the default policy).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any, Final

from broker.config import ConfigError, CoreConfig, PolicyConfig, TierConfig
from broker.config.settings import DEFAULT_HISTORY_GHOSTS, DEFAULT_POLICY, check_history_ghosts, validate_policy
from broker.journal.redis_urls import is_redis_url
from vllm_integration.decisions_to_vllm.security_env import security_problem

PREFIX: Final = "kvbroker_"
ENV_PREFIX: Final = "KVBROKER_VLLM_"
MODES: Final = ("embedded", "sidecar")
# The one tier of the embedded core: vLLM's CPU tier, one byte per chunk.
TIER: Final = "cpu"
# The what-if sizes' sampling rate: measured error and cost in docs/vllm.md ("What-if sizes").
DEFAULT_WHATIF_SAMPLE: Final = 0.1
# Directives the embedded core remembers for acknowledgements that never come.
OUTSTANDING: Final = 1024
# The largest what-if size, as a multiple of the tier (a bound on a shadow's memory).
MAX_WHATIF: Final = 64.0
# The most what-if sizes, and the most chunks they may simulate together, as a multiple of
# the tier (the sum of each size's multiple times the sampling rate): each size is a core of
# its own fed every request, so their count costs vLLM's thread time and their chunks its
# memory (docs/vllm.md, "Their memory": about 3 KB per chunk of a size).
MAX_WHATIF_SIZES: Final = 8
MAX_WHATIF_CHUNKS: Final = 64.0
# A tenant's bytes of UTF-8, as a request's hint allows (vllm_integration/hints.py).
MAX_TENANT_BYTES: Final = 256
# The timers' ranges (inclusive), in their keys' units: each is waited on by a thread, so
# it must be one Python can wait (a threading wait of 1e10 s raises OverflowError: the
# watcher and the report thread died of it), and not so short that it spins (report_s
# 1e-9 logged 74,053 lines in 2 s).
TIMERS: Final = {
    "journal_flush_ms": (1.0, 60_000.0, "ms"),
    "journal_exit_s": (0.1, 3600.0, "s"),
    "deadline_ms": (0.01, 60_000.0, "ms"),
    "report_s": (0.1, 86_400.0, "s"),
    "status_s": (0.01, 86_400.0, "s"),
    "settings_poll_s": (0.01, 3600.0, "s"),
}


class SettingsError(ValueError):
    """A setting is not usable; the message starts with where it came from and its key."""


@dataclasses.dataclass(frozen=True)
class OffloadSettings:
    """What the kvbroker CachePolicy runs with."""

    # "embedded": the policy runs in vLLM's scheduler process; "sidecar": a kvbroker serve decides.
    mode: str = "embedded"
    # A registered kvbroker policy (``kvbroker policies`` lists them) and its parameters.
    policy: str = DEFAULT_POLICY
    policy_params: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Where decisions are journaled: none, file://PATH or redis://HOST:PORT/DB (also rediss://,
    # unix://, redis+cluster://); "{pid}" is replaced by the process id, "{rank}" by vLLM's
    # data-parallel index of the engine (one writer per file).
    journal: str = "none"
    # Redis stream key of the journal; "{client}" is replaced by client_id.
    journal_stream: str = "kvbroker:{client}:journal"
    # How often the journal thread writes what was recorded (milliseconds).
    journal_flush_ms: float = 50.0
    # The longest the process's exit waits for the journal to take what is queued (seconds):
    # past it (disk full, Redis down) the rest is given up and one ERROR line says how many
    # records were lost, from which batch on.
    journal_exit_s: float = 3.0
    # The client id of this engine's batches ("{pid}", "{rank}" replaced); a data-parallel
    # rank each its own.
    client_id: str = "vllm"
    # The tenant the chunks belong to when a request's hint names none ("": none).
    tenant: str = ""
    # Sidecar mode: the broker's address and the hard bound of one decision (milliseconds).
    broker: str = ""
    deadline_ms: float = 5.0
    # Sidecar mode: the local policy used when the broker is slow or down ("" = ``policy``).
    fallback_policy: str = ""
    # Sidecar mode: the broker's tier this rank's chunks live in ("" = the broker's top tier;
    # "{rank}" replaced): a tier per data-parallel rank (vllm_integration/decisions_to_vllm/sidecar.py).
    broker_tier: str = ""
    # The history of evicted chunks kept (their reads and reuses, by key), as a multiple of
    # the CPU tier's chunks (CoreConfig.history_ghosts): a chunk vLLM stores again comes back
    # with its history, a re-reference.
    history_ghosts: float = DEFAULT_HISTORY_GHOSTS
    # Shadow policies (vllm_integration/decisions_to_vllm/shadows.py): each runs on the same requests at the
    # tier's capacity, deciding nothing; their hits are reported beside the decider's.
    shadows: tuple[str, ...] = ()
    # What-if sizes: the deciding policy at these multiples of the tier's capacity.
    whatif: tuple[float, ...] = ()
    # The spatial sampling rate of the what-if sizes (SHARDS): the share of keys simulated,
    # in a cache that much smaller (1 = exact).
    whatif_sample: float = DEFAULT_WHATIF_SAMPLE
    # Reporting (vllm_integration/decisions_to_vllm/report.py): an INFO line of each row's hits this often
    # (seconds), and one at exit.
    report_s: float = 60.0
    # Prometheus metrics over HTTP on this port (None: off; 0: any free port, logged; a rank
    # r > 0 serves on port + r, so data-parallel ranks do not collide), bound to metrics_host.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # The figures as JSON, rewritten whole (temp file + rename) every status_s seconds and at
    # exit ("": off; "{pid}", "{rank}" replaced); `kvbroker vllm-status PATH` reads it.
    status_file: str = ""
    status_s: float = 5.0
    # A JSON object of kvbroker_* keys that overrides the ones above ("{pid}", "{rank}"
    # replaced; "" = none), read at start and watched: a change is applied live
    # (vllm_integration/decisions_to_vllm/reload.py). How often it is looked at (seconds).
    settings_file: str = ""
    settings_poll_s: float = 1.0

    def core_config(self, capacity_chunks: int, policy: str | None = None) -> CoreConfig:
        """The embedded core's config: one tier of ``capacity_chunks`` one-byte chunks,
        watermarks at 1.0 (vLLM makes room itself, with EvictionRequested, before it stores)."""
        tier = TierConfig(
            TIER, max(1, capacity_chunks), read_latency_us=0.0, bandwidth_gb_per_s=25.0, high_watermark=1.0, low_watermark=1.0
        )
        name = policy or self.policy
        params = self.policy_params if name == self.policy else {}
        # Nobody acknowledges the adapter's directives (vLLM carries them out as it gets
        # them): remember few, not the broker's million.
        policy_config = PolicyConfig(name, dict(params))
        return CoreConfig(
            tiers=(tier,),
            policy=policy_config,
            max_clock_skew_us=0,
            max_outstanding_directives=OUTSTANDING,
            history_ghosts=self.history_ghosts,
            # A chunk counts one byte here: history_ghosts' bound is already a count.
            history_max_ghosts=0,
        )

    # vLLM's data-parallel index of the engine ("{rank}"), when the policy could learn it.
    rank: int = 0

    def _placeholders(self, text: str) -> str:
        return text.replace("{pid}", str(os.getpid())).replace("{rank}", str(self.rank))

    def resolved_journal(self) -> str:
        return self._placeholders(self.journal)

    def resolved_client_id(self) -> str:
        return self._placeholders(self.client_id)

    def resolved_broker_tier(self) -> str:
        return self._placeholders(self.broker_tier)

    def resolved_status_file(self) -> str:
        return self._placeholders(self.status_file)

    def resolved_settings_file(self) -> str:
        return self._placeholders(self.settings_file)


def _text(value: Any, where: str) -> str:
    """A string that UTF-8 can encode (JSON's ``"\\ud800"`` is a lone surrogate it cannot:
    every event naming it would raise)."""
    if not isinstance(value, str):
        raise SettingsError(f"{where}: expected a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SettingsError(f"{where}: not valid UTF-8 (a lone surrogate at character {exc.start})") from None
    return value


def _tenant(value: Any, where: str) -> str:
    """A tenant: valid UTF-8, at most MAX_TENANT_BYTES (every chunk's event carries it)."""
    tenant = _text(value, where)
    size = len(tenant.encode("utf-8"))
    if size > MAX_TENANT_BYTES:
        raise SettingsError(f"{where}: longer than {MAX_TENANT_BYTES} bytes of UTF-8 ({size})")
    return tenant


def _number(value: Any, where: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise SettingsError(f"{where}: expected a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise SettingsError(f"{where}: expected a finite number > 0, got {value!r}")
    return float(value)


def _timer(name: str) -> Callable[[Any, str], float]:
    """The reader of the timer ``name``: a number within its range (TIMERS)."""
    lo, hi, unit = TIMERS[name]

    def read(value: Any, where: str) -> float:
        number = _number(value, where)
        if not lo <= number <= hi:
            raise SettingsError(f"{where}: expected a number in {lo:g}..{hi:g} ({unit}), got {number:g}")
        return number

    return read


def _mode(value: Any, where: str) -> str:
    mode = _text(value, where)
    if mode not in MODES:
        raise SettingsError(f"{where}: expected one of {', '.join(MODES)}, got {mode!r}")
    return mode


def _params(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError as exc:
            raise SettingsError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(value, Mapping):
        raise SettingsError(f"{where}: expected an object of policy parameters, got {type(value).__name__}")
    return dict(value)


def _journal(value: Any, where: str) -> str:
    url = _text(value, where)
    if url == "none" or is_redis_url(url):
        return url
    if url.startswith("file://") and len(url) > len("file://"):
        return url
    raise SettingsError(f"{where}: expected none, file://PATH or redis://HOST:PORT/DB (rediss://, unix://, redis+cluster://), got {url!r}")


def _ghosts(value: Any, where: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise SettingsError(f"{where}: expected a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SettingsError(f"{where}: expected a number, got {type(value).__name__}")
    try:
        return check_history_ghosts(float(value), where)
    except ConfigError as exc:
        raise SettingsError(str(exc)) from None


def _items(value: Any, where: str, expected: str) -> list[Any]:
    """A setting's list: a comma-separated string (blank: none) or a JSON/Python list."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",")] if value.strip() else []
    if isinstance(value, (list, tuple)):
        return list(value)
    raise SettingsError(f"{where}: expected {expected} separated by commas, got {type(value).__name__}")


def _names(value: Any, where: str) -> tuple[str, ...]:
    """A list of policy names."""
    names: list[str] = []
    for i, item in enumerate(_items(value, where, "policy names")):
        if not isinstance(item, str) or not item:
            raise SettingsError(f"{where}[{i}]: expected a policy name, got {item!r}")
        if item in names:
            raise SettingsError(f"{where}[{i}]: {item!r} is named twice")
        names.append(item)
    return tuple(names)


def _multiples(value: Any, where: str) -> tuple[float, ...]:
    """What-if sizes: multiples of the tier, > 0, at most MAX_WHATIF_SIZES of them."""
    out: list[float] = []
    items = _items(value, where, "multiples of the tier (e.g. 0.5,2,4)")
    if len(items) > MAX_WHATIF_SIZES:
        raise SettingsError(f"{where}: at most {MAX_WHATIF_SIZES} sizes (each a core fed every request), got {len(items)}")
    for i, item in enumerate(items):
        multiple = _number(item, f"{where}[{i}]")
        if multiple > MAX_WHATIF:
            raise SettingsError(f"{where}[{i}]: at most {MAX_WHATIF:g} times the tier, got {multiple:g}")
        if multiple in out:
            raise SettingsError(f"{where}[{i}]: {multiple:g} is named twice")
        out.append(multiple)
    return tuple(out)


def _rate(value: Any, where: str) -> float:
    rate = _number(value, where)
    if rate > 1.0:
        raise SettingsError(f"{where}: a sampling rate is in (0, 1], got {rate:g}")
    return rate


def _non_empty(value: Any, where: str) -> str:
    text = _text(value, where)
    if not text:
        raise SettingsError(f"{where}: required, a non-empty string")
    return text


def _port(value: Any, where: str) -> int:
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise SettingsError(f"{where}: expected a port number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SettingsError(f"{where}: expected a port number (an integer), got {type(value).__name__}")
    if not 0 <= value <= 65535:
        raise SettingsError(f"{where}: expected a port in 0..65535 (0: any free port), got {value}")
    return value


# key (without the prefix) -> how its value is read.
READERS: Final[dict[str, Callable[[Any, str], Any]]] = {
    "mode": _mode,
    "policy": _non_empty,
    "policy_params": _params,
    "journal": _journal,
    "journal_stream": _non_empty,
    "journal_flush_ms": _timer("journal_flush_ms"),
    "journal_exit_s": _timer("journal_exit_s"),
    "client_id": _non_empty,
    "tenant": _tenant,
    "broker": _text,
    "deadline_ms": _timer("deadline_ms"),
    "fallback_policy": _text,
    "broker_tier": _text,
    "history_ghosts": _ghosts,
    "shadows": _names,
    "whatif": _multiples,
    "whatif_sample": _rate,
    "report_s": _timer("report_s"),
    "metrics_port": _port,
    "metrics_host": _non_empty,
    "status_file": _non_empty,
    "status_s": _timer("status_s"),
    "settings_file": _text,
    "settings_poll_s": _timer("settings_poll_s"),
}


def load_settings(
    extra_config: Mapping[str, Any] | None,
    environ: Mapping[str, str] | None = None,
    *,
    rank: int = 0,
    overrides: Mapping[str, Any] | None = None,
    overrides_from: str = "",
) -> OffloadSettings:
    """Settings from ``extra_config`` (vLLM's kv_connector_extra_config), the environment as
    the fallback, then the defaults. ``overrides`` (the settings file's keys, read from
    ``overrides_from``) win over both. Raises SettingsError naming the first bad key."""
    extra = dict(extra_config or {})
    file_keys = dict(overrides or {})
    env = os.environ if environ is None else environ
    known = ", ".join(PREFIX + k for k in READERS)
    for key in extra:
        if isinstance(key, str) and key.startswith(PREFIX) and key[len(PREFIX) :] not in READERS:
            raise SettingsError(f"kv_connector_extra_config.{key}: unknown key (known: {known})")
    for key in file_keys:
        # The file holds kvbroker_* keys only: vLLM's own keys cannot change there.
        if not (isinstance(key, str) and key.startswith(PREFIX) and key[len(PREFIX) :] in READERS):
            raise SettingsError(f"{overrides_from}: {key}: unknown key (known: {known})")
    sources = Sources(extra, file_keys, overrides_from)
    values: dict[str, Any] = {}
    for name, read in READERS.items():
        key = PREFIX + name
        if key in file_keys or key in extra:
            values[name] = read(file_keys[key] if key in file_keys else extra[key], sources.where(name))
        elif ENV_PREFIX + name.upper() in env:
            values[name] = read(env[ENV_PREFIX + name.upper()], ENV_PREFIX + name.upper())
    settings = OffloadSettings(**values, rank=rank)
    # A module:Class policy is imported (its code run, inside vLLM) only when the start-up
    # settings name it: a settings file, which anyone who can write its folder may change,
    # names built-in policies or those, and any other is refused before an import.
    startup = load_settings(extra, environ, rank=rank) if file_keys else settings
    importable = {startup.policy, startup.fallback_policy, *startup.shadows}

    def may_import(key: str, name: str) -> bool:
        return PREFIX + key not in file_keys or name in importable

    try:
        validate_policy(settings.core_config(1), may_import=may_import("policy", settings.policy))
    except ConfigError as exc:
        # validate_policy names broker config keys (policy.name / policy.params): say ours.
        message = str(exc)
        key = "policy_params" if message.startswith("policy.params") else "policy"
        raise SettingsError(f"{sources.where(key)}: {message.partition(': ')[2]}") from None
    if settings.fallback_policy:
        try:
            validate_policy(
                settings.core_config(1, settings.fallback_policy), may_import=may_import("fallback_policy", settings.fallback_policy)
            )
        except ConfigError as exc:
            raise SettingsError(f"{sources.where('fallback_policy')}: {str(exc).partition(': ')[2]}") from None
    for i, name in enumerate(settings.shadows):
        try:
            validate_policy(
                dataclasses.replace(settings, policy=name, policy_params={}).core_config(1), may_import=may_import("shadows", name)
            )
        except ConfigError as exc:
            raise SettingsError(f"{sources.where('shadows')}[{i}]: {str(exc).partition(': ')[2]}") from None
    simulated = sum(settings.whatif) * settings.whatif_sample
    if simulated > MAX_WHATIF_CHUNKS:
        raise SettingsError(
            f"{sources.where('whatif')}: the sizes simulate {simulated:g} times the tier's chunks together "
            f"(the sum of the sizes times kvbroker_whatif_sample {settings.whatif_sample:g}); at most {MAX_WHATIF_CHUNKS:g}"
        )
    if settings.mode == "sidecar" and not settings.broker:
        raise SettingsError(f"{sources.where('broker')}: required in sidecar mode (the kvbroker serve address, HOST:PORT)")
    problem = security_problem(env) if settings.mode == "sidecar" else None
    if problem:
        raise SettingsError(problem)
    return settings


@dataclasses.dataclass(frozen=True)
class Sources:
    """Where the settings came from: vLLM's extra config, and the settings file's keys."""

    extra: Mapping[str, Any]
    file_keys: Mapping[str, Any]
    file: str

    def where(self, name: str) -> str:
        """Where a setting came from, for an error message."""
        key = PREFIX + name
        if key in self.file_keys:
            return f"{self.file}: {key}"
        return f"kv_connector_extra_config.{key}" if key in self.extra else f"{key} (or {ENV_PREFIX}{name.upper()})"
