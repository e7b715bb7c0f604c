"""KV-cache bytes per token and per block, from a model's attention shape.

Per token, every attention layer caches:

- MHA / GQA / MQA: a K and a V vector per KV head: ``kv_heads × head_dim × 2 × dtype bytes``
  (GQA/MQA differ from MHA only in having fewer KV heads than query heads).
- MLA (DeepSeek-V2/V3): one compressed latent of ``kv_lora_rank`` plus the decoupled RoPE key
  of ``qk_rope_head_dim``, shared by all heads, with no separate K and V:
  ``(kv_lora_rank + qk_rope_head_dim) × dtype bytes``. We store it as one KV "head" of
  ``head_dim = kv_lora_rank + qk_rope_head_dim``, which is also how vLLM lays out its MLA cache.

Sliding-window layers (Mistral-7B v0.1 on every layer, Gemma-2 on every other layer) keep
at most ``window`` tokens, so their footprint stops growing once the context passes the
window. For a context of N tokens, the *average* bytes per token of those layers is scaled
by ``min(N, window) / N``; full-attention layers are never scaled. Without a context length
the full (unscaled) figure is returned: the cost of one more token in a short context.

Byte counts are computed exactly (fractions: int4/int2 pack several scalars into a byte and
the window scale is a ratio) and rounded up only at the end: an allocator cannot hand out
part of a byte, and rounding up never under-sizes a tier.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

ATTENTION_KINDS = ("mha", "gqa", "mqa", "mla")

# Bytes per cached scalar. int4/int2 are the packed sizes (two and four scalars per byte);
# quantization scales/zero points are per group and not counted here.
DTYPE_BYTES: dict[str, float] = {"fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int4": 0.5, "int2": 0.25}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What decides a model's KV-cache footprint (nothing else of the model matters here)."""

    name: str
    layers: int
    # KV heads and their dimension; for MLA one latent "head" of kv_lora_rank + qk_rope_head_dim.
    kv_heads: int
    head_dim: int
    attention: str = "gqa"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    # Tokens a sliding-window layer keeps; None when no layer slides.
    sliding_window: int | None = None
    # Indices (0-based) of the sliding-window layers; the others attend to the full context.
    sliding_layers: tuple[int, ...] = ()
    dtype_bytes: float = 2.0

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"{self.name}: attention must be one of {', '.join(ATTENTION_KINDS)}, got {self.attention!r}")
        if self.layers <= 0:
            raise ValueError(f"{self.name}: layers must be > 0, got {self.layers}")
        if self.kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"{self.name}: kv_heads and head_dim must be > 0, got {self.kv_heads} and {self.head_dim}")
        if self.attention == "mqa" and self.kv_heads != 1:
            raise ValueError(f"{self.name}: mqa has exactly one KV head, got {self.kv_heads}")
        if self.attention == "mla":
            if self.kv_lora_rank <= 0 or self.qk_rope_head_dim < 0:
                raise ValueError(f"{self.name}: mla needs kv_lora_rank > 0 and qk_rope_head_dim >= 0")
            # One shared latent per token and layer: keeping kv_heads/head_dim consistent with it
            # means every reader of the shape (reports, JSON) sees what is really cached.
            if self.kv_heads != 1 or self.head_dim != self.kv_lora_rank + self.qk_rope_head_dim:
                raise ValueError(
                    f"{self.name}: mla caches one latent per token: kv_heads must be 1 and head_dim "
                    f"kv_lora_rank + qk_rope_head_dim = {self.kv_lora_rank + self.qk_rope_head_dim}"
                )
            if self.sliding_layers:
                raise ValueError(f"{self.name}: sliding windows are not modelled for mla")
        if self.sliding_layers:
            if self.sliding_window is None or self.sliding_window <= 0:
                raise ValueError(f"{self.name}: sliding_layers given without a sliding_window > 0")
            if list(self.sliding_layers) != sorted(set(self.sliding_layers)) or not all(0 <= i < self.layers for i in self.sliding_layers):
                raise ValueError(f"{self.name}: sliding_layers must be distinct, sorted layer indices in 0..{self.layers - 1}")
        elif self.sliding_window is not None:
            raise ValueError(f"{self.name}: sliding_window {self.sliding_window} given but no layer is sliding (sliding_layers)")
        if self.dtype_bytes <= 0:
            raise ValueError(f"{self.name}: dtype_bytes must be > 0, got {self.dtype_bytes}")

    @property
    def full_layers(self) -> int:
        return self.layers - len(self.sliding_layers)


def _fraction(value: float) -> Fraction:
    # Through str so 0.25 and friends are exact and a user's 0.1 means one tenth, not its binary float.
    return Fraction(value) if isinstance(value, int) else Fraction(str(value))


def exact_bytes_per_token(shape: ModelShape, dtype_bytes: float | None = None, context_tokens: int | None = None) -> Fraction:
    """Average KV bytes per token (unrounded) for a context of ``context_tokens`` tokens."""
    dtype = _fraction(shape.dtype_bytes if dtype_bytes is None else dtype_bytes)
    if dtype <= 0:
        raise ValueError(f"dtype_bytes must be > 0, got {dtype_bytes}")
    if context_tokens is not None and context_tokens < 0:
        raise ValueError(f"context_tokens must be >= 0, got {context_tokens}")
    if shape.attention == "mla":
        per_layer = (shape.kv_lora_rank + shape.qk_rope_head_dim) * dtype
    else:
        per_layer = shape.kv_heads * shape.head_dim * 2 * dtype  # K and V
    total = per_layer * shape.full_layers
    sliding = len(shape.sliding_layers)
    if sliding:
        assert shape.sliding_window is not None
        scale = Fraction(1)
        # An empty context has no average; it costs what its next token costs (no scaling).
        if context_tokens and context_tokens > shape.sliding_window:
            scale = Fraction(shape.sliding_window, context_tokens)
        total += per_layer * sliding * scale
    return total


def bytes_per_token(shape: ModelShape, dtype_bytes: float | None = None, context_tokens: int | None = None) -> int:
    """KV bytes per token, rounded up; sliding-window layers averaged over ``context_tokens``."""
    return math.ceil(exact_bytes_per_token(shape, dtype_bytes, context_tokens))


def bytes_per_block(shape: ModelShape, block_tokens: int, dtype_bytes: float | None = None, context_tokens: int | None = None) -> int:
    """KV bytes of one block of ``block_tokens`` tokens (from the exact per-token figure, rounded up once)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    return math.ceil(exact_bytes_per_token(shape, dtype_bytes, context_tokens) * block_tokens)


def cache_group_layers(shape: ModelShape) -> int:
    """Layers whose KV one block of one of vLLM's KV-cache groups holds.

    A model with one kind of attention layer has one group of all its layers. A hybrid model
    (full-attention and sliding-window layers) gets several groups of the *same* number of
    layers, so that every group's block has one page size (vllm/v1/core/kv_cache_planning.py):
    the smaller of the two layer counts, or the larger when it is under 1.5 times the smaller
    (the kind with fewer layers is then padded). Gemma-2-9B (21 sliding, 21 full): two groups
    of 21 layers; a 10 full + 52 sliding model: groups of 10.
    """
    full, sliding = shape.full_layers, len(shape.sliding_layers)
    if not full or not sliding:
        return shape.layers
    low, high = min(full, sliding), max(full, sliding)
    return high if high < 1.5 * low else low


def bytes_per_group_block(shape: ModelShape, block_tokens: int, dtype_bytes: float | None = None) -> int:
    """KV bytes of one block of one KV-cache group (``cache_group_layers`` layers), rounded up once.

    Equal to ``bytes_per_block`` for a model with one kind of layer; for a hybrid model a
    group's block holds only its own layers, full-attention and sliding-window groups alike.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    per_layer = exact_bytes_per_token(shape, dtype_bytes) / shape.layers
    return math.ceil(per_layer * cache_group_layers(shape) * block_tokens)


def blocks_for(tokens: int, block_tokens: int) -> int:
    """Blocks needed to hold ``tokens`` tokens (the last one may be partly filled)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    return -(-tokens // block_tokens)


# ---- the models we know ---------------------------------------------------------------------
#
# Values are the ones in each model's Hugging Face config.json (quoted in the comment); head_dim
# is hidden_size / num_attention_heads where the config has no head_dim. Bytes per token are at
# fp16/bf16 without a context length (sliding windows unscaled).


def _alternating(layers: int) -> tuple[int, ...]:
    # Gemma-2 (transformers Gemma2DecoderLayer: is_sliding = not bool(layer_idx % 2)): even layers slide.
    return tuple(range(0, layers, 2))


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        # meta-llama/Meta-Llama-3-8B: num_hidden_layers 32, num_attention_heads 32, num_key_value_heads 8,
        # hidden_size 4096 (head_dim 128) -> 32 x 8 x 128 x 2 x 2 = 131,072 B/token.
        ModelShape("llama-3-8b", 32, 8, 128, "gqa"),
        # meta-llama/Meta-Llama-3-70B: layers 80, heads 64, kv heads 8, hidden_size 8192 (128) -> 327,680 B/token.
        ModelShape("llama-3-70b", 80, 8, 128, "gqa"),
        # mistralai/Mistral-7B-v0.3 (and Instruct-v0.2/v0.3): layers 32, heads 32, kv heads 8, hidden_size 4096 (128),
        # sliding_window null -> 131,072 B/token.
        ModelShape("mistral-7b", 32, 8, 128, "gqa"),
        # mistralai/Mistral-7B-v0.1: the same shape with sliding_window 4096 on every layer -> 131,072 B/token
        # up to 4,096 tokens of context, then the average falls (65,536 at 8,192).
        ModelShape("mistral-7b-v0.1", 32, 8, 128, "gqa", sliding_window=4096, sliding_layers=tuple(range(32))),
        # mistralai/Mixtral-8x7B-v0.1: layers 32, heads 32, kv heads 8, hidden_size 4096 (128), sliding_window null;
        # the 8 experts are MLPs and share attention -> 131,072 B/token.
        ModelShape("mixtral-8x7b", 32, 8, 128, "gqa"),
        # Qwen/Qwen2.5-7B: layers 28, heads 28, kv heads 4, hidden_size 3584 (128), use_sliding_window false
        # -> 28 x 4 x 128 x 2 x 2 = 57,344 B/token.
        ModelShape("qwen2.5-7b", 28, 4, 128, "gqa"),
        # Qwen/Qwen2.5-72B: layers 80, heads 64, kv heads 8, hidden_size 8192 (128), use_sliding_window false
        # -> 327,680 B/token.
        ModelShape("qwen2.5-72b", 80, 8, 128, "gqa"),
        # google/gemma-2-9b: layers 42, heads 16, kv heads 8, head_dim 256, sliding_window 4096 on the even layers
        # (21 sliding, 21 global) -> 42 x 8 x 256 x 2 x 2 = 344,064 B/token up to 4,096 tokens, 258,048 at 8,192.
        ModelShape("gemma-2-9b", 42, 8, 256, "gqa", sliding_window=4096, sliding_layers=_alternating(42)),
        # deepseek-ai/DeepSeek-V3: layers 61, MLA kv_lora_rank 512, qk_rope_head_dim 64 (the MTP module is not
        # counted: serving engines cache only the 61 main layers) -> 61 x 576 x 2 = 70,272 B/token.
        ModelShape("deepseek-v3", 61, 1, 576, "mla", kv_lora_rank=512, qk_rope_head_dim=64),
    )
}

# Hugging Face repository ids (lower-cased) of the same shapes, so traces that name the
# checkpoint they served resolve too. Instruct/chat tunes never change the attention shape.
ALIASES: dict[str, str] = {
    "meta-llama/meta-llama-3-8b": "llama-3-8b",
    "meta-llama/meta-llama-3-8b-instruct": "llama-3-8b",
    "meta-llama/llama-3.1-8b": "llama-3-8b",
    "meta-llama/llama-3.1-8b-instruct": "llama-3-8b",
    "meta-llama/meta-llama-3-70b": "llama-3-70b",
    "meta-llama/meta-llama-3-70b-instruct": "llama-3-70b",
    "meta-llama/llama-3.1-70b": "llama-3-70b",
    "meta-llama/llama-3.1-70b-instruct": "llama-3-70b",
    "meta-llama/llama-3.3-70b-instruct": "llama-3-70b",
    "mistralai/mistral-7b-v0.1": "mistral-7b-v0.1",
    "mistralai/mistral-7b-instruct-v0.1": "mistral-7b-v0.1",
    "mistralai/mistral-7b-instruct-v0.2": "mistral-7b",
    "mistralai/mistral-7b-v0.3": "mistral-7b",
    "mistralai/mistral-7b-instruct-v0.3": "mistral-7b",
    "mistralai/mixtral-8x7b-v0.1": "mixtral-8x7b",
    "mistralai/mixtral-8x7b-instruct-v0.1": "mixtral-8x7b",
    "qwen/qwen2.5-7b": "qwen2.5-7b",
    "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen/qwen2.5-72b": "qwen2.5-72b",
    "qwen/qwen2.5-72b-instruct": "qwen2.5-72b",
    "google/gemma-2-9b": "gemma-2-9b",
    "google/gemma-2-9b-it": "gemma-2-9b",
    "deepseek-ai/deepseek-v3": "deepseek-v3",
    "deepseek-ai/deepseek-v3-base": "deepseek-v3",
    "deepseek-ai/deepseek-r1": "deepseek-v3",
}


class UnknownModelError(ValueError):
    """A model name that is neither in MODELS nor an alias; the message lists the known ones."""


def known_models() -> list[str]:
    return sorted(MODELS)


def get_model(name: str) -> ModelShape:
    """The shape of a known model, by table name or Hugging Face id (case-insensitive)."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    shape = MODELS.get(key)
    if shape is None:
        raise UnknownModelError(
            f"unknown model {name!r}: not in the local Hugging Face cache ({hf_hub_cache()}) nor the built-in table "
            f"({', '.join(known_models())}); give a path to its config.json"
        )
    return shape


# ---- Hugging Face config.json ---------------------------------------------------------------


def _config_int(cfg: Mapping[str, Any], key: str, source: str, *, default: int | None = None) -> int:
    value = cfg.get(key)
    if value is None:
        if default is not None:
            return default
        raise ValueError(f"{source}: missing key {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{source}: {key} must be an integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{source}: {key} must be > 0, got {value!r}")
    return int(value)


def _sliding_layers(cfg: Mapping[str, Any], layers: int, source: str) -> tuple[int, ...]:
    """Which layers a config's sliding_window applies to (the conventions differ per family)."""
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        # Newer transformers configs spell the pattern out per layer.
        if not isinstance(layer_types, list) or len(layer_types) != layers:
            raise ValueError(f"{source}: layer_types must be a list of {layers} entries")
        return tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    model_type = cfg.get("model_type")
    if model_type == "gemma2":
        return _alternating(layers)
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        # Gemma-3: every pattern-th layer (1-based) is global, the others slide.
        return tuple(i for i in range(layers) if (i + 1) % pattern != 0)
    if cfg.get("use_sliding_window") and "max_window_layers" in cfg:
        # Qwen2 family: layers from max_window_layers on use the window.
        first = cfg["max_window_layers"]
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(f"{source}: max_window_layers must be an integer >= 0, got {first!r}")
        return tuple(range(min(first, layers), layers))
    # Mistral, Mixtral, Phi-3 and the like: a set sliding_window applies to every layer.
    return tuple(range(layers))


def shape_from_config_json(path_or_dict: str | os.PathLike[str] | Mapping[str, Any], name: str | None = None) -> ModelShape:
    """A ModelShape from a Hugging Face config.json (a path, a model directory, or the parsed dict)."""
    if isinstance(path_or_dict, Mapping):
        cfg: Mapping[str, Any] = path_or_dict
        source = name or str(cfg.get("_name_or_path") or "config.json")
    else:
        path = os.fspath(path_or_dict)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        source = path
        try:
            with open(path, encoding="utf-8") as f:
                loaded = json.load(f)
        except OSError as exc:
            raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON: {exc.msg} (line {exc.lineno})") from exc
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a JSON object")
        cfg = loaded
        if name is None:
            parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
            name = str(cfg.get("_name_or_path") or parent or "config.json")
    name = name or source
    text = cfg.get("text_config")
    if "num_hidden_layers" not in cfg and isinstance(text, Mapping):
        # Multimodal wrappers (Gemma-3, LLaVA) keep the language model's shape in text_config.
        cfg = text
    layers = _config_int(cfg, "num_hidden_layers", source)
    if cfg.get("kv_lora_rank") is not None:
        rank = _config_int(cfg, "kv_lora_rank", source)
        rope = _config_int(cfg, "qk_rope_head_dim", source)
        return ModelShape(name, layers, 1, rank + rope, "mla", kv_lora_rank=rank, qk_rope_head_dim=rope)
    heads = _config_int(cfg, "num_attention_heads", source)
    kv_heads = _config_int(cfg, "num_key_value_heads", source, default=heads)
    if kv_heads > heads:
        raise ValueError(f"{source}: num_key_value_heads {kv_heads} exceeds num_attention_heads {heads}")
    if cfg.get("head_dim") is not None:
        head_dim = _config_int(cfg, "head_dim", source)
    else:
        hidden = _config_int(cfg, "hidden_size", source)
        if hidden % heads:
            raise ValueError(f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}; give head_dim")
        head_dim = hidden // heads
    attention = "mha" if kv_heads == heads else ("mqa" if kv_heads == 1 else "gqa")
    window = cfg.get("sliding_window")
    sliding: tuple[int, ...] = ()
    # Qwen2 configs carry a sliding_window that is switched off by use_sliding_window = false.
    # A window of 0 (or null) means none.
    if window is not None and window != 0 and cfg.get("use_sliding_window", True) is not False:
        window = _config_int(cfg, "sliding_window", source)
        sliding = _sliding_layers(cfg, layers, source)
    return ModelShape(
        name,
        layers,
        kv_heads,
        head_dim,
        attention,
        sliding_window=window if sliding else None,
        sliding_layers=sliding,
    )


def hf_hub_cache() -> str:
    """The local Hugging Face hub cache, where huggingface_hub puts it (HF_HUB_CACHE, the
    older HUGGINGFACE_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub, then
    ~/.cache/huggingface/hub); read without the library."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return os.path.expanduser(os.environ[variable])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "huggingface", "hub")


def cached_config_json(model: str) -> str | None:
    """The config.json of Hugging Face id ``model`` (``org/name``) in the local hub cache: the
    snapshot ``refs/main`` names, else the newest one that has it; None when not cached. The
    folder is matched case-insensitively, as the hub matches ids."""
    if model.count("/") != 1:
        return None
    hub = hf_hub_cache()
    wanted = "models--" + model.replace("/", "--")
    try:
        folders = [f for f in os.listdir(hub) if f.lower() == wanted.lower()]
    except OSError:
        return None
    for folder in sorted(folders, key=lambda f: f != wanted):  # the exact spelling first
        snapshots = os.path.join(hub, folder, "snapshots")
        try:
            with open(os.path.join(hub, folder, "refs", "main"), encoding="utf-8") as f:
                main = os.path.join(snapshots, f.read().strip(), "config.json")
            if os.path.isfile(main):
                return main
        except OSError:
            pass
        try:
            found = [os.path.join(snapshots, s, "config.json") for s in os.listdir(snapshots)]
        except OSError:
            continue
        found = [path for path in found if os.path.isfile(path)]
        if found:
            return max(found, key=os.path.getmtime)
    return None


def model_config_source(model: str) -> str | None:
    """Where ``resolve_shape`` reads a model's geometry: a config.json path, or None for the
    built-in table."""
    if os.path.exists(model):
        return os.path.join(model, "config.json") if os.path.isdir(model) else model
    return cached_config_json(model)


def resolve_shape(model: str) -> ModelShape:
    """A model's geometry from its config.json: a path (or model directory), or a Hugging
    Face id in the local hub cache (Qwen3, Llama-3.1 and any other model vLLM has run
    here); else the built-in table (MODELS, by name or id).

    Raises ValueError (UnknownModelError for a name that is neither) with a message for the user.
    """
    if os.path.exists(model):
        return shape_from_config_json(model)
    if model.endswith(".json"):
        # Clearly meant as a file: say it is missing rather than listing model names.
        raise ValueError(f"{model}: no such file")
    cached = cached_config_json(model)
    if cached is not None:
        return shape_from_config_json(cached, name=model)
    return get_model(model)
