"""Coverage-guided fuzzing with atheris, run by hand (CI runs the hypothesis fuzzers only).

    .venv/bin/pip install atheris        # or: pip install -e '.[fuzz]'
    .venv/bin/python tests/fuzz/atheris_harness.py TARGET [libFuzzer options, e.g. -max_total_time=300 -runs=100000]

TARGET is one of:

- ``apply``: bytes as an IntentBatch, applied to a core (policy priority_lru, three small
  tiers), as the broker does after decoding; only a DecodeError (not protobuf) may escape,
  and the answer the broker sends (the native writer, broker/model/_answer.c, when built) must be
  the bytes protobuf writes.
- ``wire``: bytes as a serialized IntentBatch, read by the native reader (broker/model/_wire.c)
  and by the reference reader: the native one must refuse (Unsupported) what protobuf
  rejects, and read exactly what the reference reads when it accepts. Build the extension
  with AddressSanitizer for this one (README, Fuzzing) to catch memory errors as well.
- ``config``: bytes as a TOML config document; only ConfigError may escape.
- ``jsonl``: bytes as a JSONL trace for each importer (mooncake, kvds-events, kvds-requests);
  only TraceError may escape.
- ``vllm``: bytes as a vLLM KVEventBatch payload, decoded and translated; only DecodeError.

A crash leaves ``crash-*`` files (the input) in the working directory; rerun one with
``python tests/fuzz/atheris_harness.py TARGET crash-<hash>``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import atheris

with atheris.instrument_imports():
    from google.protobuf.message import DecodeError as ProtoDecodeError

    from broker.config import ConfigError, parse_config
    from broker.model import wire
    from broker.model.apply import apply_batch
    from broker.model.core import Core
    from broker.replay.traces import SkipCounter, TraceError, TraceOptions, read_trace
    from broker.service.broker_service import answer_bytes, outcome_to_pb
    from kvbroker.v1 import intent_pb2 as pb
    from vllm_integration.events_from_vllm.to_intents import EngineTranslator, MappingOptions
    from vllm_integration.events_from_vllm.zmq_events import DecodeError, decode_batch, ts_to_us

CONFIG = """
[policy]
name = "priority_lru"
[[tiers]]
name = "hbm"
capacity = 1000
[[tiers]]
name = "dram"
capacity = 3000
[[tiers]]
name = "nvme"
capacity = 20000
"""

_core: Core | None = None
_seq = 0


def fuzz_apply(data: bytes) -> None:
    global _core, _seq
    if _core is None or len(_core.blocks) > 10_000:
        _core = Core(parse_config(CONFIG).core)
    try:
        batch = pb.IntentBatch.FromString(data)
    except ProtoDecodeError:
        return
    _seq += 1
    batch.client_id, batch.batch_seq = "c", _seq
    outcome = apply_batch(_core, batch)
    # The answer as it leaves (the native writer when built) is the bytes protobuf writes.
    assert answer_bytes(batch, outcome, 1) == outcome_to_pb(batch, outcome, 1).SerializeToString()


# Stand-ins for the core's blocks: the readers only look them up.
_BLOCKS = {name: object() for name in ("a", "b", "c", "")}


def fuzz_wire(data: bytes) -> None:
    assert wire.native is not None, "the native reader is not built"
    try:
        reference = wire.ReferenceReader(pb.IntentBatch.FromString(data))
    except ProtoDecodeError:
        try:
            wire.native.BatchReader(data)
        except wire.native.Unsupported:
            return
        raise AssertionError("the native reader accepted bytes protobuf rejects") from None
    try:
        native = wire.native.BatchReader(data)
    except wire.native.Unsupported:
        return
    header = (native.client_id, native.batch_seq, native.tenant, native.count)
    assert header == (reference.client_id, reference.batch_seq, reference.tenant, reference.count)
    assert list(native.events(_BLOCKS)) == list(reference.events(_BLOCKS))
    assert list(native.events()) == list(reference.events())


def fuzz_config(data: bytes) -> None:
    with contextlib.suppress(ConfigError):
        parse_config(data.decode("utf-8", "replace"))


_tmp = tempfile.mkdtemp(prefix="kvbroker-atheris-")


def fuzz_jsonl(data: bytes) -> None:
    path = os.path.join(_tmp, "trace.jsonl")
    with open(path, "wb") as f:
        f.write(data)
    for fmt in ("mooncake", "kvds-events", "kvds-requests"):
        try:
            for n, batch in enumerate(read_trace(path, fmt, TraceOptions(batch_events=64), SkipCounter())):
                batch.SerializeToString()
                if n >= 20:
                    break
        except TraceError:
            pass


_translator_options = MappingOptions(tier_map=(("GPU", "hbm"), ("CPU", "dram"), ("*", "nvme")))


def fuzz_vllm(data: bytes) -> None:
    try:
        batch = decode_batch(data)
    except DecodeError:
        return
    for event in EngineTranslator(_translator_options).translate(batch, ts_to_us(batch.ts, 1.0)):
        event.SerializeToString()


TARGETS = {"apply": fuzz_apply, "wire": fuzz_wire, "config": fuzz_config, "jsonl": fuzz_jsonl, "vllm": fuzz_vllm}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(TARGETS)}}} [libFuzzer options]")
    target = TARGETS[sys.argv[1]]
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
