"""A test-owned ``redis-server`` on a free loopback port, stopped by pid and started again on
the same port: what a test needs to take Redis away under a running broker."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """``redis-server`` with no persistence while it runs. With ``directory`` it saves its
    data there when stopped (SIGTERM) and loads it when started again, as a Redis with
    persistence comes back; without, it comes back empty. ``args`` are more redis-server
    options; with ``password`` (its ``--requirepass``) the readiness check and ``client()``
    authenticate."""

    def __init__(self, port: int, directory: Path | None = None, *, args: tuple[str, ...] = (), password: str | None = None) -> None:
        self.port = port
        self.directory = directory
        self.args = args
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (.ci/run installs it)"
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--daemonize", "no"]
        if self.directory is not None:
            args += ["--dir", str(self.directory), "--shutdown-on-sigterm", "save"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen([*args, *self.args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    assert self.proc.poll() is None, f"redis-server exited with {self.proc.returncode}"
                    assert time.monotonic() < deadline, "redis-server did not answer within 10s"
                    time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, db=db, socket_timeout=5)
