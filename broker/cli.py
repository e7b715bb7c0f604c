"""The `kvbroker` command. Verbs, flags and --json field names are contracts (README.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Any

from broker.config import ConfigError, load_config


def _split_policies(values: list[str] | None) -> list[str]:
    out: list[str] = []
    for value in values or []:
        out.extend(p.strip() for p in value.split(",") if p.strip())
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    from broker.server import run

    config = load_config(args.config)
    if args.listen:
        config = dataclasses.replace(config, listen=args.listen)
    if args.journal:
        config = dataclasses.replace(config, journal=dataclasses.replace(config.journal, url=args.journal))
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def ready(broker: Any) -> None:
        # One machine-readable line so wrappers and tests can find the port (listen on :0).
        print(json.dumps({"event": "listening", "port": broker.port, "policy": broker.service.core.policy_name}), flush=True)

    run(config, on_ready=ready)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import grpc

    from clients.admin import get_stats

    try:
        stats = get_stats(args.target, timeout=args.timeout)
    except grpc.RpcError as exc:
        print(f"kvbroker status: cannot reach {args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    tiers = [
        {"name": t.name, "blocks": t.blocks, "bytes": t.bytes, "capacity_bytes": t.capacity_bytes, "pinned_bytes": t.pinned_bytes}
        for t in stats.tiers
    ]
    record: dict[str, Any] = {
        "broker_id": stats.broker_id,
        "policy": stats.policy,
        "config_generation": stats.config_generation,
        "tiers": tiers,
        "events": dict(sorted(stats.events.items())),
        "directives": dict(sorted(stats.directives.items())),
        "batches": stats.batches,
        "duplicate_batches": stats.duplicate_batches,
        "rejected_events": stats.rejected_events,
        "accesses_by_tier": {(k or "dropped"): v for k, v in sorted(stats.accesses_by_tier.items())},
        "decode_critical_accesses": stats.decode_critical_accesses,
        "decode_critical_misses": stats.decode_critical_misses,
        "journal": stats.journal,
        "journal_pending": stats.journal_pending,
        "journal_written": stats.journal_written,
        "journal_errors": stats.journal_errors,
        "clients": stats.clients,
    }
    if args.json:
        print(json.dumps(record, indent=2))
        return 0
    print(f"broker {record['broker_id']}  policy {record['policy']}  config generation {record['config_generation']}")
    print(f"{'tier':<8} {'blocks':>10} {'bytes':>16} {'capacity':>16} {'pinned':>16}")
    for t in tiers:
        print(f"{t['name']:<8} {t['blocks']:>10} {t['bytes']:>16} {t['capacity_bytes']:>16} {t['pinned_bytes']:>16}")
    print("events:     " + ", ".join(f"{k} {v}" for k, v in record["events"].items()))
    print("directives: " + ", ".join(f"{k} {v}" for k, v in record["directives"].items()))
    print(f"batches {record['batches']} (duplicates {record['duplicate_batches']}), rejected events {record['rejected_events']}")
    print(
        f"journal {record['journal']}: written {record['journal_written']}, "
        f"pending {record['journal_pending']}, errors {record['journal_errors']}"
    )
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from broker.config import CoreConfig
    from broker.journal import JournalError, open_source
    from broker.replay import format_table, replay_source
    from policies import registry

    policies = _split_policies(args.policy) or registry.names()
    core: CoreConfig | None = load_config(args.config).core if args.config else None
    try:
        results = replay_source(open_source(args.journal, args.stream), policies, core, verify=args.verify)
    except JournalError as exc:
        print(f"kvbroker replay: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([r.as_record() for r in results], indent=2))
    else:
        print(format_table(results))
    failed = [r for r in results if r.mismatches]
    if failed:
        bad = failed[0]
        print(f"kvbroker replay: {bad.policy} did not reproduce the journaled directives: {bad.first_mismatch}", file=sys.stderr)
        return 1
    if args.verify and not any(r.mismatches is not None for r in results):
        print("kvbroker replay: --verify: the live policy was not replayed, or the journal kept no directives", file=sys.stderr)
        return 1
    return 0


def cmd_policies(args: argparse.Namespace) -> int:
    from policies import registry

    rows = [registry.describe(registry.policy_class(name)) for name in registry.names()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        params = ", ".join(f"{k}={v}" for k, v in r["params"].items()) or "no parameters"
        offline = " [replay only]" if r["offline"] else ""
        print(f"{r['name']:<{width}}  {r['description']}{offline}  ({params})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from broker.demo import main as demo_main

    return demo_main(requests=args.requests, seed=args.seed, keep=args.keep)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbroker", description="gRPC memory-intent broker for the KV cache of LLM inference servers")
    sub = parser.add_subparsers(dest="verb", required=True)

    p = sub.add_parser("serve", help="run the broker")
    p.add_argument("--config", help="TOML config file (defaults: HBM/DRAM/NVMe tiers, lru, file journal)")
    p.add_argument("--listen", help="HOST:PORT to listen on (overrides broker.listen; port 0 picks a free one)")
    p.add_argument("--journal", help="redis://HOST:PORT/DB, file://PATH or none (overrides journal.url)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("status", help="show a running broker's policy, tiers and counters")
    p.add_argument("--target", required=True, help="HOST:PORT of the broker")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--timeout", type=float, default=5.0)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("replay", help="replay a journal through one or more policies and compare them")
    p.add_argument("--journal", required=True, help="file://PATH or redis://HOST:PORT/DB[?stream=KEY]")
    p.add_argument("--stream", help="Redis stream key (default: from the URL)")
    p.add_argument("--policy", action="append", help="policy to run (repeat, or comma-separated; default: all)")
    p.add_argument("--config", help="config whose tiers to replay on (default: the one the journal recorded)")
    p.add_argument("--verify", action="store_true", help="fail unless the live policy's directives are reproduced exactly")
    p.add_argument("--json", action="store_true", help="a JSON array, one record per policy")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("policies", help="list the policies with their parameters")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_policies)

    p = sub.add_parser("demo", help="broker + demo workload over real gRPC, then a replay comparison table")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--keep", metavar="DIR", help="keep the journal in DIR instead of a temporary directory")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
        return result
    except ConfigError as exc:
        print(f"kvbroker {args.verb}: config: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
