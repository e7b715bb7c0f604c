"""Every verb of the real `kvbroker` command fed its likely mistakes: one line on stderr that
names the flag or field and says why, exit 2 (1 is kept for "verification failed"), and no
traceback. Serve cases must end on their own: the broker refuses to start."""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.journal.file import take_lock

pytestmark = pytest.mark.e2e

KVBROKER = Path(sys.executable).parent / "kvbroker"
MOONCAKE = Path(__file__).parents[1] / "data" / "mooncake" / "synthetic_trace.jsonl"

# (id, argv, what stderr must name). Placeholders, filled per test by `places`:
# {tmp} a fresh folder; {trace} a good 3-line Mooncake trace; {bad_trace} one whose third line
# is not JSON; {config} a good TOML config; {bad_toml} malformed TOML; {neg_toml} a negative
# capacity; {text} a file that is no journal; {journal} a good file journal (no config
# record: what import writes without --config); {closed} a loopback port nothing listens on;
# {held} a loopback port another program listens on; {held_journal} a journal whose lock this
# process holds (as a running broker would).
CASES: list[tuple[str, list[str], str]] = [
    # ---- the command itself
    ("no-verb", [], "verb"),
    ("unknown-verb", ["servve"], "servve"),
    ("unknown-flag", ["policies", "--jsno"], "--jsno"),
    # ---- serve
    ("serve-listen-notaport", ["serve", "--listen", "notaport", "--journal", "none"], "--listen"),
    ("serve-listen-port-word", ["serve", "--listen", "127.0.0.1:http", "--journal", "none"], "--listen"),
    ("serve-listen-port-range", ["serve", "--listen", "127.0.0.1:70000", "--journal", "none"], "--listen"),
    ("serve-listen-held", ["serve", "--listen", "127.0.0.1:{held}", "--journal", "none"], "--listen"),
    ("serve-listen-bad-host", ["serve", "--listen", "no.such.host.invalid:0", "--journal", "none"], "--listen"),
    ("serve-metrics-held", ["serve", "--listen", "127.0.0.1:0", "--journal", "none", "--metrics-port", "{held}"], "--metrics-port"),
    ("serve-metrics-negative", ["serve", "--listen", "127.0.0.1:0", "--journal", "none", "--metrics-port", "-1"], "metrics"),
    ("serve-metrics-word", ["serve", "--metrics-port", "ninety"], "--metrics-port"),
    (
        "serve-metrics-host",
        ["serve", "--listen", "127.0.0.1:0", "--journal", "none", "--metrics-port", "{closed}", "--metrics-host", "no.such.host.invalid"],
        "--metrics-host",
    ),
    ("serve-journal-scheme", ["serve", "--listen", "127.0.0.1:0", "--journal", "ftp://x/y"], "--journal"),
    ("serve-journal-no-folder", ["serve", "--listen", "127.0.0.1:0", "--journal", "file://{tmp}/no/such/dir/j.journal"], "--journal"),
    ("serve-journal-plain-no-folder", ["serve", "--listen", "127.0.0.1:0", "--journal", "{tmp}/no/such/dir/j.journal"], "--journal"),
    ("serve-journal-a-folder", ["serve", "--listen", "127.0.0.1:0", "--journal", "{tmp}"], "--journal"),
    ("serve-journal-not-a-journal", ["serve", "--listen", "127.0.0.1:0", "--journal", "{text}"], "--journal"),
    ("serve-journal-in-use", ["serve", "--listen", "127.0.0.1:0", "--journal", "{held_journal}"], "--journal"),
    ("serve-journal-redis-down", ["serve", "--listen", "127.0.0.1:0", "--journal", "redis://127.0.0.1:{closed}/0"], "--journal"),
    ("serve-config-missing", ["serve", "--config", "{tmp}/nope.toml"], "--config"),
    ("serve-config-malformed", ["serve", "--config", "{bad_toml}"], "--config"),
    ("serve-config-negative", ["serve", "--config", "{neg_toml}"], "tiers[0].capacity"),
    ("serve-log-level", ["serve", "--log-level", "loud"], "--log-level"),
    ("serve-otlp", ["serve", "--listen", "127.0.0.1:0", "--journal", "none", "--otlp-endpoint", "not a url"], "otlp"),
    # ---- status and ab
    ("status-no-target", ["status"], "--target"),
    ("status-target-notaport", ["status", "--target", "notaport", "--timeout", "2"], "--target"),
    ("status-unreachable", ["status", "--target", "127.0.0.1:{closed}", "--timeout", "2"], "--target"),
    ("status-timeout-negative", ["status", "--target", "127.0.0.1:{closed}", "--timeout", "-1"], "--timeout"),
    ("status-timeout-word", ["status", "--target", "127.0.0.1:{closed}", "--timeout", "soon"], "--timeout"),
    ("status-tls-ca-missing", ["status", "--target", "127.0.0.1:{closed}", "--tls-ca", "{tmp}/ca.pem"], "--tls-ca"),
    ("status-tls-ca-garbage", ["status", "--target", "127.0.0.1:{closed}", "--tls-ca", "{garbage}"], "--tls-ca: {garbage}: not a PEM"),
    ("status-tls-ca-text", ["status", "--target", "127.0.0.1:{closed}", "--tls-ca", "{text}"], "--tls-ca"),
    ("ab-tls-ca-garbage", ["ab", "--target", "127.0.0.1:{closed}", "--tls-ca", "{garbage}"], "not a PEM CA certificate"),
    (
        "status-tls-cert-garbage",
        ["status", "--target", "127.0.0.1:{closed}", "--tls-cert", "{garbage}", "--tls-key", "{garbage}"],
        "--tls-cert",
    ),
    ("status-token-missing", ["status", "--target", "127.0.0.1:{closed}", "--token-file", "{tmp}/token"], "--token-file"),
    ("ab-unreachable", ["ab", "--target", "127.0.0.1:{closed}", "--timeout", "2"], "--target"),
    ("ab-target-notaport", ["ab", "--target", "nohost", "--timeout", "2"], "--target"),
    # ---- replay of a trace, one policy and several (the parallel sweep)
    ("replay-corrupt-1", ["replay", "--trace", "{bad_trace}", "--format", "mooncake", "--policy", "lru"], "line"),
    ("replay-corrupt-2", ["replay", "--trace", "{bad_trace}", "--format", "mooncake", "--policies", "lru,fifo"], "line"),
    ("replay-corrupt-all", ["replay", "--trace", "{bad_trace}", "--format", "mooncake"], "line"),
    ("replay-missing-1", ["replay", "--trace", "{tmp}/none.jsonl", "--format", "mooncake", "--policy", "lru"], "--trace"),
    ("replay-missing-2", ["replay", "--trace", "{tmp}/none.jsonl", "--format", "mooncake", "--policies", "lru,fifo"], "--trace"),
    ("replay-format-1", ["replay", "--trace", "{trace}", "--format", "mooncak", "--policy", "lru"], "--format"),
    ("replay-format-2", ["replay", "--trace", "{trace}", "--format", "mooncak", "--policies", "lru,fifo"], "--format"),
    ("replay-no-format", ["replay", "--trace", "{trace}"], "--format"),
    ("replay-no-source", ["replay"], "--journal"),
    ("replay-two-sources", ["replay", "--trace", "{trace}", "--format", "mooncake", "--journal", "{journal}"], "--trace"),
    ("replay-profile-unknown", ["replay", "--trace", "nosuch", "--format", "profile", "--policy", "lru"], "profile"),
    ("replay-policy-unknown", ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lruu"], "--policy"),
    ("replay-hbm-unit", ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru", "--hbm", "4XB"], "--hbm"),
    ("replay-hbm-negative", ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru", "--hbm", "-1GiB"], "--hbm"),
    (
        "replay-nvme-no-tier",
        ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru", "--config", "{config}", "--dram", "1GiB"],
        "--dram",
    ),
    ("replay-param-syntax", ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru", "--param", "lru"], "--param"),
    ("replay-param-key", ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru", "--param", "lru.nokey=1"], "--param"),
    (
        "replay-param-policy",
        ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru", "--param", "nosuch.k=1"],
        "--param",
    ),
    ("replay-jobs-negative", ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru", "--jobs", "-1"], "--jobs"),
    (
        "replay-bytes-per-token-0",
        ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru", "--bytes-per-token", "0"],
        "--bytes-per-token",
    ),
    ("replay-tpot-negative", ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru", "--tpot-us", "-5"], "--tpot-us"),
    (
        "replay-block-tokens-0",
        ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru", "--block-tokens", "0"],
        "--block-tokens",
    ),
    (
        "replay-us-per-step-0",
        ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru", "--us-per-step", "0"],
        "--us-per-step",
    ),
    ("replay-scale-negative", ["replay", "--trace", "balanced", "--format", "profile", "--policy", "lru", "--scale", "-1"], "--scale"),
    ("replay-scale-nan", ["replay", "--trace", "balanced", "--format", "profile", "--policy", "lru", "--scale", "nan"], "--scale"),
    ("replay-quant", ["replay", "--trace", "{trace}", "--format", "mooncake", "--quant", "fp4"], "--quant"),
    (
        "replay-csv-no-folder",
        ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru", "--csv", "{tmp}/no/dir/out.csv"],
        "--csv",
    ),
    ("replay-plot-a-file", ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru", "--plot", "{text}"], "--plot"),
    # One rule with --csv: the folder that holds an output must exist (only DIR itself is made).
    (
        "replay-plot-no-folder",
        ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru", "--plot", "{tmp}/no/dir/x"],
        "--plot: folder {tmp}/no/dir does not exist",
    ),
    ("replay-config-missing", ["replay", "--trace", "{trace}", "--format", "mooncake", "--config", "{tmp}/nope.toml"], "--config"),
    ("replay-config-malformed", ["replay", "--trace", "{trace}", "--format", "mooncake", "--config", "{bad_toml}"], "--config"),
    ("replay-config-negative", ["replay", "--trace", "{trace}", "--format", "mooncake", "--config", "{neg_toml}"], "tiers[0].capacity"),
    ("replay-no-decode-no-hbm", ["replay", "--trace", "{trace}", "--format", "mooncake", "--no-decode"], "--hbm"),
    ("replay-hbm-only-comma", ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru", "--hbm", ","], "--hbm"),
    ("replay-hbm-0", ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru", "--hbm", "0"], "--hbm"),
    ("replay-hbm-0tok", ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru", "--hbm", "0tok,1GiB"], "--hbm"),
    ("replay-dram-0", ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru", "--dram", "0"], "--dram"),
    ("replay-jobs-0", ["replay", "--trace", "{trace}", "--format", "mooncake", "--policies", "lru,fifo", "--jobs", "0"], "--jobs"),
    ("replay-policies-empty", ["replay", "--trace", "{trace}", "--format", "mooncake", "--policies", ""], "--policies"),
    ("replay-policy-commas", ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", " , "], "--policy"),
    (
        "replay-kvds-hbm-0",
        ["replay", "--trace", "{trace}", "--format", "kvds-events", "--kvds-compat", "--policy", "lru", "--hbm", "0"],
        "--hbm",
    ),
    # ---- replay of a journal
    ("replay-journal-missing-1", ["replay", "--journal", "file://{tmp}/none.journal", "--policy", "lru"], "--journal"),
    ("replay-journal-missing-2", ["replay", "--journal", "{tmp}/none.journal", "--policies", "lru,fifo"], "--journal"),
    ("replay-journal-not-a-journal", ["replay", "--journal", "{text}", "--policies", "lru,fifo"], "--journal"),
    ("replay-journal-a-folder", ["replay", "--journal", "{tmp}", "--policy", "lru"], "--journal"),
    ("replay-journal-empty", ["replay", "--journal", "{empty}", "--policy", "lru"], "is empty (0 bytes)"),
    ("replay-journal-empty-all", ["replay", "--journal", "file://{empty}"], "is empty (0 bytes)"),
    ("replay-journal-scheme", ["replay", "--journal", "ftp://x/y", "--policy", "lru"], "--journal"),
    ("replay-journal-no-match", ["replay", "--journal", "file://{tmp}/*.nothing", "--policy", "lru"], "--journal"),
    ("replay-redis-down", ["replay", "--journal", "redis://127.0.0.1:{closed}/0?stream=k", "--policies", "lru,fifo"], "--journal"),
    ("replay-redis-no-stream", ["replay", "--journal", "redis://127.0.0.1:{closed}/0", "--policy", "lru"], "--journal"),
    ("replay-cluster-down", ["replay", "--journal", "redis+cluster://127.0.0.1:{closed}?stream={{k}}:j", "--policy", "lru"], "--journal"),
    # ---- import
    ("import-corrupt", ["import", "--trace", "{bad_trace}", "--format", "mooncake", "--out", "file://{tmp}/o.journal"], "line"),
    ("import-missing", ["import", "--trace", "{tmp}/none.jsonl", "--format", "mooncake", "--out", "file://{tmp}/o.journal"], "--trace"),
    ("import-format", ["import", "--trace", "{trace}", "--format", "mooncak", "--out", "file://{tmp}/o.journal"], "--format"),
    ("import-no-out", ["import", "--trace", "{trace}", "--format", "mooncake"], "--out"),
    ("import-out-no-folder", ["import", "--trace", "{trace}", "--format", "mooncake", "--out", "file://{tmp}/no/dir/o.journal"], "--out"),
    ("import-out-a-folder", ["import", "--trace", "{trace}", "--format", "mooncake", "--out", "{tmp}"], "--out"),
    ("import-out-redis", ["import", "--trace", "{trace}", "--format", "mooncake", "--out", "redis://127.0.0.1:{closed}/0"], "--out"),
    (
        "import-config-missing",
        ["import", "--trace", "{trace}", "--format", "mooncake", "--out", "{tmp}/o.journal", "--config", "{tmp}/nope.toml"],
        "--config",
    ),
    (
        "import-bytes-per-token",
        ["import", "--trace", "{trace}", "--format", "mooncake", "--out", "{tmp}/o.journal", "--bytes-per-token", "-1"],
        "--bytes-per-token",
    ),
    # ---- repair
    ("repair-missing", ["repair", "{tmp}/none.journal"], "journal"),
    ("repair-not-a-journal", ["repair", "{text}"], "journal"),
    ("repair-a-folder", ["repair", "{tmp}"], "journal"),
    ("repair-empty", ["repair", "{empty}"], "is empty (0 bytes)"),
    ("repair-redis", ["repair", "redis://127.0.0.1:{closed}/0"], "journal"),
    # ---- size
    ("size-model", ["size", "--model", "no-such-model", "--tokens", "10"], "--model"),
    ("size-model-file", ["size", "--model", "{text}", "--tokens", "10"], "--model"),
    ("size-tokens-negative", ["size", "--model", "llama-3-8b", "--tokens", "-1"], "--tokens"),
    ("size-block-tokens-0", ["size", "--model", "llama-3-8b", "--tokens", "10", "--block-tokens", "0"], "--block-tokens"),
    ("size-dtype", ["size", "--model", "llama-3-8b", "--tokens", "10", "--dtype", "fp4"], "--dtype"),
    # ---- policies and demo
    ("policies-arg", ["policies", "lru"], "lru"),
    ("demo-requests-0", ["demo", "--requests", "0"], "--requests"),
    ("demo-requests-word", ["demo", "--requests", "many"], "--requests"),
    ("demo-keep-a-file", ["demo", "--requests", "2", "--keep", "{text}"], "--keep"),
    ("demo-keep-no-parent", ["demo", "--requests", "2", "--keep", "{tmp}/no/such/dir"], "--keep: folder {tmp}/no/such does not exist"),
    # A folder an earlier `demo --keep` left its journal in: a second run would append to it.
    ("demo-keep-twice", ["demo", "--requests", "2", "--keep", "{kept}"], "earlier run"),
    # ---- bench
    ("bench-batches", ["bench", "--batches", "0,x"], "--batches"),
    ("bench-events-0", ["bench", "--events", "0"], "--events"),
    ("bench-seconds-negative", ["bench", "--seconds", "-1"], "--seconds"),
    ("bench-window-negative", ["bench", "--window", "-1"], "--window"),
    ("bench-policy", ["bench", "--policy", "nosuch"], "--policy"),
    ("bench-journals", ["bench", "--journals", "file,tape"], "--journals"),
    ("bench-streams", ["bench", "--streams", "-2"], "--streams"),
    ("bench-memory-blocks", ["bench", "--memory-blocks", "many"], "--memory-blocks"),
    ("bench-target-notaport", ["bench", "--target", "notaport", "--quick"], "--target"),
    ("bench-target-unreachable", ["bench", "--target", "127.0.0.1:{closed}", "--quick"], "--target"),
    ("bench-redis-url", ["bench", "--redis", "http://x", "--quick", "--journals", "redis"], "--redis"),
    ("bench-redis-down", ["bench", "--redis", "redis://127.0.0.1:{closed}/0", "--quick", "--journals", "redis"], "--redis"),
    # ---- vllm-bridge
    (
        "bridge-events-no-tcp",
        ["vllm-bridge", "--events", "localhost:5557", "--broker", "127.0.0.1:{closed}", "--model", "llama-3-8b"],
        "--events",
    ),
    (
        "bridge-events-no-port",
        ["vllm-bridge", "--events", "tcp://localhost", "--broker", "127.0.0.1:{closed}", "--model", "llama-3-8b"],
        "--events",
    ),
    (
        "bridge-replay-no-tcp",
        [
            "vllm-bridge",
            "--events",
            "tcp://127.0.0.1:{closed}",
            "--replay",
            "127.0.0.1:5657",
            "--broker",
            "127.0.0.1:{closed}",
            "--model",
            "llama-3-8b",
        ],
        "--replay",
    ),
    (
        "bridge-broker-notaport",
        ["vllm-bridge", "--events", "tcp://127.0.0.1:{closed}", "--broker", "nohost", "--model", "llama-3-8b"],
        "--broker",
    ),
    (
        "bridge-model",
        ["vllm-bridge", "--events", "tcp://127.0.0.1:{closed}", "--broker", "127.0.0.1:{closed}", "--model", "no-such-model"],
        "--model",
    ),
    (
        "bridge-dp-size-0",
        [
            "vllm-bridge",
            "--events",
            "tcp://127.0.0.1:{closed}",
            "--broker",
            "127.0.0.1:{closed}",
            "--model",
            "llama-3-8b",
            "--dp-size",
            "0",
        ],
        "--dp-size",
    ),
    (
        "bridge-tier-map",
        [
            "vllm-bridge",
            "--events",
            "tcp://127.0.0.1:{closed}",
            "--broker",
            "127.0.0.1:{closed}",
            "--model",
            "llama-3-8b",
            "--tier-map",
            "GPU",
        ],
        "--tier-map",
    ),
    (
        "bridge-stats-interval",
        [
            "vllm-bridge",
            "--events",
            "tcp://127.0.0.1:{closed}",
            "--broker",
            "127.0.0.1:{closed}",
            "--model",
            "llama-3-8b",
            "--stats-interval",
            "-1",
        ],
        "--stats-interval",
    ),
    (
        "bridge-replay-timeout",
        [
            "vllm-bridge",
            "--events",
            "tcp://127.0.0.1:{closed}",
            "--broker",
            "127.0.0.1:{closed}",
            "--model",
            "llama-3-8b",
            "--replay-timeout",
            "-1",
        ],
        "--replay-timeout",
    ),
    (
        "bridge-capture-no-folder",
        [
            "vllm-bridge",
            "--events",
            "tcp://127.0.0.1:{closed}",
            "--broker",
            "127.0.0.1:{closed}",
            "--model",
            "llama-3-8b",
            "--capture",
            "{tmp}/no/dir/c.bin",
        ],
        "--capture",
    ),
    (
        "bridge-stats-file-no-folder",
        [
            "vllm-bridge",
            "--events",
            "tcp://127.0.0.1:{closed}",
            "--broker",
            "127.0.0.1:{closed}",
            "--model",
            "llama-3-8b",
            "--stats-file",
            "{tmp}/no/dir/s.json",
        ],
        "--stats-file",
    ),
]


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The files and ports of the cases, made once per module (no case writes into them)."""
    tmp_path = tmp_path_factory.mktemp("places")
    trace = tmp_path / "trace.jsonl"
    with MOONCAKE.open() as f:
        trace.write_text("".join(next(f) for _ in range(3)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(trace.read_text().splitlines(keepends=True)[:2]) + "{not json\n")
    (tmp_path / "ok.toml").write_text('[[tiers]]\nname = "hbm"\ncapacity = "64MiB"\n')
    (tmp_path / "bad.toml").write_text("[[tiers]\nname = \n")
    (tmp_path / "neg.toml").write_text('[[tiers]]\nname = "hbm"\ncapacity = "-5MiB"\n')
    (tmp_path / "notes.txt").write_text("this is no journal\n")
    (tmp_path / "empty.journal").write_bytes(b"")
    (tmp_path / "garbage.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "kept").mkdir()
    journal = tmp_path / "good.journal"
    made = subprocess.run(
        [str(KVBROKER), "import", "--trace", str(trace), "--format", "mooncake", "--out", f"file://{journal}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    (tmp_path / "kept" / "demo.journal").write_bytes(journal.read_bytes())
    # A port bound but not listening refuses connections; held so no one else takes it.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    # A journal another broker writes: its lock held (as FileJournal holds it).
    held_journal = tmp_path / "held.journal"
    held_journal.write_bytes(b"")
    lock = take_lock(str(held_journal))
    try:
        yield {
            "tmp": str(tmp_path),
            "trace": str(trace),
            "bad_trace": str(bad),
            "config": str(tmp_path / "ok.toml"),
            "bad_toml": str(tmp_path / "bad.toml"),
            "neg_toml": str(tmp_path / "neg.toml"),
            "text": str(tmp_path / "notes.txt"),
            "journal": f"file://{journal}",
            "closed": str(closed.getsockname()[1]),
            "held": str(held.getsockname()[1]),
            "held_journal": str(held_journal),
            "empty": str(tmp_path / "empty.journal"),
            "garbage": str(tmp_path / "garbage.bin"),
            "kept": str(tmp_path / "kept"),
        }
    finally:
        closed.close()
        held.close()
        os.close(lock)


@pytest.mark.parametrize(("argv", "names"), [pytest.param(argv, names, id=case) for case, argv, names in CASES])
def test_a_mistake_is_one_line_naming_the_field_and_exit_2(argv: list[str], names: str, places: dict[str, str], tmp_path: Path) -> None:
    args = [a.format(**places) for a in argv]
    # The TLS and token variables would change what status and ab read.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBROKER_TLS_", "KVBROKER_TOKEN"))}
    done = subprocess.run([str(KVBROKER), *args], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, f"exit {done.returncode}: {done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1, done.stderr
    assert names.format(**places).lower() in lines[0].lower(), lines[0]
    assert lines[0].startswith("kvbroker"), lines[0]


def test_the_errors_of_a_replay_job_survive_the_trip_from_its_worker_process() -> None:
    """A parallel sweep's job fails in a worker and its error is pickled back: an error that
    cannot be rebuilt from its pickle breaks the pool (BrokenProcessPool, a traceback)."""
    from broker.replay.traces import TraceError
    from vllm_integration.events_from_vllm.zmq_events import CaptureError

    trace = pickle.loads(pickle.dumps(TraceError("t.jsonl", 3, "hash_ids", "expected a list")))
    assert (trace.path, trace.line, trace.field, trace.reason) == ("t.jsonl", 3, "hash_ids", "expected a list")
    assert str(trace) == "t.jsonl:3: hash_ids: expected a list"
    capture = pickle.loads(pickle.dumps(CaptureError("c.bin", 7, "torn")))
    assert (capture.path, capture.index, capture.reason, str(capture)) == ("c.bin", 7, "torn", "c.bin: record 7: torn")


# ---- a reader that closes early (head, less quit): the verb ends quietly, as Unix tools do

EXIT_BROKEN_PIPE = 141  # what the shell reports for `seq 1 1000000 | head -1` (128 + SIGPIPE)


@pytest.fixture(scope="module")
def broker_port() -> Iterator[str]:
    """A real `kvbroker serve` for status and ab to read."""
    serve = subprocess.Popen(
        [str(KVBROKER), "serve", "--listen", "127.0.0.1:0", "--journal", "none", "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline()
        yield str(json.loads(line)["port"])
    finally:
        serve.terminate()
        serve.wait(timeout=30)


PIPED: list[tuple[str, list[str]]] = [
    ("policies", ["policies"]),
    ("policies-json", ["policies", "--json"]),
    ("status", ["status", "--target", "127.0.0.1:{port}"]),
    ("status-json", ["status", "--target", "127.0.0.1:{port}", "--json"]),
    ("ab", ["ab", "--target", "127.0.0.1:{port}"]),
    ("ab-json", ["ab", "--target", "127.0.0.1:{port}", "--json"]),
    ("size", ["size", "--model", "llama-3-8b", "--tokens", "1000"]),
    ("replay", ["replay", "--trace", "{trace}", "--format", "mooncake", "--policy", "lru"]),
    ("replay-json", ["replay", "--trace", "{trace}", "--format", "mooncake", "--policies", "lru,fifo", "--json"]),
    ("repair", ["repair", "{journal}"]),
]


@pytest.mark.parametrize("argv", [pytest.param(argv, id=case) for case, argv in PIPED])
def test_a_reader_that_closed_its_end_ends_the_verb_quietly(argv: list[str], places: dict[str, str], broker_port: str) -> None:
    """stdout is a pipe whose reader has already gone: every write fails (EPIPE), always, not
    only when the output outgrows the pipe's buffer before `head` quits."""
    args = [a.format(port=broker_port, **places) for a in argv]
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([str(KVBROKER), *args], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert done.returncode == EXIT_BROKEN_PIPE, f"exit {done.returncode}: {done.stderr}"
    # No traceback, no "Exception ignored ... BrokenPipeError" (replay's progress lines may be there).
    assert not any(word in done.stderr for word in ("Traceback", "BrokenPipe", "Exception ignored")), done.stderr


def test_piped_into_head_the_first_line_comes_and_nothing_else(broker_port: str) -> None:
    """The issue's own commands, through a shell: the line head keeps, no noise on stderr."""
    for command in (f"{KVBROKER} policies | head -1", f"{KVBROKER} status --target 127.0.0.1:{broker_port} | head -1"):
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and len(done.stdout.splitlines()) == 1, done
        assert done.stderr == "", done.stderr


def test_vllm_bridge_with_the_broker_unreachable_says_so_once_and_stops_within_a_second(places: dict[str, str]) -> None:
    """Before: nothing logged for 30 s (the failures only in the stats' connect_failures),
    5.5 s to stop on SIGTERM, and "Future exception was never retrieved" on the way out."""
    closed = places["closed"]
    bridge = subprocess.Popen(
        [str(KVBROKER), "vllm-bridge", "--events", f"tcp://127.0.0.1:{closed}", "--broker", f"127.0.0.1:{closed}", "--model", "llama-3-8b"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(4.0)  # several connect attempts (backoff 0.05 s doubling to 2 s)
        asked = time.monotonic()
        bridge.send_signal(signal.SIGTERM)
        out, err = bridge.communicate(timeout=30)
        took = time.monotonic() - asked
    finally:
        if bridge.poll() is None:
            bridge.kill()
            bridge.wait()
    assert bridge.returncode == 0, err
    assert took < 1.0, f"stopped {took:.2f}s after SIGTERM"
    unreachable = [line for line in err.splitlines() if "cannot reach" in line]
    assert len(unreachable) == 1 and f"127.0.0.1:{closed}" in unreachable[0], err  # the change of state, once
    stopped = json.loads(out.splitlines()[-1])
    assert stopped["event"] == "stopped"
    assert stopped["ranks"][0]["client"]["connect_failures"] > 1, stopped  # retried, not logged each time
    for noise in ("never retrieved", "Traceback"):
        assert noise not in err, err
