"""KV sizing: the formula per attention kind, sliding windows, the model table, config.json, `kvbroker size`."""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

import pytest

from broker.cli.size import add_parser, cmd_size
from clients import kvsize
from clients.kvsize import ModelShape, bytes_per_block, bytes_per_token, get_model, shape_from_config_json

# ---- the table --------------------------------------------------------------------------------

# B/token at fp16 without a context (sliding windows unscaled), by hand from the configs.
TABLE = {
    "llama-3-8b": 32 * 8 * 128 * 2 * 2,  # 131,072
    "llama-3-70b": 80 * 8 * 128 * 2 * 2,  # 327,680
    "mistral-7b": 32 * 8 * 128 * 2 * 2,  # 131,072
    "mistral-7b-v0.1": 32 * 8 * 128 * 2 * 2,
    "mixtral-8x7b": 32 * 8 * 128 * 2 * 2,
    "qwen2.5-7b": 28 * 4 * 128 * 2 * 2,  # 57,344
    "qwen2.5-72b": 80 * 8 * 128 * 2 * 2,  # 327,680
    "gemma-2-9b": 42 * 8 * 256 * 2 * 2,  # 344,064
    "deepseek-v3": 61 * (512 + 64) * 2,  # 70,272
}


def test_the_table_is_exactly_the_known_models() -> None:
    assert sorted(TABLE) == kvsize.known_models()


@pytest.mark.parametrize(("name", "expected"), sorted(TABLE.items()))
def test_table_bytes_per_token(name: str, expected: int) -> None:
    assert bytes_per_token(get_model(name)) == expected


def test_the_seed_figures_hold_exactly() -> None:
    assert bytes_per_token(get_model("llama-3-8b")) == 131_072
    assert bytes_per_token(get_model("llama-3-70b")) == 327_680
    assert bytes_per_token(get_model("mistral-7b")) == 131_072
    assert bytes_per_token(get_model("qwen2.5-7b")) == 57_344
    assert bytes_per_token(get_model("deepseek-v3")) == 70_272


@pytest.mark.parametrize(("dtype", "expected"), [("fp16", 131_072), ("bf16", 131_072), ("fp8", 65_536), ("int4", 32_768), ("int2", 16_384)])
def test_dtype_scales_bytes(dtype: str, expected: int) -> None:
    assert bytes_per_token(get_model("llama-3-8b"), kvsize.DTYPE_BYTES[dtype]) == expected


def test_mla_caches_one_latent_without_k_and_v() -> None:
    mla = get_model("deepseek-v3")
    assert (mla.attention, mla.kv_heads, mla.head_dim) == ("mla", 1, 576)
    # The same numbers read as an MQA cache would double them (separate K and V).
    mqa = ModelShape("x", 61, 1, 576, "mqa")
    assert bytes_per_token(mqa) == 2 * bytes_per_token(mla)
    assert bytes_per_token(mla, 1.0) == 61 * 576


# ---- sliding windows ----------------------------------------------------------------------------


def test_gemma2_slides_on_alternating_layers() -> None:
    gemma = get_model("gemma-2-9b")
    assert gemma.sliding_window == 4096
    assert gemma.sliding_layers == tuple(range(0, 42, 2))
    per_layer = 8 * 256 * 2 * 2
    assert bytes_per_token(gemma, context_tokens=4096) == 42 * per_layer  # within the window: no saving
    assert bytes_per_token(gemma, context_tokens=8192) == 21 * per_layer + 21 * per_layer // 2  # 258,048
    assert bytes_per_token(gemma, context_tokens=16384) == 21 * per_layer + 21 * per_layer // 4  # 215,040


def test_mistral_v01_slides_on_every_layer() -> None:
    v01 = get_model("mistral-7b-v0.1")
    assert bytes_per_token(v01, context_tokens=4096) == 131_072
    assert bytes_per_token(v01, context_tokens=8192) == 65_536
    # Full-attention models never scale.
    assert bytes_per_token(get_model("mistral-7b"), context_tokens=32768) == 131_072


def test_a_cache_group_of_a_hybrid_model_holds_its_share_of_the_layers() -> None:
    # vLLM gives every group of a hybrid model the same number of layers (one page size).
    gemma2 = get_model("gemma-2-9b")  # 21 sliding, 21 full: two groups of 21
    assert kvsize.cache_group_layers(gemma2) == 21
    assert kvsize.bytes_per_group_block(gemma2, 16) * 2 == bytes_per_block(gemma2, 16)
    # 5 sliding : 1 full (Gemma-3-like, 62 layers): groups of the 10 full layers.
    gemma3 = shape_from_config_json(
        {
            "num_hidden_layers": 62,
            "num_attention_heads": 32,
            "num_key_value_heads": 16,
            "head_dim": 128,
            "sliding_window": 1024,
            "sliding_window_pattern": 6,
        }
    )
    assert (gemma3.full_layers, kvsize.cache_group_layers(gemma3)) == (10, 10)
    # 12 sliding + 13 full (under 1.5x): one size of 13, the sliding kind padded.
    near = ModelShape("near", 25, 8, 64, "gqa", sliding_window=128, sliding_layers=tuple(range(0, 24, 2)))
    assert (len(near.sliding_layers), kvsize.cache_group_layers(near)) == (12, 13)
    assert kvsize.bytes_per_group_block(near, 16) == 13 * 8 * 64 * 2 * 2 * 16
    # One kind of layer: one group of all of them, as bytes_per_block.
    for name in ("llama-3-8b", "mistral-7b-v0.1", "deepseek-v3"):
        shape = get_model(name)
        assert kvsize.cache_group_layers(shape) == shape.layers
        assert kvsize.bytes_per_group_block(shape, 16, 1.0) == bytes_per_block(shape, 16, 1.0)


def test_an_empty_or_absent_context_is_not_scaled() -> None:
    gemma = get_model("gemma-2-9b")
    assert bytes_per_token(gemma, context_tokens=0) == bytes_per_token(gemma) == 344_064
    with pytest.raises(ValueError, match="context_tokens"):
        bytes_per_token(gemma, context_tokens=-1)


def test_block_bytes_round_up_once_from_the_exact_figure() -> None:
    gemma = get_model("gemma-2-9b")
    # 172,032 + 172,032 x 4096/5000 = 312,960.6144 B/token: per token rounds to 312,961, but a
    # 16-token block is 5,007,369.83 -> 5,007,370, not 16 x 312,961 = 5,007,376.
    assert bytes_per_token(gemma, context_tokens=5000) == 312_961
    assert bytes_per_block(gemma, 16, context_tokens=5000) == 5_007_370
    tiny = ModelShape("tiny", 1, 1, 3, "mqa")
    assert bytes_per_token(tiny, 0.25) == 2  # 1.5 B rounds up
    assert bytes_per_block(tiny, 2, 0.25) == 3  # exactly 3, not 2 x 2
    assert bytes_per_block(get_model("llama-3-8b"), 16) == 2_097_152
    with pytest.raises(ValueError, match="block_tokens"):
        bytes_per_block(tiny, 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attention": "sparse"}, "attention must be one of"),
        ({"layers": 0}, "layers must be > 0"),
        ({"kv_heads": 0}, "kv_heads and head_dim"),
        ({"attention": "mqa", "kv_heads": 2}, "mqa has exactly one KV head"),
        (
            {"attention": "mla", "kv_heads": 1, "head_dim": 100, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
            "kv_lora_rank \\+ qk_rope_head_dim = 576",
        ),
        ({"attention": "mla", "kv_heads": 1, "head_dim": 64}, "mla needs kv_lora_rank"),
        ({"sliding_layers": (0, 1)}, "without a sliding_window"),
        ({"sliding_window": 4096}, "no layer is sliding"),
        ({"sliding_window": 4096, "sliding_layers": (1, 0)}, "sorted layer indices"),
        ({"sliding_window": 4096, "sliding_layers": (4,)}, "in 0..3"),
        ({"dtype_bytes": 0}, "dtype_bytes"),
    ],
)
def test_an_inconsistent_shape_is_refused(kwargs: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {"name": "m", "layers": 4, "kv_heads": 2, "head_dim": 64, "attention": "gqa"}
    with pytest.raises(ValueError, match=message):
        ModelShape(**{**base, **kwargs})


def test_names_and_hugging_face_ids_resolve() -> None:
    assert get_model("LLAMA-3-8B") is get_model("llama-3-8b")
    assert get_model("meta-llama/Meta-Llama-3-8B-Instruct") is get_model("llama-3-8b")
    assert get_model("google/gemma-2-9b-it").name == "gemma-2-9b"
    with pytest.raises(kvsize.UnknownModelError) as info:
        get_model("gpt-5")
    assert "gpt-5" in str(info.value) and "llama-3-8b" in str(info.value) and "deepseek-v3" in str(info.value)


# ---- config.json ----------------------------------------------------------------------------

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"],
    "cache_implementation": "hybrid",
    "head_dim": 256,
    "hidden_size": 3584,
    "model_type": "gemma2",
    "num_attention_heads": 16,
    "num_hidden_layers": 42,
    "num_key_value_heads": 8,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
MISTRAL_V01 = {
    "hidden_size": 4096,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "sliding_window": 4096,
}
QWEN25_7B = {
    "hidden_size": 3584,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "sliding_window": 131072,
    "use_sliding_window": False,
}
DEEPSEEK_V3 = {
    "hidden_size": 7168,
    "kv_lora_rank": 512,
    "model_type": "deepseek_v3",
    "num_attention_heads": 128,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}


def _same_shape(a: ModelShape, b: ModelShape) -> bool:
    return {**a.__dict__, "name": ""} == {**b.__dict__, "name": ""}


@pytest.mark.parametrize(
    ("config", "model"),
    [
        (LLAMA3_8B, "llama-3-8b"),
        (GEMMA2_9B, "gemma-2-9b"),
        (MISTRAL_V01, "mistral-7b-v0.1"),
        (QWEN25_7B, "qwen2.5-7b"),
        (DEEPSEEK_V3, "deepseek-v3"),
    ],
)
def test_real_configs_give_the_table_shapes(config: dict[str, Any], model: str) -> None:
    shape = shape_from_config_json(config, name=model)
    assert _same_shape(shape, get_model(model)), (shape, get_model(model))


def test_config_conventions() -> None:
    # No num_key_value_heads: multi-head attention (Llama-2-7B).
    llama2 = shape_from_config_json({"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096})
    assert (llama2.attention, llama2.kv_heads, bytes_per_token(llama2)) == ("mha", 32, 524_288)
    # An explicit head_dim wins over hidden_size / heads (Mistral-Nemo: 5120 / 32 = 160, head_dim 128).
    nemo = shape_from_config_json(
        {"num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 5120, "head_dim": 128}
    )
    assert nemo.head_dim == 128
    mqa = shape_from_config_json({"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 1, "hidden_size": 512})
    assert (mqa.attention, mqa.kv_heads) == ("mqa", 1)
    # Qwen2 with the window on: layers from max_window_layers on slide.
    qwen = shape_from_config_json({**QWEN25_7B, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20})
    assert (qwen.sliding_window, qwen.sliding_layers) == (4096, tuple(range(20, 28)))
    # Spelled-out layer_types (newer transformers).
    typed = shape_from_config_json(
        {**LLAMA3_8B, "num_hidden_layers": 4, "sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"] * 2}
    )
    assert typed.sliding_layers == (0, 2)
    # Gemma-3 keeps the language model in text_config, with one global layer in every 6.
    gemma3 = shape_from_config_json(
        {
            "model_type": "gemma3",
            "text_config": {
                "num_hidden_layers": 12,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "head_dim": 256,
                "sliding_window": 1024,
                "sliding_window_pattern": 6,
            },
        }
    )
    assert gemma3.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    # A null window is no window.
    assert shape_from_config_json({**MISTRAL_V01, "sliding_window": None}).sliding_layers == ()


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({**LLAMA3_8B, "num_hidden_layers": None}, "num_hidden_layers"),
        ({k: v for k, v in LLAMA3_8B.items() if k != "num_attention_heads"}, "num_attention_heads"),
        ({k: v for k, v in LLAMA3_8B.items() if k != "hidden_size"}, "hidden_size"),
        ({k: v for k, v in DEEPSEEK_V3.items() if k != "qk_rope_head_dim"}, "qk_rope_head_dim"),
    ],
)
def test_a_missing_config_key_is_named(config: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=f"missing key '{key}'"):
        shape_from_config_json(config)


def test_bad_config_values_are_named() -> None:
    with pytest.raises(ValueError, match="num_key_value_heads must be an integer"):
        shape_from_config_json({**LLAMA3_8B, "num_key_value_heads": "8"})
    with pytest.raises(ValueError, match="not a multiple"):
        shape_from_config_json({**LLAMA3_8B, "hidden_size": 4100})
    with pytest.raises(ValueError, match="exceeds"):
        shape_from_config_json({**LLAMA3_8B, "num_key_value_heads": 64})


def test_config_files_and_model_directories(tmp_path: pathlib.Path) -> None:
    model_dir = tmp_path / "Meta-Llama-3-8B"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
    by_file = shape_from_config_json(model_dir / "config.json")
    by_dir = shape_from_config_json(str(model_dir))
    assert by_file == by_dir and by_file.name == "Meta-Llama-3-8B"
    assert bytes_per_token(by_file) == 131_072
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        shape_from_config_json(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        shape_from_config_json(tmp_path / "list.json")
    with pytest.raises(ValueError, match="cannot read"):
        shape_from_config_json(tmp_path / "absent.json")


# ---- kvbroker size ----------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvbroker")
    add_parser(parser.add_subparsers(dest="verb", required=True))
    return parser.parse_args(argv)


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    args = parse(["size", *argv, "--json"])
    assert args.func(args) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_size_json_for_llama3_8b(capsys: pytest.CaptureFixture[str]) -> None:
    rec = run_json(capsys, ["--model", "llama-3-8b", "--tokens", "4096"])
    assert {k: rec[k] for k in ("model", "attention", "layers", "kv_heads", "head_dim", "dtype")} == {
        "model": "llama-3-8b",
        "attention": "gqa",
        "layers": 32,
        "kv_heads": 8,
        "head_dim": 128,
        "dtype": "fp16",
    }
    assert (rec["bytes_per_token"], rec["block_tokens"], rec["bytes_per_block"]) == (131_072, 16, 2_097_152)
    assert (rec["tokens"], rec["blocks"], rec["total_bytes"]) == (4096, 256, 536_870_912)


def test_size_rounds_blocks_up_and_applies_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    rec = run_json(capsys, ["--model", "llama-3-70b", "--tokens", "100", "--block-tokens", "32", "--dtype", "fp8"])
    assert (rec["bytes_per_token"], rec["bytes_per_block"], rec["blocks"]) == (163_840, 32 * 163_840, 4)
    assert rec["total_bytes"] == 4 * 32 * 163_840  # the partly filled last block counts whole
    rec = run_json(capsys, ["--model", "qwen2.5-7b", "--tokens", "16", "--dtype", "int2"])
    assert rec["bytes_per_token"] == 57_344 // 8


def test_size_averages_sliding_layers_over_the_context(capsys: pytest.CaptureFixture[str]) -> None:
    rec = run_json(capsys, ["--model", "gemma-2-9b", "--tokens", "8192"])
    assert (rec["bytes_per_token"], rec["bytes_per_block"], rec["blocks"]) == (258_048, 16 * 258_048, 512)
    assert rec["total_bytes"] == 8192 * 258_048
    assert (rec["sliding_window"], rec["sliding_layers"]) == (4096, 21)
    mla = run_json(capsys, ["--model", "deepseek-v3", "--tokens", "1"])
    assert (mla["attention"], mla["kv_heads"], mla["head_dim"], mla["bytes_per_token"], mla["blocks"]) == ("mla", 1, 576, 70_272, 1)


def test_size_reads_a_config_json(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA3_8B, "_name_or_path": "meta-llama/Meta-Llama-3-8B"}))
    rec = run_json(capsys, ["--model", str(path), "--tokens", "32"])
    assert (rec["model"], rec["bytes_per_token"], rec["total_bytes"]) == ("meta-llama/Meta-Llama-3-8B", 131_072, 2 * 2_097_152)


def test_size_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_size(argparse.Namespace(model="mistral-7b", tokens=1000, block_tokens=16, dtype="fp16", json=False)) == 0
    out = capsys.readouterr().out
    assert "131,072 B" in out and "2,097,152 B" in out and "1,000 -> 63 blocks" in out and "132,120,576 B" in out


def test_size_unknown_model_exits_2_listing_known(capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_size(argparse.Namespace(model="gpt-5", tokens=10, block_tokens=16, dtype="fp16", json=True)) == 2
    err = capsys.readouterr().err
    assert "unknown model 'gpt-5'" in err
    for name in kvsize.known_models():
        assert name in err
    assert cmd_size(argparse.Namespace(model="/no/such/config.json", tokens=10, block_tokens=16, dtype="fp16", json=True)) == 2
    assert "no such file" in capsys.readouterr().err


def test_size_flags_are_checked_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["size", "--model", "llama-3-8b", "--tokens", "5"])
    assert (args.block_tokens, args.dtype, args.json) == (16, "fp16", False)
    for bad in (["--tokens", "-1"], ["--tokens", "5", "--block-tokens", "0"], ["--tokens", "5", "--dtype", "fp64"], []):
        with pytest.raises(SystemExit):
            parse(["size", "--model", "llama-3-8b", *bad])
    capsys.readouterr()


# Qwen3-8B's config.json as published (the fields that size its KV cache).
QWEN3_8B = {
    "_name_or_path": "Qwen/Qwen3-8B",
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 4096,
    "sliding_window": None,
    "use_sliding_window": False,
}


def hub_snapshot(hub: pathlib.Path, model: str, config: dict[str, Any], revision: str = "abc123", main: bool = True) -> pathlib.Path:
    """A model as huggingface_hub caches it: models--ORG--NAME/snapshots/REV/config.json."""
    folder = hub / ("models--" + model.replace("/", "--"))
    path = folder / "snapshots" / revision / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(config))
    if main:
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / "main").write_text(revision)
    return path


def test_a_model_in_the_local_hugging_face_cache_is_read_from_its_config(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-bridge --model and size --model knew 9 models (no Qwen3, no Llama-3.1): a model
    vLLM has run here is in the hub cache, with its config.json."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    path = hub_snapshot(tmp_path, "Qwen/Qwen3-8B", QWEN3_8B)
    with pytest.raises(kvsize.UnknownModelError):
        get_model("Qwen/Qwen3-8B")  # not in the table
    shape = kvsize.resolve_shape("Qwen/Qwen3-8B")
    assert (shape.name, shape.layers, shape.kv_heads, shape.head_dim, shape.attention) == ("Qwen/Qwen3-8B", 36, 8, 128, "gqa")
    assert bytes_per_token(shape) == 36 * 8 * 128 * 2 * 2
    assert kvsize.model_config_source("qwen/qwen3-8b") == str(path)  # ids match case-insensitively, as on the hub
    # The cache's config wins over the table for a model both know; the table is the fallback.
    table = get_model("meta-llama/Meta-Llama-3-8B")
    assert kvsize.resolve_shape("meta-llama/Meta-Llama-3-8B") == table and kvsize.model_config_source("meta-llama/Meta-Llama-3-8B") is None
    hub_snapshot(tmp_path, "meta-llama/Meta-Llama-3-8B", {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8})
    assert kvsize.resolve_shape("meta-llama/Meta-Llama-3-8B").layers == 2


def test_the_hub_cache_follows_huggingface_hubs_variables(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert kvsize.hf_hub_cache() == str(tmp_path / ".cache" / "huggingface" / "hub")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert kvsize.hf_hub_cache() == str(tmp_path / "hf" / "hub")
    # No refs/main: the newest snapshot holding a config.json.
    hub_snapshot(tmp_path / "hf" / "hub", "meta-llama/Llama-3.1-8B", {**QWEN3_8B, "num_hidden_layers": 32}, main=False)
    assert kvsize.resolve_shape("meta-llama/Llama-3.1-8B").layers == 32
    with pytest.raises(kvsize.UnknownModelError, match="not in the local Hugging Face cache"):
        kvsize.resolve_shape("Qwen/Qwen3-32B")


def test_vllm_bridge_sizes_blocks_from_a_cached_model(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_integration.events_from_vllm.bridge_cli import _check_paths
    from vllm_integration.events_from_vllm.to_intents import resolve_model

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    args = argparse.Namespace(model="Qwen/Qwen3-8B", capture=None, stats_file=None)
    assert _check_paths(args) is not None and "Qwen/Qwen3-8B" in str(_check_paths(args))  # not cached: refused, named
    hub_snapshot(tmp_path, "Qwen/Qwen3-8B", QWEN3_8B)
    assert _check_paths(args) is None
    assert resolve_model("Qwen/Qwen3-8B").layers == 36
