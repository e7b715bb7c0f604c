"""A Redis Cluster of the test's own: six ``redis-server --cluster-enabled yes`` on free
loopback ports (three masters, a replica each, so that a master's failover can happen),
joined by ``redis-cli --cluster create``, each in its own temporary directory. A node is
killed (SIGKILL) and started again by port; ``stop`` kills every process by pid."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from tests.redis_server import free_port

# A master that does not answer for this long is failed over (a real cluster uses seconds).
NODE_TIMEOUT_MS = 1000


class RedisCluster:
    def __init__(self, nodes: int = 6) -> None:
        # Twelve distinct ports: free_port() can give a port it gave before (the socket that
        # found it is closed), and a node on a taken port exits at once (seen in CI).
        ports: list[int] = []
        while len(ports) < 2 * nodes:
            port = free_port()
            if port not in ports:
                ports.append(port)
        self.ports = ports[:nodes]
        # The cluster bus of each node on a free port of its own (by default port + 10000,
        # which may be taken, or past 65535).
        self.bus_ports = dict(zip(self.ports, ports[nodes:], strict=True))
        self.root = Path(tempfile.mkdtemp(prefix="kvbroker-cluster-"))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """A journal URL naming two nodes, so the client can learn the slot map from either."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:2])

    def start(self) -> None:
        for port in self.ports:
            self.start_node(port)
        for port in self.ports:
            self._wait_answers(port)
        cli = shutil.which("redis-cli")
        assert cli, "redis-cli is not installed (.ci/run installs redis-server, which brings it)"
        args = [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-replicas", "1", "--cluster-yes"]
        done = subprocess.run(args, capture_output=True, timeout=60, check=False)
        assert done.returncode == 0, f"redis-cli --cluster create failed: {done.stdout.decode()[-2000:]} {done.stderr.decode()[-2000:]}"
        self.wait_ok()

    def start_node(self, port: int) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (.ci/run installs it)"
        directory = self.root / str(port)
        directory.mkdir(exist_ok=True)
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory), "--save", "", "--appendonly", "no"]
        args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(NODE_TIMEOUT_MS)]
        # A replica's first sync at once (Redis waits 5 s by default for more replicas to join).
        args += ["--repl-diskless-sync-delay", "0"]
        args += ["--cluster-port", str(self.bus_ports[port]), "--daemonize", "no", "--logfile", str(directory / "redis.log")]
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill(self, port: int) -> None:
        """SIGKILL, as a crashed machine: nothing flushed, no goodbye to the cluster."""
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(timeout=10)

    def restart(self, port: int) -> None:
        """The node again, from its nodes.conf: it rejoins (as a replica once failed over)."""
        self.start_node(port)
        self._wait_answers(port)

    def stop(self) -> None:
        for port in list(self.procs):
            proc = self.procs.pop(port)
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, socket_connect_timeout=1)

    def info(self, port: int) -> dict[str, str]:
        client = self.client(port)
        try:
            text = client.execute_command("CLUSTER", "INFO")
        finally:
            client.close()
        raw = text.decode() if isinstance(text, bytes) else str(text)
        return dict(line.split(":", 1) for line in raw.split() if ":" in line)

    def master_of(self, key: str) -> int:
        """The port of the master that holds ``key``'s slot now (asked of a live node)."""
        for port in self.procs:
            client = self.client(port)
            try:
                slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
                for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        return int(master[1])
            except redis.RedisError:
                continue
            finally:
                client.close()
        raise AssertionError(f"no live node knows the master of {key!r}")

    def wait_failover(self, key: str, old_master: int, timeout: float = 30.0) -> int:
        """Wait until another node is the master of ``key``'s slot and the cluster is ok
        again; that node's port."""
        deadline = time.monotonic() + timeout
        while (master := self.master_of(key)) == old_master:
            assert time.monotonic() < deadline, f"no failover of {old_master} within {timeout}s"
            time.sleep(0.1)
        self.wait_ok(max(1.0, deadline - time.monotonic()))
        return master

    def role(self, port: int) -> str:
        client = self.client(port)
        try:
            role = client.execute_command("ROLE")[0]
        finally:
            client.close()
        return role.decode() if isinstance(role, bytes) else str(role)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Every live node says cluster_state:ok and has every slot assigned, and every
        replica's link to its master is up (its first sync done: it can be failed over to)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                infos = [self.info(port) for port in self.procs]
                if all(i.get("cluster_state") == "ok" and i.get("cluster_slots_ok") == "16384" for i in infos) and all(
                    self._synced(port) for port in self.procs
                ):
                    return
            except redis.RedisError:
                pass
            assert time.monotonic() < deadline, f"the cluster was not ok within {timeout}s"
            time.sleep(0.1)

    def _synced(self, port: int) -> bool:
        client = self.client(port)
        try:
            info = client.info("replication")
        finally:
            client.close()
        return info.get("role") == "master" or info.get("master_link_status") == "up"

    def _wait_answers(self, port: int) -> None:
        deadline = time.monotonic() + 10
        while True:
            client = self.client(port)
            try:
                client.ping()
                return
            except redis.ConnectionError:
                assert self.procs[port].poll() is None, f"redis-server on {port} exited with {self.procs[port].returncode}"
                assert time.monotonic() < deadline, f"redis-server on {port} did not answer within 10s"
                time.sleep(0.02)
            finally:
                client.close()
