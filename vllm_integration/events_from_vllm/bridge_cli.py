"""`kvbroker vllm-bridge`: stream a vLLM engine's KV-cache events into the broker.

Kept apart from broker/cli/main.py so the verb is one ``add_parser(subparsers)`` call to wire in.
Prints one JSON line when it starts (``{"event": "bridging", ...}``), one every
``--stats-interval`` seconds (``{"event": "stats", ...}``) and one when it stops
(``{"event": "stopped", ...}`` with every counter); exits 0 on SIGTERM/SIGINT, 1 if the
broker refused the bridge for good, 2 on a bad argument. docs/vllm-bridge.md is the guide.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import signal
import sys

from clients import kvsize
from clients.broker_client import BrokerError, WhenFull
from vllm_integration.events_from_vllm.to_intents import DEFAULT_TIER_MAP, format_tier_map, parse_tier_map


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0, got 0")
    return value


def _endpoint(text: str) -> str:
    """A ZMQ endpoint the bridge can connect to: tcp://HOST:PORT (what vLLM's
    kv_events_config names, with the host it runs on for ``*``), or ipc://PATH."""
    if text.startswith("ipc://") and len(text) > len("ipc://"):
        return text
    host, sep, port = text.removeprefix("tcp://").rpartition(":")
    if text.startswith("tcp://") and port == "0":
        raise argparse.ArgumentTypeError(f"{text!r}: port 0 is chosen by the OS (per rank); give vLLM and the bridge a fixed port")
    if not text.startswith("tcp://") or not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT (port 1..65535) or ipc://PATH, got {text!r}")
    if host == "*":
        raise argparse.ArgumentTypeError(f"{text!r} is where vLLM binds; connect to the host it runs on: tcp://HOST:{port}")
    return text


def _host_port(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port in 1..65535, got {text!r}")
    return text


def _tier_map(text: str) -> tuple[tuple[str, str], ...]:
    try:
        return parse_tier_map(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add the ``vllm-bridge`` verb to the kvbroker command's subparsers."""
    p = subparsers.add_parser("vllm-bridge", help="stream a vLLM engine's KV-cache events (ZMQ) into the broker")
    p.add_argument("--events", required=True, type=_endpoint, help="vLLM's KV-events PUB endpoint, tcp://HOST:5557 (rank r: port + r)")
    p.add_argument(
        "--replay",
        type=_endpoint,
        help="vLLM's replay ROUTER endpoint, tcp://HOST:5657 (rank r: port + r; keep it --dp-size ports away from --events); "
        "gaps are filled and engine restarts told from losses with it",
    )
    p.add_argument("--topic", default="", help="topic prefix to subscribe to (vLLM's kv_events_config topic; default all)")
    p.add_argument("--broker", required=True, type=_host_port, help="HOST:PORT of the broker")
    p.add_argument(
        "--model",
        required=True,
        help="a path to a config.json (or its folder), a Hugging Face id in the local hub cache (its config.json), "
        f"or a built-in name ({', '.join(kvsize.known_models())})",
    )
    p.add_argument("--dtype", choices=list(kvsize.DTYPE_BYTES), default="fp16", help="KV-cache scalar type (default fp16)")
    p.add_argument("--block-bytes", type=_positive, help="bytes per block, instead of the model's figure")
    p.add_argument(
        "--tier-map",
        type=_tier_map,
        default=DEFAULT_TIER_MAP,
        help=f"vLLM medium to broker tier, top tier first; * for any other medium (default {format_tier_map(DEFAULT_TIER_MAP)})",
    )
    p.add_argument("--dp-size", type=_positive, default=1, help="data-parallel ranks: 0..N-1, each on port + rank (default 1)")
    p.add_argument(
        "--dp-start-rank",
        type=_non_negative,
        default=0,
        help="first data-parallel rank served (vLLM's --data-parallel-start-rank on this node; default 0)",
    )
    p.add_argument(
        "--offload-block-size",
        type=_positive,
        help="tokens of an offloaded copy vLLM announces with block_size 0 and no other copy gives a size to "
        "(vLLM's kv_connector_extra_config block_size; default: the last GPU block size seen)",
    )
    p.add_argument("--prefill-tokens-per-s", type=_rate, help="the engine's prefill rate: blocks then carry recompute_cost_us")
    p.add_argument(
        "--gpu-reuse-reports",
        action="store_true",
        help="requests use kv_cache_report_mode=full: a GPU store of a block already on the GPU is a reuse report, not another copy",
    )
    p.add_argument(
        "--stats-interval", type=_seconds, default=0.0, help="print the counters as a JSON line every this many seconds (0: never)"
    )
    p.add_argument(
        "--stats-file", metavar="PATH", help="write the counters as JSON to PATH, atomically, every --stats-interval (default 10) seconds"
    )
    p.add_argument("--client-id", default="vllm", help="client id prefix; rank r is <prefix>-dp<r> (default vllm)")
    p.add_argument("--tenant", default="", help="tenant of every block")
    p.add_argument("--capture", metavar="PATH", help="also write what is received to PATH (replay it with --format vllm-events)")
    p.add_argument(
        "--when-full",
        choices=[w.value for w in WhenFull],
        default=WhenFull.BLOCK.value,
        help="when --max-pending-batches are unanswered: block (back up into ZMQ; replay repairs), drop_oldest, raise",
    )
    p.add_argument("--max-pending-batches", type=_positive, default=1024, help="unanswered batches per rank (default 1024)")
    p.add_argument("--replay-timeout", type=_positive_seconds, default=2.0, help="seconds to wait for a replay reply (default 2)")
    p.add_argument("--no-clear-on-start", action="store_true", help="keep what the broker holds for these client ids")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_vllm_bridge)
    return p


def _check_paths(args: argparse.Namespace) -> str | None:
    """The model and the files the bridge writes, checked before it starts: the flag and the
    reason, or None."""
    import os

    try:
        kvsize.resolve_shape(args.model)
    except ValueError as exc:
        return f"--model: {exc}"
    for flag, path in (("--capture", args.capture), ("--stats-file", args.stats_file)):
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            return f"{flag}: {path} is a folder; give a file path"
        if not os.path.isdir(folder):
            return f"{flag}: folder {folder} does not exist"
    return None


def cmd_vllm_bridge(args: argparse.Namespace) -> int:
    from vllm_integration.events_from_vllm.bridge import BridgeConfig, VllmBridge

    problem = _check_paths(args)
    if problem:
        print(f"kvbroker vllm-bridge: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = BridgeConfig(
            events=args.events,
            broker=args.broker,
            model=args.model,
            replay=args.replay,
            topic=args.topic,
            dp_size=args.dp_size,
            client_id=args.client_id,
            tier_map=args.tier_map,
            dtype=args.dtype,
            block_bytes=args.block_bytes,
            tenant=args.tenant,
            capture=args.capture,
            when_full=args.when_full,
            max_pending_batches=args.max_pending_batches,
            replay_timeout_s=args.replay_timeout,
            clear_on_start=not args.no_clear_on_start,
            dp_start_rank=args.dp_start_rank,
            offload_block_size=args.offload_block_size,
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            gpu_reuse_reports=args.gpu_reuse_reports,
            stats_interval_s=args.stats_interval or (10.0 if args.stats_file else 0.0),
            stats_file=args.stats_file,
        )
        bridge = VllmBridge(config)
    except (ValueError, OSError) as exc:
        print(f"kvbroker vllm-bridge: {exc}", file=sys.stderr)
        return 2

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        clients = [rank.client_id for rank in bridge.ranks]
        print(json.dumps({"event": "bridging", "clients": clients, "events": [r.events_endpoint for r in bridge.ranks]}), flush=True)
        if args.stats_interval:
            bridge.on_stats = lambda snapshot: print(json.dumps({"event": "stats", **snapshot}), flush=True)
        code = 0
        try:
            await bridge.run(stop)
        except BrokerError as exc:
            print(f"kvbroker vllm-bridge: {exc}", file=sys.stderr)
            code = 1
        print(json.dumps({"event": "stopped", **bridge.snapshot()}), flush=True)
        return code

    return asyncio.run(main())
