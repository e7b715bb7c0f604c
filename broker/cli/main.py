"""The `kvbroker` command. Verbs, flags and --json field names are contracts (README.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from broker import native
from broker.cli.checks import (
    BadInput,
    OneLineParser,
    check_keep_dir,
    check_new_or_regular,
    check_readable,
    check_writable_dir,
    check_writable_file,
    host_port,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
    say,
)
from broker.config import ConfigError, load_config, parse_config
from broker.extras import clone_command, install_hint, package_version
from broker.journal.records import JournalError
from broker.replay.engines import ENGINES
from broker.replay.engines import missing as missing_engine


def _config(path: str | None) -> Any:
    """The config file of --config (the defaults without one); its mistakes name --config."""
    try:
        return load_config(path)
    except ConfigError as exc:
        raise BadInput("--config", str(exc)) from None


def _split_policies(values: list[str] | None) -> list[str]:
    out: list[str] = []
    for value in values or []:
        out.extend(p.strip() for p in value.split(",") if p.strip())
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    from broker.logs import setup_logging
    from broker.service.server import run
    from broker.service.telemetry import validate_telemetry

    def with_flags(config: Any) -> Any:
        """The command line wins over the file, at start and on every reload of the file."""
        if args.listen:
            config = dataclasses.replace(config, listen=args.listen)
        if args.journal:
            config = dataclasses.replace(config, journal=dataclasses.replace(config.journal, url=args.journal))
        overrides = {
            "prometheus_port": args.metrics_port,
            "prometheus_host": args.metrics_host,
            "otlp_endpoint": args.otlp_endpoint,
            "traces": args.traces,
            "log_format": args.log_format,
        }
        telemetry = dataclasses.replace(config.telemetry, **{k: v for k, v in overrides.items() if v is not None})
        validate_telemetry(telemetry)  # a ConfigError naming telemetry.<key>, as for the file
        return dataclasses.replace(config, telemetry=telemetry)

    from broker.cli.serve_checks import preflight

    config = with_flags(_config(args.config))
    metrics_flags = args.metrics_port is not None or args.metrics_host is not None
    # Before the first log line: a mistake is then the one line on stderr.
    preflight(config, listen_flag=bool(args.listen), journal_flag=bool(args.journal), metrics_flags=metrics_flags)
    setup_logging(args.log_level, config.telemetry.log_format)

    def ready(broker: Any) -> None:
        # One machine-readable line so wrappers and tests can find the port (listen on :0).
        line = {"event": "listening", "port": broker.port, "policy": broker.service.policy_name}
        line["metrics_port"] = broker.telemetry.metrics_port if broker.telemetry is not None else None
        print(json.dumps(line), flush=True)

    try:
        run(config, args.config, on_ready=ready, overrides=with_flags)
    except OSError as exc:
        # One line, not a traceback: a port in use (a journal held by another broker is a
        # JournalError, said by main()).
        print(f"kvbroker serve: {exc}", file=sys.stderr)
        return 2
    return 0


def _security_flags(p: argparse.ArgumentParser) -> None:
    """How a tool reaches a secured broker; each flag defaults to its KVBROKER_* variable."""
    p.add_argument("--tls-ca", help="PEM CA of the broker's certificate: connect over TLS (env KVBROKER_TLS_CA)")
    p.add_argument("--tls-cert", help="PEM client certificate, for mutual TLS (env KVBROKER_TLS_CERT)")
    p.add_argument("--tls-key", help="PEM key of --tls-cert (env KVBROKER_TLS_KEY)")
    p.add_argument("--tls-server-name", help="name the broker's certificate is checked for (env KVBROKER_TLS_SERVER_NAME)")
    p.add_argument("--token-file", help="file holding the bearer token (env KVBROKER_TOKEN_FILE, or the token in KVBROKER_TOKEN)")


def _client_security(args: argparse.Namespace) -> Any:
    """The command line over the KVBROKER_* environment (the token is never a flag: ps shows flags)."""
    from clients.broker_client import ClientSecurity, check_pem, read_token

    for flag in ("tls_ca", "tls_cert", "tls_key", "token_file"):
        if getattr(args, flag):
            check_readable(getattr(args, flag), "--" + flag.replace("_", "-"))
    env = ClientSecurity.from_env()
    security = dataclasses.replace(
        env,
        tls_ca=args.tls_ca or env.tls_ca,
        tls_cert=args.tls_cert or env.tls_cert,
        tls_key=args.tls_key or env.tls_key,
        server_name=args.tls_server_name or env.server_name,
        token=read_token(args.token_file) if args.token_file else env.token,
    )
    # Before connecting: a file that is no certificate is a certificate error naming its
    # flag (or variable), not gRPC's handshake noise and "cannot reach".
    names = {
        key: f"--{key.replace('_', '-')}" if getattr(args, key) else f"KVBROKER_{key.upper()}" for key in ("tls_ca", "tls_cert", "tls_key")
    }
    try:
        check_pem(security, names)
    except ValueError as exc:
        field, _, reason = str(exc).partition(" ")
        raise BadInput(field, reason) from None
    return security


def _stats_or_none(verb: str, args: argparse.Namespace) -> Any:
    """GetStats of --target, or None after saying on stderr why it could not be had."""
    import grpc

    from clients.admin import get_stats

    try:
        return get_stats(args.target, timeout=args.timeout, security=_client_security(args))
    except ValueError as exc:  # a certificate or token file that cannot be read
        print(f"kvbroker {verb}: {exc}", file=sys.stderr)
        return None
    except grpc.RpcError as exc:
        print(f"kvbroker {verb}: --target: cannot reach {args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return None


def _reachable(args: argparse.Namespace, verb: str) -> None:
    """--target answers GetStats (before a benchmark prints its header)."""
    import grpc

    from clients.admin import get_stats

    try:
        get_stats(args.target, timeout=5.0)
    except grpc.RpcError as exc:
        raise BadInput("--target", f"cannot reach {args.target}: {exc.code().name}: {exc.details()}") from None


def status_record(stats: Any) -> dict[str, Any]:
    """The `kvbroker status --json` object of a GetStats reply (its field names are a contract)."""
    tiers = [
        {"name": t.name, "blocks": t.blocks, "bytes": t.bytes, "capacity_bytes": t.capacity_bytes, "pinned_bytes": t.pinned_bytes}
        for t in stats.tiers
    ]
    return {
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
        "journal_spool_records": stats.journal_spool_records,
        "journal_spool_bytes": stats.journal_spool_bytes,
        "journal_dropped": stats.journal_dropped,
        "clients": stats.clients,
        "outstanding_directives": stats.outstanding_directives,
        "max_outstanding_directives": stats.max_outstanding_directives,
        "refused_batches": dict(sorted(stats.refused_batches.items())),
        "refused_streams": dict(sorted(stats.refused_streams.items())),
        "revoked_streams": stats.revoked_streams,
    }


def cmd_status(args: argparse.Namespace) -> int:
    stats = _stats_or_none("status", args)
    if stats is None:
        return 2
    record = status_record(stats)
    tiers = record["tiers"]
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
    if record["journal"] == "none":
        # "written N" would claim records kept: journal none keeps nothing.
        print("journal none: nothing is journaled (a restart starts empty; replay has nothing to read)")
    else:
        print(
            f"journal {record['journal']}: written {record['journal_written']}, "
            f"pending {record['journal_pending']}, errors {record['journal_errors']}, "
            f"spooled {record['journal_spool_records']} ({record['journal_spool_bytes']} bytes), dropped {record['journal_dropped']}"
        )
    print(f"unacknowledged directives {record['outstanding_directives']} (at most {record['max_outstanding_directives']} kept)")
    refused = ", ".join(f"{k} {v}" for k, v in record["refused_batches"].items()) or "none"
    print(f"refused batches: {refused}; refused streams: {sum(record['refused_streams'].values())}, revoked {record['revoked_streams']}")
    return 0


def _capacity_combos(args: argparse.Namespace, bytes_per_token: int) -> list[dict[int, int]]:
    """Cartesian product of --hbm/--dram/--nvme lists: tier position -> bytes."""
    from broker.replay.sweep import parse_capacity

    combos: list[dict[int, int]] = [{}]
    for position, flag in enumerate(("hbm", "dram", "nvme")):
        value = getattr(args, flag)
        if not value:
            continue
        try:
            sizes = [parse_capacity(v.strip(), bytes_per_token, f"--{flag}") for v in value.split(",") if v.strip()]
        except ConfigError as exc:
            raise BadInput(f"--{flag}", str(exc).removeprefix(f"--{flag}: ")) from None
        # An empty list would sweep nothing (an empty table, exit 0), and a tier of 0 bytes
        # holds no block: both are slips, said before any process starts.
        if not sizes:
            raise BadInput(f"--{flag}", f"no size in {value!r}; give one or more, e.g. 4GiB,16GiB or 1000000tok")
        if min(sizes) <= 0:
            raise BadInput(f"--{flag}", f"each size must be > 0 (a tier of 0 bytes holds no block), got {value!r}")
        combos = [{**c, position: size} for c in combos for size in sizes]
    return combos


def _write_csv(records: list[dict[str, Any]], target: str) -> None:
    import csv
    import io

    flat = []
    for rec in records:
        row: dict[str, Any] = {}
        for key, value in rec.items():
            if key == "latency_hist":
                continue  # buckets, not a column: in --json
            if isinstance(value, dict):
                for sub_key, sub_value in value.items():
                    row[f"{key}.{sub_key}"] = sub_value
            else:
                row[key] = value
        flat.append(row)
    fields = list(dict.fromkeys(k for row in flat for k in row))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields)
    writer.writeheader()
    writer.writerows(flat)
    if target == "-":
        sys.stdout.write(buffer.getvalue())
    else:
        with open(target, "w", encoding="utf-8", newline="") as f:
            f.write(buffer.getvalue())


ARM_FIELDS = (
    "name",
    "policy",
    "role",
    "accesses",
    "hit_rate",
    "decode_critical_accesses",
    "decode_critical_misses",
    "mean_latency_us",
    "p99_latency_us",
    "evictions",
    "demotions",
    "prefetches",
    "bytes_moved",
    "deadline_misses",
    "clients",
)


def cmd_ab(args: argparse.Namespace) -> int:
    """The primary policy and its shadows, or the split arms, side by side, from a running broker."""
    stats = _stats_or_none("ab", args)
    if stats is None:
        return 2
    arms = [{field: getattr(arm, field) for field in ARM_FIELDS} for arm in stats.arms]
    if args.json:
        print(json.dumps({"config_generation": stats.config_generation, "arms": arms}, indent=2))
        return 0
    print(f"config generation {stats.config_generation}")
    print(
        f"{'arm':<20} {'role':<8} {'clients':>7} {'accesses':>10} {'hit_rate':>9} {'dc_miss':>8} "
        f"{'mean_us':>9} {'p99_us':>9} {'evict':>7} {'demote':>7} {'prefetch':>8}"
    )
    for a in arms:
        dc = a["decode_critical_misses"] / a["decode_critical_accesses"] if a["decode_critical_accesses"] else 0.0
        print(
            f"{a['name']:<20} {a['role']:<8} {a['clients']:>7} {a['accesses']:>10} {a['hit_rate']:>9.4f} {dc:>8.4f} "
            f"{a['mean_latency_us']:>9.1f} {a['p99_latency_us']:>9} {a['evictions']:>7} {a['demotions']:>7} {a['prefetches']:>8}"
        )
    return 0


def _replay_kvds_compat(args: argparse.Namespace, policies: list[str]) -> int:
    """--kvds-compat: the seed simulator's importer rules and cost model (broker/replay/kvds_compat.py)."""
    from broker.replay.kvds_compat import MIB, run_cli
    from broker.replay.sweep import parse_capacity
    from broker.replay.traces import TraceError
    from policies import registry
    from policies.base import PolicyError

    if not (args.policy or args.policies):  # the offline ones need a future this mode has not
        policies = [name for name in policies if not registry.policy_class(name).offline]
    if not args.trace or args.format != "kvds-events":
        print("kvbroker replay: --kvds-compat needs --trace PATH --format kvds-events", file=sys.stderr)
        return 2
    try:
        hbm = [parse_capacity(x.strip(), 1, "--hbm") for x in (args.hbm or "128MiB").split(",")]
        if min(hbm) <= 0:
            raise BadInput("--hbm", f"each size must be > 0 (a tier of 0 bytes holds no block), got {args.hbm!r}")
        dram = parse_capacity(args.dram, 1, "--dram") if args.dram else 4096 * MIB
        return run_cli(args.trace, policies, hbm, dram, args.json, args.skip_bad)
    except (ConfigError, TraceError, PolicyError) as exc:
        print(f"kvbroker replay: {exc}", file=sys.stderr)
        return 2


def cmd_replay(args: argparse.Namespace) -> int:
    from broker.journal import JournalError, open_source
    from broker.replay.fleet import with_fleet_totals
    from broker.replay.grid import parse_params
    from broker.replay.plan import PlannedSource, SweepSpec, plan_jobs
    from broker.replay.replay import journal_config
    from broker.replay.sweep import Source, SweepInterrupted, run_jobs, single_tier
    from broker.replay.traces import TraceError
    from policies import registry
    from policies.base import PolicyError

    if bool(args.journal) == bool(args.trace):
        print("kvbroker replay: --journal/--trace: give either --journal URL (one or more) or --trace PATH --format F", file=sys.stderr)
        return 2
    policies = _split_policies(args.policy) + _split_policies(args.policies) or registry.names()
    for flag, values in (("--policy", args.policy), ("--policies", args.policies)):
        if values is not None and not _split_policies(values):  # `--policies ''` is a slip, not "all"
            raise BadInput(flag, f"no policy name in {','.join(values)!r}; leave the flag out to run every policy")
    try:
        for name in policies:
            registry.policy_class(name)
    except PolicyError as exc:
        print(f"kvbroker replay: --policy: {exc}", file=sys.stderr)
        return 2
    if args.trace:
        _check_trace(args)
    _check_outputs(args)
    options = _trace_options(args)
    if args.kvds_compat:
        return _replay_kvds_compat(args, policies)
    try:
        grid = parse_params(args.param, policies)
    except PolicyError as exc:
        message = str(exc)  # grid's own messages name the flag: "--param FLAG: ..."
        print(f"kvbroker replay: {message if message.startswith('--param') else '--param: ' + message}", file=sys.stderr)
        return 2
    try:
        planned: list[PlannedSource] = []
        if args.journal:
            for url, stream in _journals(args):
                journal = open_source(url, stream)
                try:
                    journal.check()
                    recorded = journal_config(journal)
                except JournalError as exc:
                    raise BadInput("--journal", str(exc)) from None
                _warn_torn(url)
                live_policy = recorded.policy.name if recorded else None
                if recorded is not None and recorded.policy.split:
                    from broker.model.arms import split_label

                    live_policy = split_label(recorded.policy.split)  # verified by following the journal
                base = _config(args.config).core if args.config else recorded
                if base is None:
                    why = f"the journal {journal.url} holds no config record (the tiers to replay on); pass --config"
                    raise BadInput("--config", why)
                planned.append(PlannedSource(Source(journal=url, stream=stream, options=options), base, live_policy))
        else:
            if args.engine:
                _check_engine(args)
            if args.config:
                base = _config(args.config).core
            elif args.engine or (args.no_decode and args.format != "profile"):
                if not args.hbm:
                    what = "--engine replays vLLM's CPU tier" if args.engine else "--no-decode without --config replays one cache tier"
                    print(f"kvbroker replay: --hbm: {what}: give its size with --hbm", file=sys.stderr)
                    return 2
                base = single_tier(0)
            else:
                base = _trace_base_config(args.trace, args.format)
            planned.append(PlannedSource(Source(trace=args.trace, fmt=args.format, options=options, engine=args.engine or ""), base))
        spec = SweepSpec(
            policies,
            grid,
            _capacity_combos(args, args.bytes_per_token),
            quant=args.quant,
            verify=args.verify,
            ablate_intent=args.ablate_intent,
        )
        try:
            jobs = plan_jobs(planned, spec)
        except ConfigError as exc:  # a tier size for a tier the config does not have
            print(f"kvbroker replay: {exc}", file=sys.stderr)
            return 2
        workers = args.jobs or min(len(jobs), os.cpu_count() or 1)
        if args.trace:
            _warn_long_run(args, options, len(jobs), workers)
        if args.ray is not None:
            from broker.replay.ray_runner import RayMissing, SweepFailed, run_jobs_on_ray

            try:
                records = run_jobs_on_ray(jobs, args.ray or None, num_cpus=args.jobs or None)
            except RayMissing as exc:
                print(f"kvbroker replay: {exc}", file=sys.stderr)  # "--ray needs Ray, ..."
                return 2
            except SweepFailed as exc:
                print(f"kvbroker replay: {exc}", file=sys.stderr)
                return 1
            except KeyboardInterrupt:
                print("kvbroker replay: interrupted; the Ray tasks not yet done were cancelled", file=sys.stderr)
                return 130
        else:
            try:
                records = run_jobs(jobs, workers, progress=True if args.progress else None)
            except SweepInterrupted as stopped:
                return _interrupted(args, stopped)
    except JournalError as exc:
        print(f"kvbroker replay: --journal: {exc}", file=sys.stderr)
        return 2
    except TraceError as exc:
        print(f"kvbroker replay: --trace: {exc}", file=sys.stderr)
        return 2
    except PolicyError as exc:
        print(f"kvbroker replay: --policy: {exc}", file=sys.stderr)
        return 2
    if len(planned) > 1:
        records = with_fleet_totals(records, [job.combo for job in jobs])
    tails = _check_tails(planned, records) if args.verify else []
    snapshots = _check_snapshots(planned, records) if args.verify else []
    _write_records(args, records, len(planned))
    skipped = max((r["skipped_lines"] for r in records), default=0)
    if skipped:
        print(f"kvbroker replay: skipped {skipped} bad line(s) (--skip-bad)", file=sys.stderr)
    failed = [r for r in records if r["mismatches"]]
    if failed:
        bad = failed[0]
        print(
            f"kvbroker replay: {bad['policy']} did not reproduce the journaled directives of {bad['source']}: {bad.get('first_mismatch')}",
            file=sys.stderr,
        )
        return 1
    if args.verify:
        unverified = _unverified(planned, records, policies)
        for line in unverified:
            print(f"kvbroker replay: --verify: {line}", file=sys.stderr)
        if unverified:
            return 1
    for label, tail in tails:
        if tail.message:
            print(f"kvbroker replay: --verify: {label}: {tail.message}", file=sys.stderr)
    for label, check in snapshots:
        if check.wrong:
            print(f"kvbroker replay: --verify: {label}: {check.wrong} of {check.checked} snapshots wrong; {check.message}", file=sys.stderr)
    return 1 if any(tail.state == "cut" for _, tail in tails) or any(check.wrong for _, check in snapshots) else 0


def _check_snapshots(planned: list[Any], records: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """--verify: each snapshot a journal holds equals the replay's state at its mark
    (broker.replay.snapshot_check); its records get ``snapshots_checked`` and ``snapshots_wrong``."""
    from broker.journal import JournalSource
    from broker.replay.snapshot_check import check_snapshots

    out = []
    for item in planned:
        source = item.source
        if source.journal is None:
            continue
        check = check_snapshots(JournalSource(source.journal, source.stream))
        for record in records:
            if record["source"] == source.label:
                record["snapshots_checked"] = check.checked
                record["snapshots_wrong"] = check.wrong
        out.append((source.label, check))
    return out


def _unverified(planned: list[Any], records: list[dict[str, Any]], policies: list[str]) -> list[str]:
    """--verify: the journals no row verified, each with why (one source or a fleet's
    each: a fleet row verifies only the pods whose live policy it replayed)."""
    out = []
    for item in planned:
        label = item.source.label
        if item.source.journal is None or any(r["verified"] is not None for r in records if r["source"] == label):
            continue
        live = item.live_policy
        if live is None:
            why = "it holds no config record naming its live policy"
        elif live.startswith("split(") or live in policies:
            why = f"its live policy {live} was replayed, but the journal kept no directives (journal.directives = false)"
        else:
            why = f"its live policy {live} was not replayed (add --policy {live})"
        out.append(f"{label}: not verified: {why}")
    return out


def _warn_long_run(args: argparse.Namespace, options: Any, jobs: int, workers: int) -> None:
    """Before a long decode-mode replay of a Mooncake trace: how long, and the quick modes."""
    from broker.replay.progress import long_run_note
    from broker.replay.traces import count_events

    if args.engine or not options.decode or args.format != "mooncake":
        return
    events = count_events(args.trace, args.format, options)
    prompt = count_events(args.trace, args.format, dataclasses.replace(options, decode=False))
    note = long_run_note(events or 0, prompt or 0, jobs, workers) if events else None
    if note:
        print(f"kvbroker replay: {note}", file=sys.stderr, flush=True)


def _write_records(args: argparse.Namespace, records: list[dict[str, Any]], sources: int) -> None:
    """The records as asked: --csv, --plot, then --json or the table on stdout."""
    from broker.replay.replay import format_table

    if args.csv:
        _write_csv(records, args.csv)
    if args.plot and records:
        from broker.replay.plots import write_plots

        title = os.path.basename(args.trace or args.journal[0]) if sources == 1 else f"fleet of {sources}"
        for path in write_plots(records, args.plot, title=title):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(records, indent=2))
    elif args.csv != "-":
        print(format_table(records))


def _interrupted(args: argparse.Namespace, stopped: Any) -> int:
    """^C during a sweep: one line, the rows of the jobs that had ended printed and
    written as a whole run's are (a fleet's total row left out: it would add up only some
    of its journals), exit 130 as a shell reports SIGINT."""
    print(f"kvbroker replay: {stopped}; their rows follow", file=sys.stderr)
    _write_records(args, stopped.records, 1)
    return EXIT_INTERRUPTED


def _warn_torn(url: str) -> None:
    """Say what a file journal's torn tail cuts (the replay reads up to it), as repair does."""
    from broker.journal import file_path, is_file_url
    from broker.journal.file import torn_tail

    if not is_file_url(url):
        return
    path = file_path(url)
    try:
        torn = torn_tail(path)
    except (OSError, JournalError):
        return  # the replay itself reports it
    if torn is not None:
        print(
            f"kvbroker replay: warning: journal {path}: torn tail cut: {torn.bytes_cut} bytes at offset {torn.offset} "
            f"(1 record cut short) are not replayed; replaying the {torn.records_kept} intact records "
            f"(`kvbroker repair {path}` cuts it from the file)",
            file=sys.stderr,
        )


def _check_tails(planned: list[Any], records: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """--verify: whether each journal holds every batch its writer counted
    (broker.replay.tail); its records get ``tail`` and ``missing_batches``, a fleet's total
    rows the worst of its journals' and their sum."""
    from broker.journal import JournalSource
    from broker.replay.fleet import FLEET
    from broker.replay.tail import check_tail

    out = []
    for item in planned:
        source = item.source
        if source.journal is None:
            continue
        try:
            tail = check_tail(JournalSource(source.journal, source.stream))
        except JournalError as exc:  # a trailer that is none: one line naming the record
            raise BadInput("--journal", str(exc)) from None
        for record in records:
            if record["source"] == source.label:
                record["tail"] = tail.state
                record["missing_batches"] = tail.missing
        out.append((source.label, tail))
    if out:
        states = {tail.state for _, tail in out}
        worst = next(state for state in ("cut", "unknown", "complete") if state in states)
        for record in records:
            if record["source"] == FLEET:
                record["tail"] = worst
                record["missing_batches"] = sum(tail.missing for _, tail in out)
    return out


def _check_engine(args: argparse.Namespace) -> None:
    """--engine vllm runs a Mooncake trace's requests as vLLM's manager does: it has one
    tier (the CPU tier, sized by --hbm) and no decode phase."""
    if args.format != "mooncake":
        raise BadInput("--engine", f"{args.engine} replays a Mooncake trace: give --format mooncake (got {args.format!r})")
    if args.journal:
        raise BadInput("--engine", "replays a trace (--trace), not a journal: a journal already holds what its engine did")
    if args.dram or args.nvme:
        raise BadInput("--engine", "vLLM's CPU tier is the one tier: size it with --hbm (no --dram, --nvme)")
    if args.config:
        raise BadInput("--engine", "sizes vLLM's CPU tier with --hbm; --config does not apply")
    problem = missing_engine(args.engine)
    if problem:
        raise BadInput("--engine", problem)


def _journals(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(url, stream) of every --journal, patterns expanded; a mistake names --journal."""
    from broker.journal import JournalError
    from broker.replay.fleet import expand_journals

    try:
        return expand_journals(args.journal, args.stream)
    except (JournalError, ValueError) as exc:
        raise BadInput("--journal", str(exc)) from None


def _check_trace(args: argparse.Namespace) -> None:
    """--format and --trace, checked before any process starts: a misspelt format or a
    missing file is one line, not one failure per policy."""
    from broker.replay.traces import FORMATS

    if not args.format:
        raise BadInput("--format", f"--trace needs --format (one of {', '.join(sorted(FORMATS))})")
    if args.format not in FORMATS:
        raise BadInput("--format", f"unknown trace format {args.format!r} (one of {', '.join(sorted(FORMATS))})")
    if args.format != "profile":  # a profile's "path" is its name
        check_readable(args.trace, "--trace")


def _check_outputs(args: argparse.Namespace) -> None:
    """--csv and --plot can be written, before minutes of replay are spent."""
    import importlib.util

    if args.csv and args.csv != "-":
        check_writable_file(args.csv, "--csv")
    if args.plot:
        check_writable_dir(args.plot, "--plot")
        if importlib.util.find_spec("matplotlib") is None:
            raise BadInput("--plot", f"needs matplotlib: {install_hint('plot')}")


def cmd_import(args: argparse.Namespace) -> int:
    import tempfile

    from broker.config import core_to_json
    from broker.journal import file_path, is_file_url
    from broker.journal.records import MAGIC, JournalRecord, RecordKind, encode
    from broker.replay.traces import SkipCounter, TraceError, read_trace

    _check_trace(args)
    if not is_file_url(args.out):
        raise BadInput("--out", f"import writes a journal file: file://PATH or a path, got {args.out!r}")
    out = file_path(args.out)
    check_writable_file(out, "--out")
    check_new_or_regular(out, "--out")
    # Always a CONFIG record, so `replay --journal` needs no --config: the one given, else
    # the tiers `replay --trace` would use for this trace (a profile's own, or the defaults).
    core = _config(args.config).core if args.config else _trace_base_config(args.trace, args.format)
    options = _trace_options(args)
    skips = SkipCounter(args.skip_bad)
    batches = events = 0
    # Renamed over --out only once the whole trace is in. A name of its own (O_EXCL): a
    # FIFO or a symbolic link left at a fixed name would be opened through.
    try:
        fd, partial = tempfile.mkstemp(prefix=os.path.basename(out) + ".", suffix=".importing", dir=os.path.dirname(os.path.abspath(out)))
    except OSError as exc:
        print(f"kvbroker import: --out: cannot write beside {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # what open() gives a new file, not mkstemp's 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC)
            f.write(encode(JournalRecord(RecordKind.CONFIG, 1, 1, core_to_json(core).encode())))
            for batch in read_trace(args.trace, args.format, options, skips):
                f.write(encode(JournalRecord(RecordKind.BATCH, 1, 1, batch.SerializeToString())))
                batches += 1
                events += len(batch.events)
        os.replace(partial, out)
    except TraceError as exc:
        print(f"kvbroker import: --trace: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvbroker import: --out: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    print(json.dumps({"journal": f"file://{out}", "batches": batches, "events": events, "skipped_lines": skips.skipped}))
    return 0


def _trace_base_config(trace: str, fmt: str) -> Any:
    """The tiers a trace replays on without --config: a profile's own, else the defaults
    (hbm/dram/nvme)."""
    from broker.config import CoreConfig

    if fmt == "profile":
        from broker.replay.traces.profiles import profile_config

        try:
            return parse_config(profile_config(trace)).core
        except KeyError:
            return CoreConfig()  # read_trace names the unknown profile
    return CoreConfig()


def cmd_repair(args: argparse.Namespace) -> int:
    """Keep every intact record of a damaged file journal; say what was cut."""
    from broker.journal import JournalError, file_path, is_file_url
    from broker.journal.file import release_lock, repair_file_journal, take_lock

    if not is_file_url(args.journal):
        raise BadInput("journal", f"repair mends file journals: file://PATH or a path, got {args.journal!r}")
    path = file_path(args.journal)
    if not os.path.isfile(path):  # before the lock, which would make PATH.lock beside it
        check_readable(path, "journal")  # says why: missing, a folder, a FIFO, a device
        raise BadInput("journal", f"{path}: not a regular file")
    try:
        lock = take_lock(path)  # not while a broker writes it
    except JournalError as exc:
        print(f"kvbroker repair: {exc}", file=sys.stderr)
        return 2
    try:
        report = repair_file_journal(path, write=not args.check)
    except OSError as exc:
        print(f"kvbroker repair: journal {path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except JournalError as exc:
        print(f"kvbroker repair: journal {exc}", file=sys.stderr)
        return 2
    finally:
        release_lock(path, lock)  # removes PATH.lock: a repair leaves none behind
    out = {
        "journal": path,
        "damaged": bool(report.cuts),
        "written": bool(report.cuts) and not args.check,
        "records_kept": report.records_kept,
        "records_repeated": report.records_repeated,
        "bytes_cut": report.bytes_cut,
        "cuts": [{"offset": o, "bytes": n} for o, n in report.cuts],
        "bad_records": [{"offset": o, "reason": why} for o, why in report.bad_records],
    }
    if args.json:
        print(json.dumps(out))
    elif not report.cuts:
        print(f"{path}: sound, {report.records_kept} records; nothing to repair")
    else:
        where = ", ".join(f"{n} bytes at offset {o}" for o, n in report.cuts)
        verb = "would keep" if args.check else "kept"
        print(
            f"{path}: {verb} {report.records_kept} intact records; cut {where}"
            + (f"; {report.records_repeated} records repeated after a tear kept once" if report.records_repeated else "")
            + "".join(f"; the record at offset {o}: {why}" for o, why in report.bad_records)
        )
    return 1 if args.check and report.cuts else 0


def cmd_policies(args: argparse.Namespace) -> int:
    from policies import registry

    rows = [registry.describe(registry.policy_class(name)) for name in registry.names()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        params = ", ".join(f"{k}={v}" + (f" in {r['ranges'][k]}" if k in r["ranges"] else "") for k, v in r["params"].items())
        params = params or "no parameters"
        offline = " [replay only]" if r["offline"] else ""
        print(f"{r['name']:<{width}}  {r['description']}{offline}  ({params})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from broker.cli.demo import JOURNAL_NAME
    from broker.cli.demo import main as demo_main

    if args.keep:
        check_keep_dir(args.keep, JOURNAL_NAME)

    return demo_main(requests=args.requests, seed=args.seed, keep=args.keep)


def _int_list(value: str, flag: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag}: expected comma-separated integers, got {value!r}") from None
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"{flag}: expected positive integers, got {value!r}")
    return out


def cmd_bench(args: argparse.Namespace) -> int:
    from broker.bench.run import JOURNALS, BenchOptions
    from broker.bench.run import main as bench_main
    from broker.bench.targets import MEMORY_POLICIES

    try:
        batches = _int_list(args.batches, "--batches") if args.batches else None
        streams = _int_list(args.streams, "--streams") if args.streams else None
        memory_blocks = _int_list(args.memory_blocks, "--memory-blocks") if args.memory_blocks else None
    except argparse.ArgumentTypeError as exc:
        print(f"kvbroker bench: {exc}", file=sys.stderr)
        return 2
    for flag, value in (("--events", args.events), ("--seconds", args.seconds)):
        if value is not None and value <= 0:
            print(f"kvbroker bench: {flag}: must be > 0, got {value}", file=sys.stderr)
            return 2
    if args.window < 0:
        print(f"kvbroker bench: --window: must be >= 0, got {args.window}", file=sys.stderr)
        return 2
    from policies import registry
    from policies.base import PolicyError

    try:
        registry.policy_class(args.policy)
    except PolicyError as exc:
        print(f"kvbroker bench: --policy: {exc}", file=sys.stderr)
        return 2
    journals = tuple(j.strip() for j in args.journals.split(",") if j.strip()) if args.journals else None
    if journals is not None and (not journals or set(journals) - set(JOURNALS)):
        print(f"kvbroker bench: --journals: each one of {', '.join(JOURNALS)}, got {args.journals!r}", file=sys.stderr)
        return 2
    if not args.redis.startswith(("redis://", "rediss://", "unix://")):
        raise BadInput("--redis", f"expected redis://HOST:PORT/DB (or rediss://, unix://), got {args.redis!r}")
    if args.target:
        _reachable(args, "bench")
    elif journals and "redis" in journals:
        from broker.bench.run import redis_reachable

        # Asked for by name, not skipped with a note as when --journals is left to its default.
        why = redis_reachable(args.redis)
        if why:
            raise BadInput("--redis", f"{args.redis} does not answer ({why}), and --journals names redis")
    changes: dict[str, Any] = {"target": args.target, "policy": args.policy, "redis_url": args.redis, "window": args.window}
    changes["seed"] = args.seed
    changes["prefix_cache"] = args.prefix_cache
    optional = {"events": args.events, "seconds": args.seconds, "batches": batches, "streams": streams, "journals": journals}
    changes.update((key, value) for key, value in optional.items() if value is not None)
    opts = BenchOptions.quick(**changes) if args.quick else dataclasses.replace(BenchOptions(), **changes)
    if memory_blocks is None and args.memory:
        memory_blocks = (100_000,) if args.quick else (100_000, 1_000_000)
    memory_policies = MEMORY_POLICIES
    if args.memory_policies is not None:
        memory_policies = tuple(p.strip() for p in args.memory_policies.split(",") if p.strip())
        for name in memory_policies or ("",):
            try:
                registry.policy_class(name)
            except PolicyError as exc:
                print(f"kvbroker bench: --memory-policies: {exc}", file=sys.stderr)
                return 2
    return bench_main(opts, as_json=args.json, memory_blocks=memory_blocks or (), memory_policies=memory_policies, quick=args.quick)


def _trace_options(args: argparse.Namespace) -> Any:
    from broker.replay.traces import TraceOptions

    return TraceOptions(
        decode=not args.no_decode,
        bytes_per_token=args.bytes_per_token,
        tpot_us=args.tpot_us,
        skip_bad=args.skip_bad,
        us_per_step=args.us_per_step,
        block_tokens=args.block_tokens,
        model=args.model,
        seed=args.seed,
        scale=args.scale,
    )


def _trace_flags(p: argparse.ArgumentParser, required: bool = False) -> None:
    from broker.replay.traces import TraceOptions

    p.add_argument("--trace", required=required, help="trace file to import")
    p.add_argument(
        "--format", required=required, help="trace format: mooncake, kvds-events, kvds-requests, vllm-events, profile (PATH = profile name)"
    )
    p.add_argument("--no-decode", action="store_true", help="prompt blocks only (prefix-cache hit-ratio methodology)")
    p.add_argument(
        "--bytes-per-token", type=positive_int, default=TraceOptions.bytes_per_token, help="KV bytes per token (default llama-3-8b fp16)"
    )
    p.add_argument("--tpot-us", type=positive_int, default=TraceOptions.tpot_us, help="decode time per output token, microseconds")
    p.add_argument("--skip-bad", action="store_true", help="count and skip bad lines instead of stopping at the first")
    p.add_argument(
        "--us-per-step", type=positive_int, default=TraceOptions.us_per_step, help="kvds-events: event time of one seed step (µs)"
    )
    p.add_argument("--block-tokens", type=positive_int, default=TraceOptions.block_tokens, help="kvds-requests: tokens per KV block")
    p.add_argument("--model", default=TraceOptions.model, help="kvds-requests: model of requests that name none")
    p.add_argument("--seed", type=int, default=TraceOptions.seed, help="profile: generator seed")
    p.add_argument("--scale", type=positive_float, default=TraceOptions.scale, help="profile: request/page count multiplier")


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = OneLineParser(
        prog="kvbroker", description="gRPC memory-intent broker for the KV cache of LLM inference servers"
    )
    parser.add_argument("--version", action="version", version=f"kvbroker {package_version()}", help="print the version and exit")
    sub = parser.add_subparsers(dest="verb", required=True)

    p = sub.add_parser("serve", help="run the broker")
    p.add_argument("--config", help="TOML config file (defaults: HBM/DRAM/NVMe tiers, lru, file journal)")
    p.add_argument("--listen", help="HOST:PORT to listen on (overrides broker.listen; port 0 picks a free one)")
    p.add_argument(
        "--journal", help="file://PATH (or a plain path), redis://HOST:PORT/DB, redis+cluster://HOST:PORT or none (overrides journal.url)"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", choices=["text", "json"], help="text, or one JSON object per line (overrides telemetry.log_format)")
    p.add_argument(
        "--metrics-port", type=port_number, help="serve Prometheus /metrics on this port; 0 = off (overrides telemetry.prometheus_port)"
    )
    p.add_argument("--metrics-host", help="address /metrics binds to (overrides telemetry.prometheus_host; default 127.0.0.1)")
    p.add_argument("--otlp-endpoint", help="OTLP collector, e.g. http://otel-collector:4317 (overrides telemetry.otlp_endpoint)")
    p.add_argument("--traces", action=argparse.BooleanOptionalAction, default=None, help="a span per batch over OTLP (telemetry.traces)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("status", help="show a running broker's policy, tiers and counters")
    p.add_argument("--target", required=True, type=host_port, help="HOST:PORT of the broker")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--timeout", type=positive_float, default=5.0, help="seconds to wait for the broker's answer (default 5)")
    _security_flags(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("ab", help="the primary policy and its shadows (or the split arms) side by side, from a running broker")
    p.add_argument("--target", required=True, type=host_port, help="HOST:PORT of the broker")
    p.add_argument("--json", action="store_true", help="one JSON object: config_generation and arms")
    p.add_argument("--timeout", type=positive_float, default=5.0, help="seconds to wait for the broker's answer (default 5)")
    _security_flags(p)
    p.set_defaults(func=cmd_ab)

    p = sub.add_parser("replay", help="replay a journal or a trace through policies and compare them")
    p.add_argument(
        "--journal",
        action="append",
        help="file://PATH, redis://HOST:PORT/DB[?stream=KEY] or redis+cluster://HOST:PORT[?stream=KEY]; repeat for a fleet, "
        "or give a pattern (?stream=kvbroker:*:journal, file:///d/*.journal): one source per journal, and a fleet total row",
    )
    p.add_argument("--stream", help="Redis stream key or pattern (default: from the URL)")
    _trace_flags(p)
    p.add_argument("--policy", action="append", help="policy to run (repeat, or comma-separated; default: all)")
    p.add_argument("--policies", action="append", help="comma-separated policies (same as --policy)")
    p.add_argument("--config", help="config whose tiers to replay on (default: the journal's, or hbm/dram/nvme defaults)")
    p.add_argument("--hbm", help="top tier capacities to sweep: 1GiB,4GiB or 1000000tok,3000000tok")
    p.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        help="vllm: run a Mooncake trace's requests as vLLM's CPU offload tier does (prefix lookups, stores, its CachePolicy calls); "
        "vllm-scheduler: through vLLM's own scheduler, GPU prefix cache and CPU tier, requests in flight together, "
        "with TTFT (needs vLLM; docs/vllm.md); --hbm sizes the CPU tier; the hit rate is vLLM's",
    )
    p.add_argument("--dram", help="second tier capacities to sweep")
    p.add_argument("--nvme", help="third tier capacities to sweep")
    p.add_argument("--param", action="append", metavar="POLICY.KEY=V1,V2", help="sweep a policy parameter over values (repeat per key)")
    p.add_argument(
        "--jobs",
        type=positive_int,
        help="processes (default: one per job, up to the CPU count); with --ray: CPUs of the local Ray",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run the jobs as Ray tasks on the cluster at ADDRESS (as ray.init takes it: auto, ray://HOST:10001); "
        "without ADDRESS a local Ray started for the run (needs the [ray] extra, in a venv of its own: "
        f"{clone_command('ray')})",
    )
    p.add_argument("--quant", choices=["fp16", "fp8", "int4", "int2"], help="scale block footprints and add dequantization per transfer")
    p.add_argument(
        "--ablate-intent",
        action="store_true",
        help="also replay each policy with every field the engine asserts about the future stripped (docs/deadlines.md lists them)",
    )
    p.add_argument(
        "--kvds-compat",
        action="store_true",
        help="kvds-events only: kv_deadline_scheduler's own importer rules and cost model (labels, static deadlines, "
        "its PREFETCHED/SPILLED/EVICTED lines, flat 5 ms miss), HBM from --hbm (default 128MiB), DRAM from --dram (4096MiB)",
    )
    p.add_argument("--verify", action="store_true", help="fail unless the live policy's directives are reproduced exactly")
    p.add_argument(
        "--progress",
        action="store_true",
        help="show progress on stderr even when it is not a terminal, as plain lines (on a terminal it is shown anyway: "
        "a bar per job, or one overall bar when jobs run in parallel)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='a JSON array, one record per (source, policy, parameters, capacity); a fleet total row has source "fleet"',
    )
    p.add_argument("--csv", metavar="PATH", help="also write the records as CSV (- for stdout)")
    p.add_argument(
        "--plot",
        metavar="DIR",
        help="write PNG plots to DIR: hit rate and prefix hit rate by size, latency CDF, bytes moved "
        "(a chart with nothing to show is left out)",
    )
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("import", help="convert a trace into a journal file that replay reads")
    _trace_flags(p, required=True)
    p.add_argument("--out", required=True, help="file://PATH (or a plain path) of the journal to write")
    p.add_argument(
        "--config",
        help="config to record in the journal, the tiers replay will use (default: those replay --trace uses: a profile's own, "
        "or the hbm/dram/nvme defaults)",
    )
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("repair", help="keep every intact record of a damaged file journal (the broker stopped); report what is cut")
    p.add_argument("journal", help="file://PATH or PATH of the journal")
    p.add_argument("--check", action="store_true", help="report only; exit 1 if the journal is damaged")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=cmd_repair)

    from broker.cli import size as cli_size

    cli_size.add_parser(sub)

    from vllm_integration.events_from_vllm import bridge_cli

    bridge_cli.add_parser(sub)

    from broker.cli import vllm_status as cli_vllm_status

    cli_vllm_status.add_parser(sub)

    p = sub.add_parser("policies", help="list the policies with their parameters")
    p.add_argument("--json", action="store_true", help="a JSON array: name, description, offline, params")
    p.set_defaults(func=cmd_policies)

    p = sub.add_parser("demo", help="broker + demo workload over real gRPC, then a replay comparison table")
    p.add_argument("--requests", type=positive_int, default=40, help="requests of the demo workload (default 40)")
    p.add_argument("--seed", type=int, default=7, help="workload seed (default 7)")
    p.add_argument("--keep", metavar="DIR", help="keep the journal in DIR instead of a temporary directory")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="throughput, batch round trips, CPU and RSS of a real broker against an echo ceiling")
    p.add_argument(
        "--target", metavar="HOST:PORT", type=host_port, help="drive this running broker instead of starting one per configuration"
    )
    p.add_argument("--events", type=positive_int, help="events per run, over all streams (default 400000; --quick 60000)")
    p.add_argument("--seconds", type=positive_float, help="longest sending time of one run (default 5; --quick 1)")
    p.add_argument("--quick", action="store_true", help="about a minute: batches 64,256, 4 streams, journals none,file,redis, 1 s runs")
    p.add_argument("--json", action="store_true", help="one JSON record per line: per configuration, then per memory size")
    p.add_argument("--batches", help="comma-separated batch sizes (default 1,64,256)")
    p.add_argument("--streams", help="comma-separated stream counts, one load process each (default 1,4)")
    p.add_argument("--journals", help="comma-separated: none, file, redis (default all three)")
    p.add_argument("--policy", default="deadline_edf", help="policy of the brokers started (default deadline_edf)")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="Redis of the redis journal (a fresh stream, deleted after)")
    p.add_argument("--window", type=non_negative_int, default=0, help="batches in flight per stream (default 0: 2048/batch, within 4..64)")
    p.add_argument("--seed", type=int, default=1, help="workload seed")
    p.add_argument(
        "--prefix-cache",
        action="store_true",
        help="finished requests release their blocks (kept cached, as vLLM's prefix cache does) instead of freeing them: "
        "HBM fills and every new block displaces one (the eviction path and its directives are measured)",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="also measure RSS per tracked block, for each --memory-policies (100k and 1M blocks; --quick 100k)",
    )
    p.add_argument("--memory-blocks", help="block counts of the memory benchmark, e.g. 100000,1000000 (implies --memory)")
    p.add_argument(
        "--memory-policies",
        help="policies of the memory benchmark, comma-separated (default: the issue's five, lru,s3fifo,arc,prefix_aware,deadline_edf)",
    )
    p.set_defaults(func=cmd_bench)
    return parser


# What a shell reports for a Unix tool that a closed pipe ended (128 + SIGPIPE): `seq 1 1000000
# | head -1` leaves 141 in PIPESTATUS, and so does `kvbroker policies | head -1`.
EXIT_BROKEN_PIPE = 141
# What a shell reports for a tool ended by ^C (128 + SIGINT).
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    try:
        result = _main(argv)
        sys.stdout.flush()  # here, not at exit: a pipe closed early is seen while it can be caught
        return result
    except BrokenPipeError:
        # The reader (head, less) has what it wanted. Python ignores SIGPIPE, so the write
        # raised instead of ending the process as it ends a C tool; end as quietly. stdout
        # goes to /dev/null first, or the interpreter's own flush at exit fails again and
        # prints "Exception ignored ... BrokenPipeError".
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None) -> int:
    stale = native.stale_message()
    if stale:
        print(f"kvbroker: warning: {stale}", file=sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
        return result
    except ConfigError as exc:
        print(f"kvbroker {args.verb}: config: {exc}", file=sys.stderr)
        return 2
    except JournalError as exc:  # e.g. serve: a cluster stream key without a hash tag
        print(f"kvbroker {args.verb}: journal: {exc}", file=sys.stderr)
        return 2
    except BadInput as exc:
        return say(args.verb, exc)
    except KeyboardInterrupt:  # ^C anywhere else: one line, not a traceback
        print(f"kvbroker {args.verb}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
