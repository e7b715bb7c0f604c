"""The translator against vLLM 0.33's events as vLLM writes them (tests/vllm_integration/events_from_vllm/vllm_wire.py).

Narrated scenarios: what vLLM announces, step by step, then what the broker must be told.
"""

from __future__ import annotations

from typing import Any

from clients import kvsize
from kvbroker.v1 import intent_pb2 as pb
from tests.vllm_integration.events_from_vllm.vllm_wire import WireEvent, block_removed, block_stored, encode_batch, encode_event, offloaded
from vllm_integration.events_from_vllm.to_intents import DEFAULT_TIER_MAP, EngineTranslator, MappingOptions, parse_tier_map
from vllm_integration.events_from_vllm.zmq_events import decode_batch, hash_key

BLOCK_BYTES = kvsize.bytes_per_block(kvsize.get_model("llama-3-8b"), 16)  # 2 MiB


def run(t: EngineTranslator, events: list[WireEvent | bytes], ts: float = 1.0) -> list[pb.Event]:
    return t.translate(decode_batch(encode_batch(ts, events, 0)), int(ts * 1e6))


def brief(events: list[pb.Event]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for e in events:
        kind = e.WhichOneof("kind")
        if kind == "allocated":
            out.append(("alloc", e.allocated.intent.block_id, e.allocated.tier, e.allocated.intent.size_bytes))
        elif kind == "freed":
            out.append(("free", *e.freed.block_ids))
        else:
            out.append((kind,))
    return out


def intents(events: list[pb.Event]) -> dict[str, pb.MemoryIntent]:
    return {e.allocated.intent.block_id: e.allocated.intent for e in events if e.WhichOneof("kind") == "allocated"}


# ---- 1. offloaded copies with block_size 0 ------------------------------------------------------


def test_offloaded_copies_with_block_size_0_take_the_size_of_their_other_copy() -> None:
    # Fails on main: block_size 0 was malformed, so the CPU copies were dropped and the
    # blocks freed when their GPU copies went (1 of 4 DRAM blocks left, not 4).
    t = EngineTranslator(MappingOptions(model="llama-3-8b"))
    chain = [b"a" * 32, b"b" * 32, b"c" * 32, b"d" * 32]
    keys = [hash_key(h) for h in chain]
    # A request's 4 blocks are cached on the GPU.
    assert brief(run(t, [block_stored(chain)])) == [("alloc", k, "hbm", BLOCK_BYTES) for k in keys]
    # The offloading connector copies each to the CPU and announces it by its hash alone.
    assert brief(run(t, [offloaded(h, "CPU") for h in chain])) == []
    # The GPU evicts all 4: vLLM still holds them in CPU memory, each as big as before.
    got = brief(run(t, [block_removed(chain)]))
    assert got == [e for k in keys for e in (("free", k), ("alloc", k, "dram", BLOCK_BYTES))]
    assert [t.tier_of(k) for k in keys] == ["dram"] * 4
    assert t.stats.unsized_stored == 4 and t.stats.malformed_events == 0
    # A copy offloaded to STORAGE that no other copy sizes: the last GPU block size (16 tokens).
    assert brief(run(t, [offloaded(b"e" * 32, "STORAGE")])) == [("alloc", hash_key(b"e" * 32), "nvme", BLOCK_BYTES)]
    # ... or the offloaded chunk's size, when the bridge is told it.
    chunked = EngineTranslator(MappingOptions(model="llama-3-8b", offload_block_size=64))
    assert brief(run(chunked, [offloaded(7, "CPU")])) == [("alloc", "7", "dram", 4 * BLOCK_BYTES)]
    # A removal of the CPU copy frees it.
    assert brief(run(t, [block_removed(chain[:1], "CPU")])) == [("free", keys[0])]


# ---- 2. reference counts ------------------------------------------------------------------------


def test_a_copy_announced_twice_stays_until_removed_twice() -> None:
    # Fails on main: the first removal freed the block while vLLM still held it.
    t = EngineTranslator(MappingOptions(block_bytes=100))
    # Two chunks overlapping a shared prefix both announce hash 2 on the CPU (vLLM: "consumers
    # are expected to reference-count repeated store/remove announcements of the same hash").
    assert brief(run(t, [block_stored([1, 2], medium="CPU"), block_stored([2, 3], 1, medium="CPU")])) == [
        ("alloc", "1", "dram", 100),
        ("alloc", "2", "dram", 100),
        ("alloc", "3", "dram", 100),
    ]
    # The first chunk is evicted: its hashes are removed once; 2 is still in the second chunk.
    assert brief(run(t, [block_removed([1, 2], "CPU")])) == [("free", "1")]
    assert t.copies("2") == {"CPU": 1} and t.stats.shared_removed == 1 and t.stats.duplicate_stored == 1
    assert brief(run(t, [block_removed([2, 3], "CPU")])) == [("free", "2"), ("free", "3")]
    # The GPU prefix cache keeps two blocks of one hash (two requests computed it); each is
    # removed on its own.
    assert brief(run(t, [block_stored([9]), block_stored([9])])) == [("alloc", "9", "hbm", 100)]
    assert brief(run(t, [block_removed([9])])) == [] and t.tier_of("9") == "hbm"
    assert brief(run(t, [block_removed([9])])) == [("free", "9")]
    # One removal too many is skipped and counted, never a negative count.
    assert brief(run(t, [block_removed([9])])) == [] and t.stats.unknown_removed == 1


def test_copies_in_two_media_of_one_tier_are_counted_apart() -> None:
    t = EngineTranslator(MappingOptions(block_bytes=100, tier_map=parse_tier_map("GPU=hbm,CPU=dram,STORAGE=dram")))
    assert brief(run(t, [block_stored([1], medium="CPU"), offloaded(1, "STORAGE")])) == [("alloc", "1", "dram", 100)]
    # The CPU copy goes; the STORAGE copy is in the same tier: nothing moves.
    assert brief(run(t, [block_removed([1], "CPU")])) == [] and t.copies("1") == {"STORAGE": 1}
    assert brief(run(t, [block_removed([1], "STORAGE")])) == [("free", "1")]


def test_gpu_reuse_reports_are_not_copies() -> None:
    # kv_cache_report_mode "full": vLLM re-announces the GPU blocks a request reuses, and
    # never removes them more than once.
    t = EngineTranslator(MappingOptions(block_bytes=100, gpu_reuse_reports=True))
    assert brief(run(t, [block_stored([1, 2]), block_stored([1, 2], session_id="s2")])) == [
        ("alloc", "1", "hbm", 100),
        ("alloc", "2", "hbm", 100),
    ]
    assert t.stats.reuse_reports == 2 and t.stats.duplicate_stored == 0
    assert brief(run(t, [block_removed([1, 2])])) == [("free", "1"), ("free", "2")]
    # CPU copies are still counted.
    assert brief(run(t, [offloaded(3, "CPU"), offloaded(3, "CPU"), block_removed([3], "CPU")])) == [("alloc", "3", "dram", 100)]


# ---- 4. the fields vLLM 0.33 added --------------------------------------------------------------


def test_session_lookahead_and_position_reach_the_intent() -> None:
    # Fails on main: session_id, lookahead_token_ids and the chain position were dropped.
    plain = intents(
        run(
            EngineTranslator(MappingOptions(model="llama-3-8b")),
            [block_stored([1, 2], session_id="chat-7", lookahead_token_ids=[[5], [6]])],
        )
    )
    assert [(i.request_id, i.expected_reuse_window_tokens, i.token_start) for i in plain.values()] == [("chat-7", 1, 0), ("chat-7", 1, 16)]
    # Without a prefill rate no cost is sent; with one, it is.
    assert not plain["1"].HasField("recompute_cost_us")
    t = EngineTranslator(MappingOptions(model="llama-3-8b", prefill_tokens_per_s=16_000))
    first = intents(run(t, [block_stored([1, 2], session_id="chat-7", lookahead_token_ids=[[5], [6]])]))
    # Recompute: the block's 16 tokens and everything before them, at 16,000 tokens/s.
    assert [first[k].recompute_cost_us for k in ("1", "2")] == [1_000, 2_000]
    # The next block of the chain continues the positions (its parent is known).
    third = intents(run(t, [block_stored([3], 2)]))["3"]
    assert (third.token_start, third.recompute_cost_us, third.request_id, third.HasField("expected_reuse_window_tokens")) == (
        32,
        3_000,
        "",
        False,
    )
    # A chain whose parent the bridge never saw: position and cost unknown, not guessed.
    orphan = intents(run(t, [block_stored([11], 10)]))["11"]
    assert orphan.token_start == 0 and not orphan.HasField("recompute_cost_us")


def test_a_sliding_window_group_recomputes_its_window_only_and_is_sized_by_its_layers() -> None:
    # Fails on main: every group was sized as a block of all 42 layers.
    gemma = kvsize.get_model("gemma-2-9b")  # 21 sliding + 21 full layers: two groups of 21
    per_block = kvsize.bytes_per_block(gemma, 16) // 2
    sized = intents(
        run(EngineTranslator(MappingOptions(model="gemma-2-9b")), [block_stored([1], group_idx=0), block_stored([1], group_idx=1)])
    )
    assert {bid: i.size_bytes for bid, i in sized.items()} == {"1": per_block, "g1/1": per_block}
    t = EngineTranslator(MappingOptions(model="gemma-2-9b", prefill_tokens_per_s=1_000))
    # vLLM learns the consumer the groups' kinds through the offloading events' spec fields.
    run(t, [offloaded(99, "CPU", group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=32)])
    chain = list(range(1, 9))  # 8 blocks of 16 tokens: 128 tokens
    full = intents(run(t, [block_stored(chain, group_idx=0)]))
    sliding = intents(run(t, [block_stored(chain, group_idx=1)]))
    assert {i.size_bytes for i in [*full.values(), *sliding.values()]} == {per_block}
    # The full-attention block 8 needs all 128 tokens; its sliding twin only 32 + 16.
    assert full["8"].recompute_cost_us == 128_000
    assert sliding["g1/8"].recompute_cost_us == 48_000
    # A model whose every layer slides (Mistral-7B v0.1, window 4096): one group, the window.
    mistral = EngineTranslator(MappingOptions(model="mistral-7b-v0.1", prefill_tokens_per_s=1_000))
    long_chain = intents(run(mistral, [block_stored(list(range(1, 301)))]))
    assert long_chain["300"].recompute_cost_us == (4096 + 16) * 1_000
    assert long_chain["300"].size_bytes == kvsize.bytes_per_block(kvsize.get_model("mistral-7b-v0.1"), 16)


def test_locality_picks_its_own_tier_when_the_map_names_it() -> None:
    t = EngineTranslator(MappingOptions(block_bytes=100, tier_map=parse_tier_map("GPU=hbm,CPU=dram,STORAGE=nvme,STORAGE@REMOTE=remote")))
    got = brief(run(t, [offloaded(1, "STORAGE", locality="REMOTE", ownership="kvcr"), offloaded(2, "STORAGE", locality="LOCAL")]))
    assert got == [("alloc", "1", "remote", 100), ("alloc", "2", "nvme", 100)]
    assert brief(run(t, [block_removed([1], "STORAGE", locality="REMOTE")])) == [("free", "1")]
    assert parse_tier_map("storage@remote=remote") == (("STORAGE@REMOTE", "remote"),)


# ---- 5. STORAGE by default ----------------------------------------------------------------------


def test_storage_copies_land_in_nvme_by_default() -> None:
    # Fails on main: the default map had no STORAGE entry, so these were skipped.
    assert dict(DEFAULT_TIER_MAP) == {"GPU": "hbm", "CPU": "dram", "STORAGE": "nvme"}
    t = EngineTranslator(MappingOptions(block_bytes=100))
    assert brief(run(t, [block_stored([1], medium="STORAGE"), offloaded(2, "STORAGE")])) == [
        ("alloc", "1", "nvme", 100),
        ("alloc", "2", "nvme", 100),
    ]
    assert t.stats.unknown_medium == 0


# ---- 6. unknown keys ----------------------------------------------------------------------------


def test_unknown_keys_and_types_are_counted_per_name() -> None:
    # Fails on main: the decoder's docstring said so, and nothing counted them.
    t = EngineTranslator(MappingOptions(block_bytes=100))
    newer = encode_event(block_stored([1]), extra={"priority_hint": 3, "tenant_hint": "a"})
    run(t, [newer, newer, encode_event(block_removed([1]), extra={"reason": "evicted"})])
    assert t.stats.unknown_keys == {"BlockStored.priority_hint": 2, "BlockStored.tenant_hint": 2, "BlockRemoved.reason": 1}
    assert t.stats.as_dict()["unknown_keys"] == t.stats.unknown_keys
    # The known fields of those events still count.
    assert t.stats.stored_blocks == 2 and t.stats.removed_blocks == 1 and t.copies("1") == {"GPU": 1}
