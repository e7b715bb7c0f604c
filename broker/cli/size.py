"""`kvbroker size`: KV-cache bytes per token, per block and in total for a context length.

Kept apart from broker/cli/main.py so the verb is one ``add_parser(subparsers)`` call to wire in.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from clients import kvsize


def _count(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add the ``size`` verb to the kvbroker command's subparsers."""
    p = subparsers.add_parser("size", help="KV-cache bytes per token, per block and in total for a model and context length")
    p.add_argument("--model", required=True, help=f"model name ({', '.join(kvsize.known_models())}) or path to a Hugging Face config.json")
    p.add_argument("--tokens", required=True, type=_count(0), help="context length in tokens")
    p.add_argument("--block-tokens", type=_count(1), default=16, help="tokens per KV block (default 16, vLLM's)")
    p.add_argument("--dtype", choices=list(kvsize.DTYPE_BYTES), default="fp16", help="KV-cache scalar type (default fp16)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=cmd_size)
    return p


def size_record(shape: kvsize.ModelShape, tokens: int, block_tokens: int, dtype: str) -> dict[str, Any]:
    """The figures `kvbroker size` reports (its --json fields are a contract)."""
    dtype_bytes = kvsize.DTYPE_BYTES[dtype]
    # Sliding-window layers are averaged over this context, so per-token and per-block bytes
    # are the ones that make blocks x bytes_per_block the footprint of `tokens` tokens.
    per_token = kvsize.bytes_per_token(shape, dtype_bytes, tokens)
    per_block = kvsize.bytes_per_block(shape, block_tokens, dtype_bytes, tokens)
    blocks = kvsize.blocks_for(tokens, block_tokens)
    return {
        "model": shape.name,
        "attention": shape.attention,
        "layers": shape.layers,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "dtype": dtype,
        "dtype_bytes": dtype_bytes,
        "sliding_window": shape.sliding_window,
        "sliding_layers": len(shape.sliding_layers),
        "bytes_per_token": per_token,
        "block_tokens": block_tokens,
        "bytes_per_block": per_block,
        "tokens": tokens,
        "blocks": blocks,
        # Allocation is per block, so a partly filled last block costs a whole one.
        "total_bytes": blocks * per_block,
    }


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n:,} B" if unit == "B" else f"{n:,} B ({value:.2f} {unit})"
        value /= 1024
    raise AssertionError("unreachable")


def cmd_size(args: argparse.Namespace) -> int:
    try:
        shape = kvsize.resolve_shape(args.model)
    except ValueError as exc:
        print(f"kvbroker size: --model: {exc}", file=sys.stderr)
        return 2
    block_tokens = getattr(args, "block_tokens", 16)
    dtype = getattr(args, "dtype", "fp16")
    if dtype not in kvsize.DTYPE_BYTES:
        print(f"kvbroker size: --dtype: unknown {dtype!r} (one of {', '.join(kvsize.DTYPE_BYTES)})", file=sys.stderr)
        return 2
    if args.tokens < 0 or block_tokens < 1:
        print("kvbroker size: --tokens must be >= 0 and --block-tokens >= 1", file=sys.stderr)
        return 2
    rec = size_record(shape, args.tokens, block_tokens, dtype)
    if getattr(args, "json", False):
        print(json.dumps(rec, indent=2))
        return 0
    if shape.attention == "mla":
        latent = f"kv_lora_rank {shape.kv_lora_rank} + rope {shape.qk_rope_head_dim}"
        layout = f"{shape.layers} layers x one latent of {shape.head_dim} ({latent})"
    else:
        layout = f"{shape.layers} layers x {shape.kv_heads} kv heads x head_dim {shape.head_dim} x K,V"
    print(f"model            {shape.name} ({shape.attention}: {layout})")
    if shape.sliding_layers:
        where = f"{len(shape.sliding_layers)} of {shape.layers} layers"
        print(f"sliding window   {shape.sliding_window:,} tokens on {where} (averaged over the context)")
    print(f"dtype            {dtype} ({rec['dtype_bytes']:g} bytes per scalar)")
    print(f"bytes per token  {_human(rec['bytes_per_token'])}")
    print(f"bytes per block  {_human(rec['bytes_per_block'])} ({block_tokens} tokens)")
    print(f"tokens           {rec['tokens']:,} -> {rec['blocks']:,} blocks")
    print(f"total            {_human(rec['total_bytes'])}")
    return 0
