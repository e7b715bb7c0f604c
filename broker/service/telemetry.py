"""Metrics and traces of a running broker: OpenTelemetry SDK, Prometheus `/metrics`, OTLP.

The hot path is untouched: every counter below is an *observable* instrument whose callback
reads the service's own counters (``CoreStats``, the journal, the tiers) when a reader
collects, i.e. at scrape time or at the OTLP export interval. The only thing done per batch
is one histogram record of the decision time (``kvbroker_batch_seconds``) and, when traces
are on, one span.

Series (Prometheus names; OTLP carries the same instrument names):

- ``kvbroker_events_total{kind,policy}``: events applied, by kind.
- ``kvbroker_directives_total{kind,policy,arm}``: directives decided;
  ``arm="primary"`` were sent, ``arm="shadow"`` are what a shadow policy would have sent.
- ``kvbroker_accesses_total{tier,result,policy,arm}``: block accesses by
  the tier that served them (``dropped``: recomputed); ``result`` is ``hit`` for the top
  tier, else ``miss``. ``arm`` is ``primary`` or ``shadow`` (``policy`` names the shadow).
- ``kvbroker_decode_critical_accesses_total`` / ``..._misses_total{policy,arm}``.
- ``kvbroker_batches_total``, ``kvbroker_rejected_events_total{policy}``.
- ``kvbroker_batch_seconds{policy}``: histogram of the time to decide a
  batch (validate, apply to the primary and the shadows, queue the journal record).
- ``kvbroker_tier_bytes{tier}``, ``kvbroker_tier_blocks{tier}``,
  ``kvbroker_tier_capacity_bytes{tier}``, ``kvbroker_tier_pinned_bytes{tier}``: occupancy now.
- ``kvbroker_journal_pending`` (records accepted, not yet written),
  ``kvbroker_journal_written_total``, ``kvbroker_journal_errors_total``.
- ``kvbroker_journal_spool_bytes``, ``kvbroker_journal_spool_records`` (the local spool of
  a Redis journal during an outage: bytes on disk, records not yet in Redis) and
  ``kvbroker_journal_dropped_total`` (records dropped with the spool full,
  ``journal.spool_full = "drop"``).
- ``kvbroker_config_generation{policy}``, ``kvbroker_config_reloads_total``,
  ``kvbroker_streams`` (open client streams).

Attribution to policy: counters are folded from each core (primary and shadows) into
cumulative totals per (arm, policy) whenever a reader collects, just before a reload (so
what ran under the old policy stays with it) and before the first batch after any other
change of policy, generation or shadows. No series ever goes down, and a new label set
starts at 0. The config generation is no label (it was one, ``config_generation``, until
2026-12): every reload started a new time series of every counter, even one that changed
nothing; the generation in force is the gauge ``kvbroker_config_generation``, and a reload
that keeps the policy keeps adding to the same series.

Traces (``telemetry.traces``, exported over OTLP): one span ``kvbroker.batch`` per batch with
``kvbroker.batch_seq``, ``kvbroker.client_id``, ``kvbroker.events``, ``kvbroker.directives``,
``kvbroker.rejections``, ``kvbroker.duplicate``, ``kvbroker.policy`` and
``kvbroker.config_generation``, sampled at ``telemetry.traces_sample_ratio``.

OTLP exporters are an optional dependency (the ``otlp`` extra: ``.venv/bin/pip install -e '.[otlp]'``); without them
a config that sets ``telemetry.otlp_endpoint`` is refused at start with that instruction.
OTLP headers (credentials) are taken from the standard environment variables
(``OTEL_EXPORTER_OTLP_HEADERS``), never from the config file, so they are never logged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from broker.config.errors import ConfigError
from broker.config.telemetry import TelemetryConfig, validate_telemetry
from broker.extras import pip_install

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    import grpc
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer

    from broker.model.wire import BatchReader
    from broker.service.broker_service import Answer, BrokerService

log = logging.getLogger("kvbroker.telemetry")

PRIMARY_ARM = "primary"
DROPPED_TIER = "dropped"
# Decision time of one batch: tens of microseconds for a few events, up to tens of
# milliseconds for thousands of events with evictions.
BATCH_SECONDS_BUCKETS = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)


# ---- counters folded per (arm, policy, generation) ---------------------------------------------

# A flat view of one core's counters: (family, label) -> value.
_Key = tuple[str, str]
# Families counted for the arms that drive clients only: a shadow sees the same events and
# batches as the primary (split arms see disjoint ones, so each counts its own).
PRIMARY_ONLY = frozenset({"events", "batches", "rejected_events"})
DRIVING_ROLES = frozenset({PRIMARY_ARM, "split"})


def _snapshot(stats: Any, tier_names: tuple[str, ...]) -> dict[_Key, int]:
    out: dict[_Key, int] = {}
    for kind, n in stats.events.items():
        out["events", kind] = n
    for kind, n in stats.directives.items():
        out["directives", kind] = n
    for i, n in enumerate(stats.accesses_by_tier):
        out["accesses", tier_names[i] if i < len(tier_names) else DROPPED_TIER] = n
    out["dc_accesses", ""] = stats.dc_accesses
    out["dc_misses", ""] = stats.dc_misses
    out["batches", ""] = stats.batches
    out["rejected_events", ""] = stats.rejected_events
    return out


@dataclasses.dataclass
class _Arm:
    """One core being watched: the primary or a shadow, under the labels now in force."""

    role: str  # "primary" or "shadow"
    stats: Any
    policy: str
    generation: int
    tier_names: tuple[str, ...]
    baseline: dict[_Key, int]


class CounterFold:
    """Cumulative totals per (arm, policy, family, label), folded from CoreStats.

    ``fold`` credits what each watched core's counters gained since the last fold to the
    labels they were gained under, then watches the service's cores as they are now (the
    same ones, relabelled after a reload, or new ones). Around a reload (``before_reload`` /
    ``after_reload``) the counters are credited to the old labels first, and what the reload
    itself does (the new config settling: evictions to fit) counts for the new ones.
    Called from reader threads and the event loop: locked.
    """

    def __init__(self, service: BrokerService) -> None:
        self.service = service
        self._lock = threading.Lock()
        self.totals: dict[tuple[str, str, _Key], int] = {}
        self.arms: dict[str, _Arm] = {}
        self._shadows: object = None
        self._sync(keep_baseline=False)

    @property
    def primary(self) -> _Arm:
        """The primary arm, or in a split the first arm (the arms share one generation)."""
        return next(iter(self.arms.values()))

    @property
    def policy(self) -> str:
        return self.primary.policy

    @property
    def generation(self) -> int:
        return self.primary.generation

    @property
    def top_tier(self) -> str:
        names = self.primary.tier_names
        return names[0] if names else ""

    def _cores(self) -> dict[str, tuple[str, Any]]:
        arm_cores = getattr(self.service, "arm_cores", None)
        if arm_cores is not None:
            return dict(arm_cores())
        cores = {PRIMARY_ARM: (PRIMARY_ARM, self.service.core)}
        for name, core in getattr(self.service, "shadows", {}).items():
            cores[f"shadow:{name}"] = ("shadow", core)
        return cores

    def _sync(self, keep_baseline: bool) -> None:
        self._shadows = getattr(self.service, "shadows", None)
        arms: dict[str, _Arm] = {}
        for key, (role, core) in self._cores().items():
            names = tuple(t.name for t in core.tiers)
            old = self.arms.get(key)
            kept = keep_baseline and old is not None and old.stats is core.stats
            current = _snapshot(core.stats, names)
            if kept and old is not None:
                baseline = old.baseline
            elif old is None and role == "shadow" and self.arms:
                # A shadow a reload added: its counters start at its creation (fresh stats),
                # and it joins once its copy, taken off the event loop, has caught up with the
                # batches served meanwhile (broker.service.shadow_builds): what it counted
                # catching up is its own, as GetStats reports it.
                baseline = {}
            else:
                baseline = current
            arm = _Arm(role, core.stats, str(core.policy_name), int(core.generation), names, baseline)
            arms[key] = arm
            # Every series of new labels exists from the start, at 0, so rate() and
            # increase() see the first event (Prometheus practice: initialize label sets).
            for family_key in current:
                if role in DRIVING_ROLES or family_key[0] not in PRIMARY_ONLY:
                    self.totals.setdefault((role, arm.policy, family_key), 0)
        self.arms = arms

    def _credit(self) -> None:
        for arm in self.arms.values():
            now = _snapshot(arm.stats, arm.tier_names)
            labels = (arm.role, arm.policy)
            for key, value in now.items():
                before = arm.baseline.get(key, 0)
                gained = value - before if value >= before else value  # a reset counts from 0
                if gained and (arm.role in DRIVING_ROLES or key[0] not in PRIMARY_ONLY):
                    total_key = (*labels, key)
                    self.totals[total_key] = self.totals.get(total_key, 0) + gained
            arm.baseline = now

    def changed(self) -> bool:
        """Whether the service's cores are no longer the ones watched (cheap, per batch)."""
        cores = self._cores()
        if cores.keys() != self.arms.keys() or getattr(self.service, "shadows", None) is not self._shadows:
            return True
        return any(
            core.stats is not arm.stats or core.generation != arm.generation or core.policy_name != arm.policy
            for (_, core), arm in zip(cores.values(), self.arms.values(), strict=True)
        )

    def fold(self) -> None:
        with self._lock:
            self._credit()
            if self.changed():
                self._sync(keep_baseline=False)

    def before_reload(self) -> None:
        with self._lock:
            self._credit()

    def after_reload(self) -> None:
        with self._lock:
            self._sync(keep_baseline=True)

    def series(self, family: str) -> list[tuple[str, str, str, int]]:
        """(arm role, policy, label, total) of one family, every label set seen."""
        self.fold()
        with self._lock:
            return [(r, p, key[1], n) for (r, p, key), n in self.totals.items() if key[0] == family]


# ---- the installed telemetry -------------------------------------------------------------------


class Telemetry:
    """What ``install`` started; ``stop`` undoes it (and flushes OTLP)."""

    def __init__(
        self,
        service: BrokerService,
        config: TelemetryConfig,
        meter_provider: MeterProvider,
        tracer_provider: TracerProvider | None,
        http: tuple[WSGIServer, threading.Thread] | None,
        hooks: dict[str, Callable[..., Any]],
    ) -> None:
        self.service = service
        self.config = config
        self.meter_provider = meter_provider
        self.tracer_provider = tracer_provider
        self._http = http
        # Service methods wrapped as instance attributes (undone by stop).
        self._hooks = hooks
        self._stopped = False
        # The port /metrics is served on (None when Prometheus is off).
        self.metrics_port: int | None = http[0].server_address[1] if http is not None else None

    @property
    def metrics_url(self) -> str | None:
        if self.metrics_port is None:
            return None
        host = self.config.prometheus_host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.metrics_port}/metrics"

    async def stop(self) -> None:
        """Unhook the batch path, stop /metrics, flush and shut down the OTel providers."""
        if self._stopped:
            return
        self._stopped = True
        for name, hook in self._hooks.items():
            if self.service.__dict__.get(name) is hook:
                delattr(self.service, name)
        self._hooks = {}
        await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._http = None
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def _resource(config: TelemetryConfig, broker_id: str) -> Resource:
    from importlib.metadata import PackageNotFoundError, version

    from opentelemetry.sdk.resources import Resource

    try:
        ver = version("kvbroker")
    except PackageNotFoundError:
        ver = "unknown"
    return Resource.create({"service.name": config.service_name, "service.instance.id": broker_id, "service.version": ver})


def _otlp_exporters(config: TelemetryConfig) -> tuple[Any, Any]:
    """(metric exporter class, span exporter class) for the configured protocol."""
    import importlib

    flavour = "grpc" if config.otlp_protocol == "grpc" else "http"
    package = f"opentelemetry-exporter-otlp-proto-{flavour}"
    base = f"opentelemetry.exporter.otlp.proto.{flavour}"
    try:
        metric_module = importlib.import_module(f"{base}.metric_exporter")
        span_module = importlib.import_module(f"{base}.trace_exporter")
    except ImportError as exc:
        raise ConfigError(
            f"telemetry.otlp_endpoint: OTLP export ({config.otlp_protocol}) needs the package {package}; "
            f"install it ({pip_install(package)}) or remove telemetry.otlp_endpoint ({exc})"
        ) from exc
    return metric_module.OTLPMetricExporter, span_module.OTLPSpanExporter


def _otlp_url(config: TelemetryConfig, signal: str) -> str:
    """The endpoint as the exporter wants it: gRPC takes the base, HTTP the full signal path."""
    endpoint = config.otlp_endpoint
    if config.otlp_protocol == "grpc" or urllib.parse.urlsplit(endpoint).path not in ("", "/"):
        return endpoint
    return endpoint.rstrip("/") + f"/v1/{signal}"


def _register_instruments(meter_provider: MeterProvider, service: BrokerService, fold: CounterFold) -> Any:
    """Create every instrument; returns the batch histogram (the one per-batch record)."""
    from opentelemetry.metrics import Observation

    meter = meter_provider.get_meter("kvbroker")

    def family(name: str, *, tier: bool = False, arm: bool = False) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            out = []
            top = fold.top_tier
            for role, policy, label, total in fold.series(name):
                attrs: dict[str, str] = {"policy": policy}
                if tier:
                    attrs["tier"] = label
                    attrs["result"] = "hit" if label == top else "miss"
                elif label:
                    attrs["kind"] = label
                if arm:
                    attrs["arm"] = role
                out.append(Observation(total, attrs))
            return out

        return observe

    meter.create_observable_counter("kvbroker_events_total", [family("events")], description="Events applied, by kind")
    meter.create_observable_counter(
        "kvbroker_directives_total",
        [family("directives", arm=True)],
        description="Directives decided, by kind (arm=primary: sent; arm=shadow: what a shadow policy would have sent)",
    )
    meter.create_observable_counter(
        "kvbroker_accesses_total",
        [family("accesses", tier=True, arm=True)],
        description="Block accesses by the tier that served them (dropped: recomputed); result=hit for the top tier",
    )
    meter.create_observable_counter(
        "kvbroker_decode_critical_accesses_total", [family("dc_accesses", arm=True)], description="Accesses to decode-critical blocks"
    )
    meter.create_observable_counter(
        "kvbroker_decode_critical_misses_total",
        [family("dc_misses", arm=True)],
        description="Decode-critical accesses not served from the top tier",
    )
    meter.create_observable_counter("kvbroker_batches_total", [family("batches")], description="Batches applied")
    meter.create_observable_counter("kvbroker_rejected_events_total", [family("rejected_events")], description="Events rejected")

    def tier_gauge(column: int) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            usage = service.tier_usage() if hasattr(service, "tier_usage") else service.core.tier_usage()
            return [Observation(int(row[column]), {"tier": row[0]}) for row in usage]

        return observe

    meter.create_observable_gauge("kvbroker_tier_blocks", [tier_gauge(1)], description="Blocks resident per tier")
    meter.create_observable_gauge("kvbroker_tier_bytes", [tier_gauge(2)], unit="By", description="Bytes resident per tier")
    meter.create_observable_gauge("kvbroker_tier_capacity_bytes", [tier_gauge(3)], unit="By", description="Capacity per tier")
    meter.create_observable_gauge("kvbroker_tier_pinned_bytes", [tier_gauge(4)], unit="By", description="Pinned bytes per tier")

    def scalar(
        read: Callable[[], int], labels: Callable[[], dict[str, str]] | None = None
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(read(), labels() if labels is not None else None)]

        return observe

    meter.create_observable_gauge(
        "kvbroker_journal_pending", [scalar(lambda: service.journal.pending)], description="Journal records accepted, not yet written"
    )
    meter.create_observable_counter(
        "kvbroker_journal_written_total", [scalar(lambda: service.journal.written)], description="Journal records written"
    )
    meter.create_observable_counter(
        "kvbroker_journal_errors_total", [scalar(lambda: service.journal.errors)], description="Journal write attempts that failed"
    )
    meter.create_observable_gauge(
        "kvbroker_journal_spool_bytes",
        [scalar(lambda: getattr(service.journal, "spool_bytes", 0))],
        unit="By",
        description="Bytes of the local journal spool (Redis unreachable or draining)",
    )
    meter.create_observable_gauge(
        "kvbroker_journal_spool_records",
        [scalar(lambda: getattr(service.journal, "spool_records", 0))],
        description="Spooled journal records not yet in Redis",
    )
    meter.create_observable_counter(
        "kvbroker_journal_dropped_total",
        [scalar(lambda: getattr(service.journal, "dropped", 0))],
        description='Journal records dropped because Redis was unreachable and the spool full (journal.spool_full = "drop")',
    )
    meter.create_observable_gauge(
        "kvbroker_config_generation",
        [scalar(lambda: service.core.generation, lambda: {"policy": getattr(service, "policy_name", service.core.policy_name)})],
        description="Config generation in force",
    )
    meter.create_observable_gauge("kvbroker_streams", [scalar(lambda: service.streams)], description="Open client streams")
    meter.create_observable_counter(
        "kvbroker_config_reloads_total", [scalar(lambda: getattr(service, "reloads", 0))], description="Config reloads applied"
    )
    return meter.create_histogram(
        "kvbroker_batch_seconds",
        unit="s",
        description="Time to decide one batch: validate, apply, choose directives, queue the journal record",
        explicit_bucket_boundaries_advisory=BATCH_SECONDS_BUCKETS,
    )


def _hook_batches(service: BrokerService, fold: CounterFold, histogram: Any, tracer: Tracer | None) -> Callable[..., Any]:
    """Wrap ``service.submit`` (an instance attribute, undone by ``Telemetry.stop``)."""
    submit = service.submit
    perf = time.perf_counter
    attrs: dict[str, str] = {}
    policy = ""

    def timed(batch: BatchReader, raw: bytes) -> tuple[Answer, int]:
        nonlocal attrs, policy
        if fold.changed():
            fold.fold()  # credit what the old policy/generation did before the new one acts
        if policy != fold.policy:
            policy = fold.policy
            attrs = {"policy": policy}
        t0 = perf()
        submitted = submit(batch, raw)
        histogram.record(perf() - t0, attrs)
        return submitted

    if tracer is None:
        return timed

    def traced(batch: BatchReader, raw: bytes) -> tuple[Answer, int]:
        with tracer.start_as_current_span("kvbroker.batch") as span:
            submitted = timed(batch, raw)
            result = submitted[0]
            if span.is_recording():
                span.set_attributes(
                    {
                        "kvbroker.client_id": batch.client_id,
                        "kvbroker.batch_seq": batch.batch_seq,
                        "kvbroker.events": batch.count,
                        "kvbroker.directives": result.directives,
                        "kvbroker.rejections": result.rejections,
                        "kvbroker.duplicate": result.duplicate,
                        "kvbroker.policy": fold.policy,
                        "kvbroker.config_generation": fold.generation,
                    }
                )
        return submitted

    return traced


def _hook_reload(service: BrokerService, fold: CounterFold) -> Callable[..., Any]:
    """Wrap ``service.reload``: counters so far belong to the config they ran under, and what
    the reload does (the new config settling) to the new one."""
    reload = service.reload

    def reloading(*args: Any, **kwargs: Any) -> Any:
        fold.before_reload()
        try:
            return reload(*args, **kwargs)
        finally:
            fold.after_reload()

    return reloading


def _telemetry_of(config: Any) -> TelemetryConfig:
    if isinstance(config, TelemetryConfig):
        return config
    telemetry = getattr(config, "telemetry", None)
    return telemetry if isinstance(telemetry, TelemetryConfig) else TelemetryConfig()


async def install(server: grpc.aio.Server | None, service: BrokerService, config: Any) -> Telemetry:
    """Start metrics (Prometheus and/or OTLP) and traces for ``service``.

    ``config``: the BrokerConfig (its ``telemetry`` field) or a TelemetryConfig. ``server`` is
    not used (telemetry adds no RPC); it is taken so every ``install`` looks the same.
    Raises ConfigError naming the key if OTLP is configured but its package is missing, and
    OSError if the /metrics port cannot be bound.
    """
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricReader

    tc = _telemetry_of(config)
    validate_telemetry(tc)
    broker_id = str(getattr(service.config, "broker_id", "kvbroker"))
    resource = _resource(tc, broker_id)
    readers: list[MetricReader] = []
    registry = None
    metric_exporter_cls = span_exporter_cls = None
    if tc.otlp_endpoint:
        metric_exporter_cls, span_exporter_cls = _otlp_exporters(tc)
    if tc.prometheus_port:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry

        # A registry of our own: several brokers in one process (tests, demo) never collide.
        registry = CollectorRegistry(auto_describe=True)
        readers.append(PrometheusMetricReader(scope_info_enabled=False, registry=registry))
    if metric_exporter_cls is not None and tc.otlp_metrics:
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers.append(PeriodicExportingMetricReader(metric_exporter_cls(endpoint=_otlp_url(tc, "metrics")), tc.export_interval_ms))
    meter_provider = MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False)
    fold = CounterFold(service)
    histogram = _register_instruments(meter_provider, service, fold)

    tracer_provider = None
    tracer = None
    if tc.traces and span_exporter_cls is not None:
        tracer_provider = _tracer_provider(tc, resource, span_exporter_cls(endpoint=_otlp_url(tc, "traces")))
        tracer = tracer_provider.get_tracer("kvbroker")

    http = None
    if registry is not None:
        from prometheus_client import start_http_server

        try:
            http = start_http_server(tc.prometheus_port, addr=tc.prometheus_host, registry=registry)
        except OSError as exc:
            meter_provider.shutdown()
            if tracer_provider is not None:
                tracer_provider.shutdown()
            raise OSError(f"telemetry: cannot serve /metrics on {tc.prometheus_host}:{tc.prometheus_port}: {exc.strerror or exc}") from exc

    hooks: dict[str, Callable[..., Any]] = {}
    if readers or tracer is not None:  # with nothing to export to, the batch path stays bare
        hooks["submit"] = _hook_batches(service, fold, histogram, tracer)
        if callable(getattr(service, "reload", None)):
            hooks["reload"] = _hook_reload(service, fold)
        for name, hook in hooks.items():
            setattr(service, name, hook)
    handle = Telemetry(service, tc, meter_provider, tracer_provider, http, hooks)
    log.info(
        "telemetry: metrics %s, otlp %s, traces %s",
        handle.metrics_url or "off",
        f"{tc.otlp_endpoint} ({tc.otlp_protocol}{'' if tc.otlp_metrics else ', traces only'})" if tc.otlp_endpoint else "off",
        f"on (sample ratio {tc.traces_sample_ratio})" if tracer is not None else "off",
        extra={"metrics_url": handle.metrics_url, "otlp_endpoint": tc.otlp_endpoint or None, "traces": tracer is not None},
    )
    return handle


def _tracer_provider(config: TelemetryConfig, resource: Resource, exporter: SpanExporter) -> TracerProvider:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(config.traces_sample_ratio)), resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider
