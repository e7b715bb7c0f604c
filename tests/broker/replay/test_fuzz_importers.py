"""Fuzzing the trace importers and the vLLM decoder: only the documented errors escape.

- JSONL importers (``mooncake``, ``kvds-events``, ``kvds-requests``): arbitrary lines, valid
  lines with a field set to any JSON value (wrong types, NaN, Infinity, huge and negative
  numbers, nesting), fields removed, lines cut short, invalid UTF-8 bytes. A bad trace raises
  TraceError naming this file, the line and a field, never anything else; with ``skip_bad``
  nothing is raised, the bad lines are counted, and the first one skipped is the error the
  strict import raised. What is imported is valid protobuf (its integers in range).
- vLLM (``vllm_integration.events_from_vllm.zmq_events``): ``decode_batch`` raises only DecodeError on any bytes (random,
  msgpack of anything, mutated valid payloads); whatever decodes translates into broker events
  without an error; a capture file of fuzzed records imports with TraceError only.

Examples per test: ``KVBROKER_FUZZ_EXAMPLES`` (default 100); a long run sets thousands.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import tempfile
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from broker.replay.traces import SkipCounter, TraceError, TraceOptions, read_trace
from tests.vllm_integration.events_from_vllm.test_zmq_events import payload, removed, stored, write_capture
from vllm_integration.events_from_vllm.to_intents import EngineTranslator, MappingOptions
from vllm_integration.events_from_vllm.zmq_events import DecodeError, decode_batch, ts_to_us

FUZZ = settings(
    max_examples=int(os.environ.get("KVBROKER_FUZZ_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
DATA = pathlib.Path(__file__).parent / "data"
# Batches read at most per import: a valid line may ask for 10^18 decode steps (it is lazy).
MAX_BATCHES = 50
U64 = 2**64 - 1

MOONCAKE_LINE = {"timestamp": 5, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2, 3]}
BASE_LINES: dict[str, list[dict[str, Any]]] = {
    "mooncake": [MOONCAKE_LINE, {**MOONCAKE_LINE, "timestamp": 9, "hash_ids": [1, 7]}],
    "kvds-events": [json.loads(line) for line in (DATA / "kvds_events.jsonl").read_text().splitlines() if line.strip()],
    "kvds-requests": [json.loads(line) for line in (DATA / "kvds_requests.jsonl").read_text().splitlines() if line.strip()],
}
FORMATS = sorted(BASE_LINES)

numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, U64, 2**64, 10**30, -(10**30)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 0.5, 1e-300, 1e19]),
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=8), st.sampled_from(["HBM", "DECODE", "ALLOCATED", "llama-3-8b"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=8,
)


def paths_of(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every key path into a JSON object (dict keys and list indexes)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield (*prefix, key)
            yield from paths_of(value, (*prefix, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield (*prefix, i)
            yield from paths_of(value, (*prefix, i))


@st.composite
def mutated_line(draw: st.DrawFn, fmt: str) -> bytes:
    """A valid line of ``fmt`` with a few fields set to anything or removed."""
    obj = json.loads(json.dumps(draw(st.sampled_from(BASE_LINES[fmt]))))
    for _ in range(draw(st.integers(1, 3))):
        paths = list(paths_of(obj))
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.integers(0, 3)) == 0 and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(json_values)
    text = json.dumps(obj, allow_nan=True).encode()
    if draw(st.integers(0, 9)) == 0:
        text = text[: draw(st.integers(0, len(text)))]
    return text


@st.composite
def trace_lines(draw: st.DrawFn, fmt: str) -> list[bytes]:
    def line(kind: int) -> bytes:
        if kind == 0:
            return json.dumps(draw(json_values), allow_nan=True).encode()
        if kind == 1:
            return draw(st.binary(max_size=40)).replace(b"\n", b" ")
        if kind == 2:
            return draw(mutated_line(fmt)) + draw(st.sampled_from([b"", b"\xff", b"\xc3\x28", b"\xed\xa0\x80"]))
        if kind == 3:
            return json.dumps(draw(st.sampled_from(BASE_LINES[fmt]))).encode()
        return draw(mutated_line(fmt))

    return [line(draw(st.integers(0, 6))) for _ in range(draw(st.integers(1, 6)))]


def import_all(path: str, fmt: str, skips: SkipCounter) -> int:
    """Read up to MAX_BATCHES batches; each must be valid protobuf. Returns the events read."""
    events = 0
    for n, batch in enumerate(read_trace(path, fmt, TraceOptions(batch_events=64), skips)):
        batch.SerializeToString()  # integers out of their field's range would have raised already
        events += len(batch.events)
        if n + 1 >= MAX_BATCHES:
            break
    return events


def check_error(error: TraceError, path: str, lines: int) -> None:
    assert error.path == path and 0 <= error.line <= lines and error.field and error.reason, error
    assert str(error).startswith(f"{path}:{error.line}: {error.field}: ")


def import_both_ways(fmt: str, data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"trace.{fmt}.jsonl")
        with open(path, "wb") as f:
            f.write(data)
        lines = data.count(b"\n") + 1
        strict: TraceError | None = None
        try:
            import_all(path, fmt, SkipCounter())
        except TraceError as exc:  # anything else fails the test
            check_error(exc, path, lines)
            strict = exc
        skips = SkipCounter(skip_bad=True)
        try:
            import_all(path, fmt, skips)
        except TraceError as exc:
            # Not a line's fault (the file as a whole): the same error either way.
            assert strict is not None and str(exc) == str(strict), (exc, strict)
            return
        if strict is None:
            assert skips.skipped == 0, skips.examples
        else:
            assert 1 <= skips.skipped <= lines and skips.examples[0] == str(strict), (skips, strict)


@FUZZ
@pytest.mark.parametrize("fmt", FORMATS)
@given(data=st.data())
@example(data=None)
def test_importers_raise_only_trace_errors_and_skip_bad_counts(fmt: str, data: Any) -> None:
    lines = (
        [b'{"timestamp": 1e300, "input_length": 1, "output_length": 1, "hash_ids": [1]}'] if data is None else data.draw(trace_lines(fmt))
    )
    import_both_ways(fmt, b"\n".join(lines) + b"\n")


@pytest.mark.parametrize(
    ("fmt", "line"),
    [
        ("mooncake", b'{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1]}\xff'),
        ("mooncake", b'{"timestamp": 9223372036854775807, "input_length": 1, "output_length": 1, "hash_ids": [1]}'),
        ("mooncake", b'{"timestamp": 1, "input_length": 1e300, "output_length": 1, "hash_ids": [1]}'),
        ("kvds-requests", b'{"request_id": "r", "arrival_ms": 1, "prompt_tokens": 1e30, "generated_tokens": 1}'),
        ("kvds-requests", b'{"request_id": "\xed\xa0\x80", "arrival_ms": 1, "prompt_tokens": 1, "generated_tokens": 1}'),
        ("kvds-requests", b'{"request_id": "\\ud800", "arrival_ms": 1, "prompt_tokens": 1, "generated_tokens": 1}'),
        ("kvds-requests", b'{"request_id": "r", "arrival_ms": 1, "prompt_tokens": 1, "generated_tokens": 1e15}'),
        ("kvds-events", b"[" * 100_000 + b"]" * 100_000),
    ],
)
def test_regressions_of_the_importer_fuzz(fmt: str, line: bytes) -> None:
    import_both_ways(fmt, line + b"\n" + json.dumps(BASE_LINES[fmt][0]).encode() + b"\n")


# ---- vLLM ------------------------------------------------------------------------------------

msgpack_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), U64),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
        st.binary(max_size=8),
        st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "CPU", "type", "block_size"]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-(2**63), U64)), inner, max_size=4)
    ),
    max_leaves=16,
)
big_ints = st.one_of(st.integers(-(2**63), U64), st.sampled_from([0, -1, 2**31, 2**32, U64]))
weird_events = st.one_of(
    # stored() lists block_size token ids: a huge block_size is written by hand.
    st.builds(
        lambda h, p, s, g, lid: ["BlockStored", h, p, [], s, lid, None, None, None, g],
        st.lists(big_ints, max_size=3),
        big_ints,
        big_ints,
        big_ints,
        big_ints,
    ),
    st.builds(
        lambda h, m: stored(h, medium=m),
        st.lists(st.binary(max_size=4), max_size=3),
        st.one_of(st.none(), st.text(max_size=4), st.just("CPU")),
    ),
    st.builds(lambda h, s: {"type": "BlockStored", "block_hashes": h, "block_size": s}, st.lists(big_ints, max_size=3), big_ints),
    st.builds(lambda h, g: removed(h, group_idx=g), st.lists(big_ints, max_size=3), big_ints),
    msgpack_values,
)
timestamps = st.one_of(st.floats(allow_nan=True, allow_infinity=True), big_ints, st.none(), st.text(max_size=3))


@st.composite
def vllm_payloads(draw: st.DrawFn) -> bytes:
    how = draw(st.integers(0, 3))
    if how == 0:
        return draw(st.binary(max_size=80))
    if how == 1:
        data: bytes = msgpack.packb(draw(msgpack_values), use_bin_type=True)
        return data
    events = draw(st.lists(weird_events, max_size=5))
    ts, rank = draw(timestamps), draw(st.one_of(st.none(), big_ints))
    body = draw(st.sampled_from([[ts, events], [ts, events, rank], {"ts": ts, "events": events, "data_parallel_rank": rank}]))
    raw: bytes = msgpack.packb(body, use_bin_type=True)
    if how == 3 and raw:
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([raw[i] ^ (1 << draw(st.integers(0, 7)))]) + raw[i + 1 :]
    return raw


TRANSLATOR_OPTIONS = MappingOptions(tier_map=(("GPU", "hbm"), ("CPU", "dram"), ("*", "nvme")))


@FUZZ
@given(raw=vllm_payloads(), fallback=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just(1.7e9)))
@example(raw=msgpack.packb([1.0, [["BlockStored", [1], None, [], 2**40]]]), fallback=1.0)  # block_size past uint32
@example(raw=msgpack.packb([math.inf, [stored([1])]]), fallback=1.0)
@example(raw=msgpack.packb([U64, [stored([1])]]), fallback=math.nan)
def test_vllm_decoder_raises_only_decode_errors_and_translates_what_it_decodes(raw: bytes, fallback: float) -> None:
    try:
        batch = decode_batch(raw)
    except DecodeError:
        return
    translator = EngineTranslator(TRANSLATOR_OPTIONS)
    ts_us = ts_to_us(batch.ts, fallback)
    assert 0 <= ts_us < 2**63
    for event in translator.translate(batch, ts_us):
        event.SerializeToString()


@FUZZ
@given(
    records=st.lists(
        st.tuples(big_ints, big_ints, st.one_of(st.floats(allow_nan=True, allow_infinity=True), big_ints), vllm_payloads()), max_size=5
    )
)
@example(records=[(0, 0, math.inf, payload([stored([1])]))])
def test_a_fuzzed_vllm_capture_imports_with_trace_errors_only(records: list[tuple[int, int, float, bytes]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "cap.vllm"
        write_capture(path, [])
        with open(path, "ab") as f:
            for record in records:
                f.write(msgpack.packb(list(record), use_bin_type=True))
        for skip_bad in (False, True):
            try:
                import_all(str(path), "vllm-events", SkipCounter(skip_bad))
            except TraceError as exc:
                check_error(exc, str(path), len(records) + 1)
