"""The ``[telemetry]`` table (broker.service.telemetry exports what it configures)."""

from __future__ import annotations

import dataclasses
import json
import urllib.parse
from typing import Any

from broker.config.errors import ConfigError
from broker.logs import LOG_FORMATS, redact_text

OTLP_PROTOCOLS = ("grpc", "http/protobuf")


@dataclasses.dataclass(frozen=True)
class TelemetryConfig:
    """The ``[telemetry]`` table; every key optional."""

    # /metrics for Prometheus: bind address and port (0 = no Prometheus endpoint).
    prometheus_host: str = "127.0.0.1"
    prometheus_port: int = 0
    # OTLP collector, e.g. "http://otel-collector:4317" (grpc) or ":4318" (http); "" = off.
    otlp_endpoint: str = ""
    otlp_protocol: str = "grpc"
    # Also push metrics over OTLP (off when Prometheus scrapes the broker directly, to avoid
    # the same series arriving twice).
    otlp_metrics: bool = True
    # OTLP metrics push interval.
    export_interval_ms: int = 15_000
    # A span per batch, exported over OTLP (needs otlp_endpoint).
    traces: bool = False
    traces_sample_ratio: float = 1.0
    # OpenTelemetry resource service.name (service.instance.id is broker.id).
    service_name: str = "kvbroker"
    # Log lines: "text" or "json" (one object per line); `serve --log-format` overrides.
    log_format: str = "text"

    def toml_lines(self) -> list[str]:
        """The ``[telemetry]`` table as TOML that ``telemetry_config_from_dict`` reads back."""
        return ["[telemetry]", *(f"{f.name} = {_toml_scalar(getattr(self, f.name))}" for f in dataclasses.fields(self))]


def _toml_scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    return repr(value)


def _take(table: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    """Pop ``key``, checking its type; the error names ``telemetry.<key>``."""
    if key not in table:
        return default
    value = table.pop(key)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) is not (kind is bool) or not isinstance(value, kind):
        raise ConfigError(f"telemetry.{key}: expected {kind.__name__}, got {value!r}")
    return value


def telemetry_config_from_dict(table: dict[str, Any]) -> TelemetryConfig:
    """Validate the ``[telemetry]`` table of a parsed TOML document; unknown keys are errors."""
    if not isinstance(table, dict):
        raise ConfigError(f"telemetry: expected a table, got {table!r}")
    t = dict(table)
    d = TelemetryConfig()
    config = TelemetryConfig(
        prometheus_host=_take(t, "prometheus_host", str, d.prometheus_host),
        prometheus_port=_take(t, "prometheus_port", int, d.prometheus_port),
        otlp_endpoint=_take(t, "otlp_endpoint", str, d.otlp_endpoint),
        otlp_protocol=_take(t, "otlp_protocol", str, d.otlp_protocol),
        otlp_metrics=_take(t, "otlp_metrics", bool, d.otlp_metrics),
        export_interval_ms=_take(t, "export_interval_ms", int, d.export_interval_ms),
        traces=_take(t, "traces", bool, d.traces),
        traces_sample_ratio=_take(t, "traces_sample_ratio", float, d.traces_sample_ratio),
        service_name=_take(t, "service_name", str, d.service_name),
        log_format=_take(t, "log_format", str, d.log_format),
    )
    if t:
        raise ConfigError(f"unknown key(s) {', '.join('telemetry.' + k for k in sorted(t))}")
    validate_telemetry(config)
    return config


def validate_telemetry(config: TelemetryConfig) -> None:
    """Check the values (also for configs built in code); errors name the key."""
    if not config.prometheus_host:
        raise ConfigError("telemetry.prometheus_host: must be non-empty (an address such as 127.0.0.1 or 0.0.0.0)")
    if not 0 <= config.prometheus_port <= 65535:
        raise ConfigError(f"telemetry.prometheus_port: must be in 0..65535 (0 = off), got {config.prometheus_port}")
    if config.otlp_endpoint:
        parsed = urllib.parse.urlsplit(config.otlp_endpoint)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ConfigError(
                f"telemetry.otlp_endpoint: expected http://HOST:PORT or https://HOST:PORT, got {redact_text(config.otlp_endpoint)!r}"
            )
        if parsed.username or parsed.password:
            raise ConfigError("telemetry.otlp_endpoint: must not carry credentials; set OTEL_EXPORTER_OTLP_HEADERS in the environment")
    if config.otlp_protocol not in OTLP_PROTOCOLS:
        raise ConfigError(f"telemetry.otlp_protocol: must be one of {', '.join(OTLP_PROTOCOLS)}, got {config.otlp_protocol!r}")
    if config.export_interval_ms <= 0:
        raise ConfigError(f"telemetry.export_interval_ms: must be > 0, got {config.export_interval_ms}")
    if config.traces and not config.otlp_endpoint:
        raise ConfigError("telemetry.traces: spans are exported over OTLP; set telemetry.otlp_endpoint too")
    if not 0.0 <= config.traces_sample_ratio <= 1.0:
        raise ConfigError(f"telemetry.traces_sample_ratio: must be in [0, 1], got {config.traces_sample_ratio}")
    if not config.service_name:
        raise ConfigError("telemetry.service_name: must be non-empty")
    if config.log_format not in LOG_FORMATS:
        raise ConfigError(f"telemetry.log_format: must be one of {', '.join(LOG_FORMATS)}, got {config.log_format!r}")
