"""Processes of `kvbroker bench`: servers it starts (broker, echo), its load generators, and
what /proc says about a process (CPU time, peak RSS). Everything is loopback-only, bounded in
time, and stopped by whoever started it."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from broker.bench.load import RunResult, RunSpec, worker_main

START_TIMEOUT_S = 60.0  # a loaded 2-core machine starts Python slowly
STOP_TIMEOUT_S = 15.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all threads (/proc/PID/stat utime + stime)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (/proc/PID/status VmHWM)."""
    return _status_kib(pid, "VmHWM") * 1024


def rss_bytes(pid: int) -> int:
    return _status_kib(pid, "VmRSS") * 1024


def _status_kib(pid: int | str, key: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise ValueError(f"{key} not in /proc/{pid}/status")


class BenchError(RuntimeError):
    """The benchmark could not run (a server or a load generator failed); says why."""


class Server:
    """A server subprocess that prints one JSON ``listening`` line with its port."""

    def __init__(self, argv: list[str], log_path: str, name: str) -> None:
        """Runs in the directory of ``log_path`` (a temporary one): relative paths of the
        server's defaults (a spool, say) land there and go with it."""
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        cwd = os.path.dirname(log_path) or None
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL, cwd=cwd)
        try:
            self.port = self._wait_listening()
        except BaseException:
            self.stop()
            raise
        self.target = f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_listening(self) -> int:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    break
                with contextlib.suppress(ValueError):
                    message = json.loads(line)
                    if message.get("event") == "listening":
                        return int(message["port"])
            elif self.proc.poll() is not None:
                break
        raise BenchError(f"{self.name} did not start: {self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        self._log.flush()
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:]).strip() or "(no output)"
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM (graceful: the broker flushes its journal), then SIGKILL if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


def broker_argv(config_path: str, journal_url: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "broker.cli.main",
        "serve",
        "--config",
        config_path,
        "--listen",
        "127.0.0.1:0",
        "--journal",
        journal_url,
        "--log-level",
        "warning",
    ]


def echo_argv() -> list[str]:
    return [sys.executable, "-m", "broker.bench.echo", "--listen", "127.0.0.1:0"]


class Workers:
    """Load generator processes, one per stream, each with its engine's events encoded."""

    def __init__(self, needs: list[int], seed: int, prefix_cache: bool = False) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds gRPC state
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.info: list[dict[str, Any]] = []
        try:
            for client, events in enumerate(needs):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=worker_main, args=(child, client, events, seed, prefix_cache), daemon=True, name=f"kvbroker-bench-load-{client}"
                )
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
            # Encoding a few hundred thousand events takes seconds per worker.
            self.info = [
                self._recv(c, "ready", START_TIMEOUT_S + 10.0 * events / 100_000) for c, events in zip(self.conns, needs, strict=True)
            ]
        except BaseException:
            self.stop()
            raise

    def _recv(self, conn: Connection, expected: str, timeout: float) -> Any:
        if not conn.poll(timeout):
            raise BenchError(f"a load generator did not answer {expected!r} within {timeout:.0f}s")
        try:
            kind, value = conn.recv()
        except EOFError:
            raise BenchError(f"a load generator exited (waiting for {expected!r})") from None
        if kind == "error":
            raise BenchError(f"load generator: {value}")
        if kind != expected:
            raise BenchError(f"load generator answered {kind!r}, expected {expected!r}")
        return value

    def run(self, specs: list[RunSpec], on_go: Any = None, on_timed: Any = None) -> list[RunResult]:
        """One run on ``len(specs)`` streams started together. ``on_go()`` is called once
        every stream is open, just before they start; ``on_timed()`` once every stream has
        its last answer, before the cleanup batches."""
        conns = self.conns[: len(specs)]
        for conn, spec in zip(conns, specs, strict=True):
            conn.send(("run", spec))
        for conn in conns:
            self._recv(conn, "prepared", START_TIMEOUT_S)
        if on_go is not None:
            on_go()
        start_at = time.monotonic() + 0.05
        for conn in conns:
            conn.send(("go", start_at))
        limit = max(s.seconds for s in specs) + 60.0
        results: list[RunResult] = [self._recv(conn, "timed", limit) for conn in conns]
        if on_timed is not None:
            on_timed()
        for conn in conns:
            conn.send(("cleanup", None))
        for conn, result in zip(conns, results, strict=True):
            result.cleanup_events = self._recv(conn, "done", START_TIMEOUT_S)
        return results

    def stop(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("stop", None))
        for proc in self.procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.conns = []
        self.procs = []
