"""What the kvbroker CachePolicy's policies hit inside vLLM, where an operator can see it.

``Reporter(snapshot_fn, settings)`` reads ``snapshot_fn()`` (the policy's ``snapshot()``: a
dict with ``client_id``, ``pid``, ``time``, ``policy``, ``capacity`` and ``rows``, one per
policy run: the decider, its shadows, what-if sizes; each ``role``, ``policy``,
``capacity``, ``hits``, ``asked``, ``hit_ratio``, ``sample_rate``) and shows it three ways:

- an INFO line under ``vllm.kvbroker`` every ``kvbroker_report_s`` and one at exit;
- Prometheus metrics over HTTP when ``kvbroker_metrics_port`` is set, read from
  ``snapshot_fn`` at each scrape, on a registry of its own (vLLM's process has its own
  metrics on the global one, which must not see ours, nor ours theirs);
- a JSON status file, rewritten whole every ``kvbroker_status_s`` and at exit, that
  ``kvbroker vllm-status PATH`` reads.

Its timing runs on one daemon thread: vLLM's scheduler thread, which calls the policy,
does none of this work. The HTTP server runs on prometheus_client's own thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from vllm_integration.decisions_to_vllm.embedded import close_at_exit
from vllm_integration.decisions_to_vllm.settings import OffloadSettings, SettingsError

# Under vLLM's logger (this room runs inside vLLM): vLLM's logging configuration shows it.
log = logging.getLogger("vllm.kvbroker")

Snapshot = Mapping[str, Any]
LABELS: Final = ("role", "policy", "capacity", "sample_rate")
# The longest close() waits for the thread to end a write in progress (a hung disk must
# not hold vLLM's exit for long).
JOIN_S: Final = 2.0
# The snapshot's "counters" (Translator.counters) as Prometheus families: name, key, help,
# counter or gauge. Fallbacks (sidecar mode) are one family by reason, below.
COUNTERS: Final = (
    ("kvbroker_vllm_evictions_asked", "evictions_asked", "Evictions vLLM asked of the policy", "counter"),
    ("kvbroker_vllm_evictions_refused", "evictions_refused", "Evictions the policy refused (too few chunks evictable)", "counter"),
    ("kvbroker_vllm_chunks_evicted", "chunks_evicted", "Chunks the policy evicted from vLLM's CPU tier", "counter"),
    ("kvbroker_vllm_errors", "errors", "Batches or decisions that failed (logged)", "counter"),
    ("kvbroker_vllm_journal_written", "journal_written", "Journal records written", "counter"),
    ("kvbroker_vllm_journal_pending", "journal_pending", "Journal records recorded, not yet written (the journal's lag)", "gauge"),
    ("kvbroker_vllm_config_generation", "config_generation", "Config generation in force (a settings file switch adds one)", "gauge"),
)
FALLBACKS: Final = "kvbroker_vllm_fallbacks"


def rate_label(rate: float) -> str:
    """A sample rate as a short, stable label value (1.0 -> "1", 0.1 -> "0.1")."""
    return f"{float(rate):g}"


def describe_row(row: Mapping[str, Any]) -> str:
    """One row of the report line: role, policy, capacity, hits, asked, ratio (and the
    sample rate when it is sampled)."""
    sampled = f", sampled {rate_label(row['sample_rate'])}" if float(row.get("sample_rate", 1.0)) < 1.0 else ""
    return (
        f"{row['role']} {row['policy']} capacity {row['capacity']}: {row['hits']} hits / {row['asked']} asked, "
        f"hit ratio {float(row['hit_ratio']):.4f}{sampled}"
    )


def report_line(snapshot: Snapshot) -> str:
    rows = "; ".join(describe_row(row) for row in snapshot["rows"])
    return f"kvbroker report ({snapshot['client_id']}): {rows or 'no rows'}"


def write_atomically(path: str, data: bytes) -> None:
    """``data`` at ``path``, whole or not at all: a temp file in the same folder renamed over
    it, so a reader never sees half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


class SnapshotCollector:
    """Prometheus families read from ``snapshot_fn`` at scrape time (no copy kept)."""

    def __init__(self, snapshot_fn: Callable[[], Snapshot]) -> None:
        self._snapshot_fn = snapshot_fn
        self._failed = False

    def describe(self) -> Iterator[Any]:
        # Names only: the registry must not call snapshot_fn when the collector registers.
        yield from self._families()

    def collect(self) -> Iterator[Any]:
        try:
            snapshot = self._snapshot_fn()
            rows = [(tuple(self._labels(row)), int(row["hits"]), int(row["asked"]), float(row["hit_ratio"])) for row in snapshot["rows"]]
            counters = dict(snapshot.get("counters", {}))
        except Exception:
            # A scrape sees nothing rather than an HTTP 500 with a traceback on stderr; vLLM's
            # log says why, once.
            if not self._failed:
                log.exception("kvbroker metrics: the snapshot could not be read; the scrape gets no kvbroker figures")
            self._failed = True
            rows, counters = [], {}
        hits, lookups, ratio, *scalars, fallbacks = self._families()
        for labels, h, a, r in rows:
            hits.add_metric(labels, h)
            lookups.add_metric(labels, a)
            ratio.add_metric(labels, r)
        for family, (_, key, _, _) in zip(scalars, COUNTERS, strict=True):
            if key in counters:
                family.add_metric([], float(counters[key]))
        for reason, n in sorted(dict(counters.get("fallbacks", {})).items()):
            fallbacks.add_metric([str(reason)], float(n))
        yield from (hits, lookups, ratio, *scalars, fallbacks)

    @staticmethod
    def _labels(row: Mapping[str, Any]) -> list[str]:
        return [str(row["role"]), str(row["policy"]), str(int(row["capacity"])), rate_label(row.get("sample_rate", 1.0))]

    @staticmethod
    def _families() -> list[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
        return [
            CounterMetricFamily("kvbroker_vllm_hits", "Chunks a policy found in the CPU tier (sampled rows: of the sample)", labels=LABELS),
            CounterMetricFamily("kvbroker_vllm_lookups", "Chunks asked of a policy (sampled rows: of the sample)", labels=LABELS),
            GaugeMetricFamily("kvbroker_vllm_hit_ratio", "hits / lookups", labels=LABELS),
            *(kinds[kind](name, text, labels=[]) for name, _, text, kind in COUNTERS),
            CounterMetricFamily(FALLBACKS, "Evictions the local fallback decided in sidecar mode, by reason", labels=["reason"]),
        ]


class Reporter:
    """Logs, serves and writes ``snapshot_fn()`` as ``settings`` says (module docstring).

    Problems found at start (a metrics port that cannot be bound, a status file that cannot
    be written) raise SettingsError naming the key: vLLM's start stops with that line.
    Problems later (a disk that fills) are logged, once until it works again."""

    def __init__(self, snapshot_fn: Callable[[], Snapshot], settings: OffloadSettings) -> None:
        self._snapshot_fn = snapshot_fn
        self._report_s = settings.report_s
        self._status_s = settings.status_s
        self.status_file = settings.resolved_status_file() if settings.status_file else ""
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._status_failing = False
        self._report_failing = False
        self._server: Any = None
        # Where metrics are served (the bound port: with port 0, the one the system chose).
        self.metrics_port: int | None = None
        self.metrics_url = ""
        if settings.metrics_port is not None:
            self._serve(settings.metrics_host, settings.metrics_port, settings.rank)
        if self.status_file:
            try:
                self._write_status()
            except OSError as exc:
                self._shutdown_server()
                raise SettingsError(f"kvbroker_status_file: cannot write {self.status_file}: {exc.strerror or exc}") from None
        self._thread = threading.Thread(target=self._run, name="kvbroker-report", daemon=True)
        self._thread.start()
        close_at_exit(self.close)

    # ---- metrics --------------------------------------------------------------------------

    def _serve(self, host: str, port: int, rank: int) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        # Data-parallel rank r serves on port + r: one setting for every rank, no collision.
        chosen = port + rank if port else 0
        if chosen > 65535:
            raise SettingsError(f"kvbroker_metrics_port: {port} + rank {rank} is past 65535")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SnapshotCollector(self._snapshot_fn))
        try:
            self._server, _ = start_http_server(chosen, addr=host, registry=registry)
        except OSError as exc:
            raise SettingsError(f"kvbroker_metrics_port: cannot serve metrics on {host}:{chosen}: {exc.strerror or exc}") from None
        bound = self._server.server_address[1]
        self.metrics_port = int(bound)
        shown = f"[{host}]" if ":" in host else host
        self.metrics_url = f"http://{shown}:{bound}/metrics"
        log.info("kvbroker metrics: %s", self.metrics_url)

    def _shutdown_server(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    # ---- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        now = time.monotonic()
        next_report = now + self._report_s
        next_status = now + self._status_s if self.status_file else float("inf")
        while not self._stop.wait(max(0.0, min(next_report, next_status) - time.monotonic())):
            now = time.monotonic()
            if now >= next_report:
                self._report()
                # A late wake (a stopped process, a loaded machine) does not bunch lines up.
                next_report = max(next_report + self._report_s, now)
            if now >= next_status:
                self._status()
                next_status = max(next_status + self._status_s, now)

    def _report(self) -> None:
        try:
            log.info("%s", report_line(self._snapshot_fn()))
            self._report_failing = False
        except Exception:
            if not self._report_failing:
                log.exception("kvbroker report: the snapshot could not be read")
            self._report_failing = True

    def _status(self) -> None:
        try:
            self._write_status()
        except Exception as exc:
            if not self._status_failing:
                log.warning("kvbroker status file %s: not written (%s); tried again every %g s", self.status_file, exc, self._status_s)
            self._status_failing = True
        else:
            if self._status_failing:
                log.info("kvbroker status file %s: written again", self.status_file)
            self._status_failing = False

    def _write_status(self) -> None:
        snapshot = dict(self._snapshot_fn())
        if self.metrics_url:
            snapshot["metrics_url"] = self.metrics_url  # port 0: how to find the scrape address
        write_atomically(self.status_file, (json.dumps(snapshot, indent=1) + "\n").encode())

    # ---- the end --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the thread, log the last line, write the status file a last time and stop
        serving metrics (idempotent; run at exit)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(JOIN_S)
        # Here, not on the thread: after a fork (vLLM's engine core) the thread is gone.
        self._report()
        if self.status_file:
            self._status()
        self._shutdown_server()
