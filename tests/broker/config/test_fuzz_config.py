"""Fuzzing config files: only ConfigError, naming the key, ever comes out of parsing.

Documents are made of the known tables and keys with any TOML value (wrong types, negative
and huge sizes, NaN and infinities, dates, arrays, inline tables), unknown keys and tables,
and malformed TOML text (a valid document cut, with bytes flipped or inserted). Whatever is
accepted must be usable: the core builds from it, and ``config_to_toml`` (GetConfig's answer)
reads back to the same config. Files that are not UTF-8 are refused by ``load_config`` with
ConfigError too.

Examples per test: ``KVBROKER_FUZZ_EXAMPLES`` (default 100); a long run sets thousands.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import tempfile
from collections.abc import Iterator
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from broker.config import ConfigError, config_to_toml, load_config, parse_config
from broker.model.core import Core
from policies import registry

FUZZ = settings(
    max_examples=int(os.environ.get("KVBROKER_FUZZ_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Every message starts with the key it is about (or says the TOML itself is malformed).
TABLES = ("broker", "tiers", "policy", "cost", "prefetch", "journal", "telemetry", "health", "security", "limits")
NAMED = re.compile(
    rf"^(malformed TOML: |unknown key\(s\) |cannot read config |({'|'.join(TABLES)})(\[\d+\])?[.:\[ ]"
    r"|[^:]+: -?[0-9]+ is out of TOML's 64-bit integer range)"
)

sizes = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1023, 1024, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64]),
    st.sampled_from(["16GiB", "1.5MiB", "-1KB", "12 PB", "1" + "0" * 400, "0.0000001GiB", "9" * 30 + "TiB", "GiB", ""]),
)
numbers = st.one_of(
    st.integers(-(2**64), 2**64),
    st.sampled_from([0, -1, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1.0, 1.5, 1e-320]),
)
scalars = st.one_of(
    st.booleans(),
    numbers,
    st.text(max_size=10),
    st.sampled_from(["lru", "priority_lru", "belady", "hbm", "journal", "memory", "grpc", "fp8", "none", "127.0.0.1:0"]),
    st.datetimes(min_value=datetime.datetime(1, 1, 1), max_value=datetime.datetime(9999, 1, 1)),
    st.dates(),
)
values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=6
)

# What each key usually takes (the value drawn is then replaced by anything now and then).
KEYS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "broker": {"id": st.text(max_size=8), "listen": st.sampled_from(["127.0.0.1:0", "", "[::1]:1", "x"])},
    "policy": {
        "name": st.sampled_from([*registry.names(), "nope", ""]),
        "params": st.dictionaries(st.sampled_from(["k", "alpha", "window", "x"]), numbers, max_size=2),
        "shadows": st.lists(st.sampled_from([*registry.names(), "", "nope"]), max_size=3),
        "split": st.dictionaries(st.sampled_from(["lru", "arc", "fifo", "belady", "nope"]), numbers, max_size=3),
    },
    "cost": {"recompute_us": numbers, "quant": st.sampled_from(["fp16", "fp8", "int4", "int2", "x"])},
    "prefetch": {"margin_us": numbers},
    "journal": {
        "url": st.sampled_from(["none", "file://x.journal", "redis://127.0.0.1:6379/0", "bogus://"]),
        "stream": st.text(max_size=8),
        "maxlen": numbers,
        "directives": st.booleans(),
        "fsync": st.booleans(),
        "max_group": numbers,
        "recover": st.booleans(),
        "ack_after": st.sampled_from(["journal", "memory", "x"]),
    },
    "telemetry": {
        "prometheus_port": numbers,
        "prometheus_host": st.sampled_from(["127.0.0.1", ""]),
        "otlp_endpoint": st.sampled_from(["", "http://h:4317", "ftp://x", "http://u:p@h:1"]),
        "export_interval_ms": numbers,
        "traces_sample_ratio": numbers,
        "log_format": st.sampled_from(["text", "json", "xml"]),
    },
    "health": {"poll_ms": numbers, "reflection": st.booleans()},
    "security": {"tls_cert": st.sampled_from(["", "/nonexistent.pem"]), "tokens_env": st.sampled_from(["", "KVBROKER_FUZZ_NO_SUCH_VAR"])},
    "limits": {
        "max_message_bytes": sizes,
        "max_events_per_batch": numbers,
        "max_streams_per_client": numbers,
        "max_blocks_per_tenant": numbers,
    },
}
TIER_KEYS: dict[str, st.SearchStrategy[Any]] = {
    "name": st.sampled_from(["hbm", "dram", "nvme", ""]),
    "capacity": sizes,
    "read_latency_us": numbers,
    "bandwidth_gb_per_s": numbers,
    "high_watermark": numbers,
    "low_watermark": numbers,
    "channels": numbers,
}


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (datetime.datetime, datetime.date)):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


@st.composite
def table(draw: st.DrawFn, keys: dict[str, st.SearchStrategy[Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(sorted(keys)), unique=True, max_size=len(keys))):
        out[key] = draw(values) if draw(st.integers(0, 5)) == 5 else draw(keys[key])
    if draw(st.integers(0, 9)) == 9:
        out[draw(st.text(min_size=1, max_size=6))] = draw(values)  # an unknown key
    return out


@st.composite
def documents(draw: st.DrawFn) -> str:
    lines: list[str] = []
    for name in draw(st.lists(st.sampled_from(sorted(KEYS)), unique=True, max_size=4)):
        lines.append(f"[{name}]")
        lines += [f"{json.dumps(k)} = {toml_value(v)}" for k, v in draw(table(KEYS[name])).items()]
    for _ in range(draw(st.integers(0, 3))):
        lines.append("[[tiers]]")
        lines += [f"{json.dumps(k)} = {toml_value(v)}" for k, v in draw(table(TIER_KEYS)).items()]
    if draw(st.integers(0, 9)) == 9:
        lines.append(f"{json.dumps(draw(st.text(min_size=1, max_size=6)))} = {toml_value(draw(values))}")
    text = "\n".join(lines) + "\n"
    if draw(st.integers(0, 5)) == 5:  # malformed text
        data = bytearray(text.encode())
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(data)))
            op = draw(st.sampled_from(["cut", "insert", "flip"]))
            if op == "cut":
                del data[i:]
            elif op == "insert":
                data[i:i] = draw(st.sampled_from([b"[", b"]", b"=", b'"', b"\n", b"[[", b"{", b"\x00", b"#"]))
            elif i < len(data):
                data[i] ^= 1 << draw(st.integers(0, 6))
        text = data.decode("utf-8", "replace")
    return text


def flat(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from flat(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from flat(v, f"{prefix}[{i}]")
    else:
        yield prefix, obj


def check_parse(text: str) -> None:
    try:
        config = parse_config(text)
    except ConfigError as exc:  # anything else fails the test
        assert NAMED.match(str(exc)), f"the message names no key: {exc}"
        return
    Core(config.core)  # an accepted config is usable
    # Its numbers fit the 64-bit fields that report them (GetStats, GetConfig, the journal).
    for key, value in flat(dataclasses.asdict(config)):
        if isinstance(value, int):
            assert -(2**63) <= value < 2**63, f"{key} = {value} accepted"
        if isinstance(value, float):
            assert math.isfinite(value), f"{key} = {value} accepted"
    again = parse_config(config_to_toml(config))
    assert again == config, (config_to_toml(config), config)


@FUZZ
@given(text=documents())
@example(text='[[tiers]]\nname = "hbm"\ncapacity = "1' + "0" * 400 + '"\n')  # a size past float range
@example(text='[[tiers]]\nname = "hbm"\ncapacity = 100000000000000000000000000000000000000\n')
@example(text='[[tiers]]\nname = "hbm"\ncapacity = 1000\nread_latency_us = nan\n')
@example(text='[[tiers]]\nname = "hbm"\ncapacity = 1000\nbandwidth_gb_per_s = inf\n')
@example(text='[[tiers]]\nname = "hbm"\ncapacity = 1000\nchannels = 1000000000000000000000\n')
@example(text="[cost]\nrecompute_us = 100000000000000000000000000\n")
@example(text="[prefetch]\nmargin_us = 100000000000000000000000000\n")
def test_config_documents_raise_only_config_errors_naming_the_key(text: str) -> None:
    check_parse(text)


@FUZZ
@given(data=st.binary(max_size=200))
@example(data=b'[broker]\nid = "\xff"\n')
def test_config_files_that_are_not_utf8_or_toml_are_refused_clearly(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "broker.toml")
        with open(path, "wb") as f:
            f.write(data)
        try:
            load_config(path)
        except ConfigError as exc:
            assert NAMED.match(str(exc)), f"the message names no key: {exc}"
