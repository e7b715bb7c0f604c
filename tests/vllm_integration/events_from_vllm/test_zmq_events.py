"""The vLLM KV-event decoder, block ids, the translator, the seq tracker and capture files.

The encoders below write vLLM's wire format as its msgspec structs do (array_like, tagged,
trailing defaults omitted; or the newer map encoding); the bridge tests publish with them.
"""

from __future__ import annotations

import hashlib
import pathlib
from typing import Any

import msgpack
import pytest

from broker.config import CoreConfig
from broker.replay.replay import replay
from broker.replay.traces import FORMATS, SkipCounter, TraceError, TraceOptions, read_trace
from clients import kvsize
from kvbroker.v1 import intent_pb2 as pb
from vllm_integration.events_from_vllm.to_intents import EngineTranslator, MappingOptions, parse_tier_map
from vllm_integration.events_from_vllm.zmq_events import (
    END_OF_REPLAY,
    STORED_FIELDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CaptureWriter,
    DecodeError,
    SeqTracker,
    block_id,
    decode_batch,
    decode_event,
    encode_seq,
    hash_key,
    read_capture,
    replay_request,
    split_live,
    split_replay,
)

STORED_DEFAULTS: list[tuple[str, Any]] = [(name, None) for name in STORED_FIELDS]
BLOCK_BYTES = kvsize.bytes_per_block(kvsize.get_model("llama-3-8b"), 16)  # 2 MiB


def sha(n: int) -> bytes:
    return hashlib.sha256(str(n).encode()).digest()


# ---- encoders (vLLM's side) ------------------------------------------------------------------


def stored(
    hashes: list[Any],
    parent: Any = None,
    *,
    block_size: int = 16,
    medium: str | None = None,
    lora_id: int | None = None,
    lora_name: str | None = None,
    group_idx: int | None = None,
    encoding: str = "array",
    extra: dict[str, Any] | None = None,
) -> Any:
    values = {
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(block_size * len(hashes))),
        "block_size": block_size,
        "lora_id": lora_id,
        "medium": medium,
        "lora_name": lora_name,
        "extra_keys": None,
        "group_idx": group_idx,
        "kv_cache_spec_kind": None,
        "kv_cache_spec_sliding_window": None,
    }
    return _encode("BlockStored", values, [n for n, _ in STORED_DEFAULTS], encoding, extra)


def removed(hashes: list[Any], *, medium: str | None = None, group_idx: int | None = None, encoding: str = "array") -> Any:
    return _encode(
        "BlockRemoved",
        {"block_hashes": hashes, "medium": medium, "group_idx": group_idx},
        ["block_hashes", "medium", "group_idx"],
        encoding,
    )


def cleared(encoding: str = "array") -> Any:
    return _encode("AllBlocksCleared", {}, [], encoding)


def _encode(kind: str, values: dict[str, Any], order: list[str], encoding: str, extra: dict[str, Any] | None = None) -> Any:
    if encoding == "map":
        # Absent keys take their defaults: leave the nil ones out, as omit_defaults does.
        out = {"type": kind, **{k: v for k, v in values.items() if v is not None}}
        out.update(extra or {})
        return out
    row = [kind, *(values.get(name) for name in order)]
    if extra:
        row.extend(extra.values())  # a newer vLLM's extra trailing fields, after all known ones
        return row
    while len(row) > 1 and row[-1] is None and len(row) > 3:  # trailing defaults omitted
        row.pop()
    return row


def payload(events: list[Any], ts: float = 1_700_000_000.0, rank: int | None = None, encoding: str = "array") -> bytes:
    if encoding == "map":
        body: Any = {"ts": ts, "events": events, "data_parallel_rank": rank}
    else:
        body = [ts, events] if rank is None else [ts, events, rank]
    data: bytes = msgpack.packb(body, use_bin_type=True)
    return data


# ---- decoding --------------------------------------------------------------------------------


def test_both_encodings_decode_to_the_same_events() -> None:
    big = 2**64 - 59  # above 2^63: msgpack uint64
    events = [
        stored([sha(1), sha(2)], None, medium="GPU"),
        stored([big, -5], sha(2), block_size=32, lora_id=3, lora_name="sql", group_idx=1),
        removed([sha(1)], medium="CPU", group_idx=0),
        cleared(),
    ]
    as_array = decode_batch(payload(events, ts=12.5, rank=2))
    as_map = decode_batch(payload([_as_map(e) for e in events], ts=12.5, rank=2, encoding="map"))
    assert as_array == as_map
    assert as_array.ts == 12.5 and as_array.data_parallel_rank == 2
    first, second, third, fourth = as_array.events
    assert first == BlockStored((sha(1), sha(2)), None, 16, 32, None, "GPU", None, None)
    assert second == BlockStored((big, -5), sha(2), 32, 64, 3, None, "sql", 1)
    assert third == BlockRemoved((sha(1),), "CPU", 0)
    assert fourth == AllBlocksCleared()


def _as_map(event: list[Any]) -> dict[str, Any]:
    names = {"BlockStored": [n for n, _ in STORED_DEFAULTS], "BlockRemoved": ["block_hashes", "medium", "group_idx"]}.get(event[0], [])
    return {"type": event[0], **{k: v for k, v in zip(names, event[1:], strict=False) if v is not None}}


def test_unknown_types_and_keys_are_skipped_and_bad_events_counted() -> None:
    events = [
        ["BlockTouched", [sha(9)]],  # a type this decoder does not know
        {"type": "BlockEvicted", "block_hashes": [1]},
        stored([7], encoding="map", extra={"future_key": {"a": 1}}),
        stored([8], extra={"x": 1, "y": "two"}),  # extra trailing positional fields
        ["BlockStored", "not-a-list"],
        {"type": "BlockRemoved", "block_hashes": [1.5]},  # a float is not a hash
        ["BlockStored", [9], None, [], -1],  # a negative block_size
        42,
    ]
    batch = decode_batch(payload(events))
    assert [e.block_hashes for e in batch.events if isinstance(e, BlockStored)] == [(7,), (8,)]
    assert batch.unknown == 2 and batch.malformed == 4
    assert any("block_size" in p for p in batch.problems)
    # Counted per name (fails on main: nothing was counted): map keys by name, positional
    # fields past the 15 known ones by index, event types by name.
    assert batch.unknown_keys == {"BlockStored.future_key": 1, "BlockStored[16]": 1, "BlockStored[17]": 1}
    assert batch.unknown_types == {"BlockTouched": 1, "BlockEvicted": 1}
    again = decode_batch(payload([stored([1], encoding="map", extra={"future_key": 2, "other": 3})], encoding="map") + b"")
    assert again.unknown_keys == {"BlockStored.future_key": 1, "BlockStored.other": 1}
    as_map = msgpack.packb({"ts": 1.0, "events": [], "data_parallel_rank": 0, "extra_batch_field": 1})
    assert decode_batch(as_map).unknown_keys == {"batch.extra_batch_field": 1}


def test_missing_trailing_fields_take_their_defaults() -> None:
    event = decode_event(["BlockStored", [1, 2], None])
    assert event == BlockStored((1, 2), None, 16, 0, None, None, None, None)
    assert decode_event(["BlockRemoved", [3]]) == BlockRemoved((3,), None, None)
    assert decode_event({"type": "AllBlocksCleared", "whatever": 1}) == AllBlocksCleared()


@pytest.mark.parametrize(
    "bad",
    [b"\xc1", msgpack.packb(7), msgpack.packb([1.0]), msgpack.packb([1.0, "x"]), msgpack.packb({"ts": 1.0})],
)
def test_an_unreadable_batch_raises(bad: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_batch(bad)


def test_frames_live_and_replay() -> None:
    assert split_live([b"kv@pod@m", encode_seq(5), b"p"]) == (b"kv@pod@m", 5, b"p")
    assert split_live([encode_seq(2**63 + 1), b"p"]) == (b"", 2**63 + 1, b"p")
    with pytest.raises(DecodeError):
        split_live([b"t", b"\x00\x01", b"p"])
    # Older replies [delim, seq, payload]; newer [delim, topic, seq, payload]; the end marker.
    assert split_replay([b"", encode_seq(3), b"p"]) == (3, b"p")
    assert split_replay([b"", b"", encode_seq(4), b"p"]) == (4, b"p")
    assert split_replay([b"", b"topic", encode_seq(4), b"p"]) == (4, b"p")
    assert split_replay([b"", encode_seq(-1), b""]) == (END_OF_REPLAY, b"")
    assert split_replay([b"", b"", encode_seq(-1), b""]) == (END_OF_REPLAY, b"")
    assert split_replay([b"", b""]) == (END_OF_REPLAY, b"")
    assert replay_request(7) == [b"", (7).to_bytes(8, "big")]


# ---- block ids -------------------------------------------------------------------------------


def test_block_ids_are_stable_strings_for_bytes_and_big_ints() -> None:
    assert hash_key(b"\x00\xab") == "0x00ab"
    assert hash_key(sha(1)) == "0x" + sha(1).hex() and len(hash_key(sha(1))) == 66
    assert hash_key(2**64 - 1) == "18446744073709551615"
    assert hash_key(-(2**63)) == "-9223372036854775808"
    assert hash_key(2**200) == str(2**200)
    assert hash_key(1234) != hash_key(b"\x12\x34")  # "1234" vs "0x1234": never the same
    assert block_id(5) == "5"
    assert block_id(5, namespace="dp1/", lora_name="sql", group_idx=2) == "dp1/lora:sql/g2/5"
    assert block_id(5, lora_id=3) == "lora#3/5"
    assert block_id(5, group_idx=0) == "5"  # group 0 is the default group: no prefix
    with pytest.raises(TypeError):
        hash_key(True)


def test_tier_map_parsing() -> None:
    assert parse_tier_map("gpu=hbm, CPU=dram,*=nvme") == (("GPU", "hbm"), ("CPU", "dram"), ("*", "nvme"))
    assert parse_tier_map("GPU=hbm,STORAGE@remote=remote,*@REMOTE=remote") == (
        ("GPU", "hbm"),
        ("STORAGE@REMOTE", "remote"),
        ("*@REMOTE", "remote"),
    )
    for bad in ("", "GPU", "GPU=", "GPU=hbm,GPU=dram", "@REMOTE=x", "STORAGE@=x"):
        with pytest.raises(ValueError):
            parse_tier_map(bad)


# ---- translation -----------------------------------------------------------------------------


def describe(events: list[pb.Event]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for e in events:
        kind = e.WhichOneof("kind")
        if kind == "allocated":
            i = e.allocated.intent
            out.append(("alloc", i.block_id, e.allocated.tier, i.size_bytes, i.parent_block_id))
        elif kind == "freed":
            out.append(("free", *e.freed.block_ids))
        else:
            out.append((kind,))
    return out


def translate(translator: EngineTranslator, events: list[Any], ts: float = 1.0) -> list[tuple[Any, ...]]:
    return describe(translator.translate(decode_batch(payload(events, ts=ts)), int(ts * 1e6)))


def test_stored_and_removed_map_to_allocations_and_frees_with_tiers_and_parents() -> None:
    t = EngineTranslator(MappingOptions(model="llama-3-8b"))
    a, b, c = sha(1), sha(2), sha(3)
    A, B, C = (hash_key(h) for h in (a, b, c))
    # Stored on the GPU, chained: the parent of the first is the event's parent_block_hash.
    assert translate(t, [stored([b, c], a)]) == [("alloc", B, "hbm", BLOCK_BYTES, A), ("alloc", C, "hbm", BLOCK_BYTES, B)]
    # An offloaded copy on the CPU of a block still on the GPU: nothing changes at the broker.
    assert translate(t, [stored([b], medium="CPU")]) == []
    # The GPU copy goes: the block moves down to where the CPU copy is.
    assert translate(t, [removed([b], medium="GPU")]) == [("free", B), ("alloc", B, "dram", BLOCK_BYTES, A)]
    # Loaded back onto the GPU: it moves up again.
    assert translate(t, [stored([b], medium="GPU")]) == [("free", B), ("alloc", B, "hbm", BLOCK_BYTES, A)]
    assert translate(t, [removed([b]), removed([b], medium="CPU")]) == [("free", B), ("alloc", B, "dram", BLOCK_BYTES, A), ("free", B)]
    # Removing what was never stored (in that medium) is skipped; so is a second store.
    assert translate(t, [removed([a]), removed([c], medium="CPU"), stored([c])]) == []
    assert (t.stats.unknown_removed, t.stats.duplicate_stored, t.stats.moves) == (2, 1, 3)
    assert t.tier_of(C) == "hbm" and t.tier_of(B) is None
    assert translate(t, [cleared()]) == [("cleared",)]
    assert t.held == {}


def test_sizes_follow_block_size_and_options() -> None:
    t = EngineTranslator(MappingOptions(model="llama-3-8b", dtype="fp8"))
    assert translate(t, [stored([1], block_size=32)]) == [("alloc", "1", "hbm", 32 * 131_072 // 2, "")]
    fixed = EngineTranslator(MappingOptions(block_bytes=4096))
    assert fixed.shape is None
    assert translate(fixed, [stored([1], block_size=32)]) == [("alloc", "1", "hbm", 4096, "")]


def test_unknown_media_are_skipped_unless_the_map_has_a_default() -> None:
    t = EngineTranslator(MappingOptions(block_bytes=10))
    assert translate(t, [stored([1], medium="DISK")]) == [] and t.stats.unknown_medium == 1
    t = EngineTranslator(MappingOptions(block_bytes=10, tier_map=parse_tier_map("GPU=hbm,CPU=dram,*=nvme")))
    assert translate(t, [stored([1], medium="disk")]) == [("alloc", "1", "nvme", 10, "")]


def test_adapter_and_group_blocks_keep_their_identity_through_removal() -> None:
    t = EngineTranslator(MappingOptions(block_bytes=10, namespace="dp1/"))
    got = translate(t, [stored([1, 2], lora_id=4, lora_name="sql", group_idx=1), stored([1])])
    assert got == [
        ("alloc", "dp1/lora:sql/g1/1", "hbm", 10, ""),
        ("alloc", "dp1/lora:sql/g1/2", "hbm", 10, "dp1/lora:sql/g1/1"),
        ("alloc", "dp1/1", "hbm", 10, ""),
    ]
    # BlockRemoved names no adapter: the adapter's blocks are still found.
    assert translate(t, [removed([2], group_idx=1), removed([1])]) == [("free", "dp1/lora:sql/g1/2"), ("free", "dp1/1")]


def test_seq_tracker() -> None:
    s = SeqTracker()
    assert s.classify(0) == SeqTracker.NEXT
    assert s.classify(3) == SeqTracker.GAP  # joined late
    s.applied(0)
    assert s.classify(1) == SeqTracker.NEXT and s.classify(5) == SeqTracker.GAP and s.classify(0) == SeqTracker.RESTART
    # A gap 1..4 filled from the replay socket up to 7: live 5..7 still queued are duplicates.
    for seq in range(1, 8):
        s.applied(seq)
    s.filled(1)
    assert [s.classify(n) for n in (5, 7, 8, 0)] == [SeqTracker.DUPLICATE, SeqTracker.DUPLICATE, SeqTracker.NEXT, SeqTracker.RESTART]
    s.applied(8)
    assert s.classify(5) == SeqTracker.RESTART  # past the replayed range: only a restart goes back
    s.restarted()
    assert s.classify(0) == SeqTracker.NEXT and s.last == -1


# ---- captures --------------------------------------------------------------------------------


def write_capture(path: pathlib.Path, records: list[tuple[int, int, bytes]], **header: Any) -> None:
    writer = CaptureWriter(str(path), {"model": "llama-3-8b", "tier_map": [["GPU", "hbm"], ["CPU", "dram"]], "client_id": "vllm", **header})
    for rank, seq, data in records:
        writer.write(rank, seq, 100.0 + seq, data)
    writer.close()


def test_a_capture_imports_as_the_bridge_translates_it(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "cap.vllm"
    records = [
        (0, 0, payload([stored([sha(1), sha(2)])], ts=1.0)),
        (0, 1, payload([stored([sha(3)], sha(2), medium="CPU")], ts=2.0, encoding="map")),
        (0, 2, payload([removed([sha(1)])], ts=3.0)),
        (0, 3, b"\xc1not msgpack"),  # vLLM sent garbage: skipped as live, not a bad capture
        (0, 0, payload([stored([sha(4)])], ts=5.0)),  # seq back to 0: the engine restarted
        (0, 5, payload([stored([sha(5)])], ts=6.0)),  # a loss the bridge could not repair
    ]
    write_capture(path, records)
    assert "vllm-events" in FORMATS
    batches = list(read_trace(str(path), "vllm-events", TraceOptions()))
    assert [(b.client_id, b.batch_seq) for b in batches] == [("vllm-dp0", n) for n in range(1, 6)]
    flat = [d for b in batches for d in describe(list(b.events))]
    h = [hash_key(sha(n)) for n in range(6)]
    assert flat == [
        ("alloc", h[1], "hbm", BLOCK_BYTES, ""),
        ("alloc", h[2], "hbm", BLOCK_BYTES, h[1]),
        ("alloc", h[3], "dram", BLOCK_BYTES, h[2]),
        ("free", h[1]),
        ("cleared",),
        ("alloc", h[4], "hbm", BLOCK_BYTES, ""),
        ("alloc", h[5], "hbm", BLOCK_BYTES, ""),
    ]
    assert [b.events[0].ts_us for b in batches] == [1_000_000, 2_000_000, 3_000_000, 5_000_000, 6_000_000]
    # It replays through the core like any trace.
    result = replay(lambda: ((1, b) for b in batches), CoreConfig(), "lru")
    assert result.batches == 5


def test_a_restart_record_clears_with_the_next_batch(tmp_path: pathlib.Path) -> None:
    # The bridge found a restart the seq does not show (the new engine's seq 5 follows the
    # old one's 4): the record [rank, -1, ts, b""] says so; the clear goes with the next batch.
    path = tmp_path / "cap.vllm"
    writer = CaptureWriter(str(path), {"model": "llama-3-8b", "client_id": "vllm"})
    for seq in range(5):
        writer.write(0, seq, 100.0 + seq, payload([stored([seq])], ts=1.0 + seq))
    writer.restarted(0, 200.0)
    for seq in range(6):
        writer.write(0, seq, 300.0 + seq, payload([stored([100 + seq])], ts=10.0 + seq))
    writer.close()
    flat = [d for b in read_trace(str(path), "vllm-events", TraceOptions()) for e in b.events for d in describe([e])]
    cleared_at = flat.index(("cleared",))
    assert cleared_at == 5 and flat.count(("cleared",)) == 1
    assert [d[1] for d in flat[cleared_at + 1 :]] == [str(100 + n) for n in range(6)]
    batches = list(read_trace(str(path), "vllm-events", TraceOptions()))
    assert batches[5].events[0].ts_us == 10_000_000  # the clear carries the new engine's first batch's time


def test_a_torn_tail_is_cut_and_a_bad_record_is_named(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "cap.vllm"
    write_capture(path, [(0, 0, payload([stored([1])])), (0, 1, payload([stored([2])]))], block_bytes=64)
    whole = path.read_bytes()
    path.write_bytes(whole[:-5])  # the bridge was killed mid-write
    batches = list(read_trace(str(path), "vllm-events", TraceOptions()))
    assert [e.allocated.intent.block_id for b in batches for e in b.events] == ["1"]
    assert batches[0].events[0].allocated.intent.size_bytes == 64  # the header's block_bytes
    # A record that is not [rank, seq, ts, payload]: named, or skipped and counted.
    with open(path, "ab") as f:
        f.write(whole[-5:])
        f.write(msgpack.packb(["junk"]))
        f.write(msgpack.packb([0, 2, 1.0, payload([stored([3])])]))
    with pytest.raises(TraceError, match=r"cap.vllm:3: record: expected \[rank"):
        list(read_trace(str(path), "vllm-events", TraceOptions()))
    skips = SkipCounter(skip_bad=True)
    batches = list(read_trace(str(path), "vllm-events", TraceOptions(skip_bad=True), skips))
    assert [e.allocated.intent.block_id for b in batches for e in b.events] == ["1", "2", "3"] and skips.skipped == 1


def test_a_file_that_is_not_a_capture_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "other"
    path.write_bytes(msgpack.packb({"format": "something-else"}))
    with pytest.raises(TraceError, match="not a vllm-events capture"):
        list(read_trace(str(path), "vllm-events", TraceOptions()))
    with pytest.raises(TraceError, match="No such file"):
        list(read_trace(str(tmp_path / "absent"), "vllm-events", TraceOptions()))
    header, records = read_capture(str(write_path(tmp_path)))
    assert header["format"] == "kvbroker-vllm-events" and header["version"] == 1 and list(records) == []


def write_path(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "empty.vllm"
    write_capture(path, [])
    return path
