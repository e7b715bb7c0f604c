"""A real ``kvbroker serve`` (issue 41, items 13 and 14): it forks while gRPC serves, for a
shadow added by the Reload RPC and for its snapshots; a restart on its journal starts from
the last snapshot; ``replay --verify`` holds."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from broker.journal import RecordKind
from broker.journal.file import read_file_journal
from clients.broker_client import BrokerClient
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import broker_service_pb2_grpc as spb_grpc

KVBROKER = Path(sys.executable).parent / "kvbroker"


def config_text(shadows: str) -> str:
    return f"""
[policy]
name = "lru"
shadows = [{shadows}]
[journal]
snapshot_batches = 1000
[[tiers]]
name = "hbm"
capacity = 200000
[[tiers]]
name = "dram"
capacity = 100000000
"""


def start(tmp_path: Path, journal: str) -> tuple[subprocess.Popen[str], str]:
    config = tmp_path / "broker.toml"
    config.write_text(config_text(""))
    proc = subprocess.Popen(
        [str(KVBROKER), "serve", "--config", str(config), "--listen", "127.0.0.1:0", "--journal", journal],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    port = json.loads(proc.stdout.readline())["port"]
    return proc, f"127.0.0.1:{port}"


def stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return err


def test_serve_forks_for_a_new_shadow_and_for_snapshots_and_restarts_from_the_last(tmp_path: Path) -> None:
    journal = f"file://{tmp_path}/j.journal"
    proc, target = start(tmp_path, journal)

    async def scenario() -> tuple[list[str], int]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = spb_grpc.BrokerServiceStub(channel)
            async with BrokerClient(target, "engine", max_batch_events=4) as client:
                n = 0

                async def stream(batches: int) -> None:
                    nonlocal n
                    for _ in range(batches):
                        for _ in range(4):
                            await client.allocate(f"b{n}", 1000, ts_us=n)
                            n += 1
                        assert await client.flush() is not None
                        client.drain_directives()

                await stream(600)
                reply = await stub.Reload(spb.ReloadRequest(config_toml=config_text('"arc"')))
                assert reply.ok, reply.error
                deadline = time.monotonic() + 60
                arms: list[str] = []
                while time.monotonic() < deadline:  # the shadow joins once copied and caught up
                    await stream(20)
                    arms = [a.policy for a in (await stub.GetStats(spb.GetStatsRequest())).arms]
                    if "arc" in arms:
                        break
                await stream(1800)
                return arms, n

    try:
        arms, _ = asyncio.run(scenario())
    finally:
        err = stop(proc)
    assert arms == ["lru", "arc"], err
    records = list(read_file_journal(f"{tmp_path}/j.journal"))
    batches = sum(r.kind == RecordKind.BATCH for r in records)
    assert batches >= 2400 and sum(r.kind == RecordKind.SNAPSHOT for r in records) >= 3, err  # 2 marks, a state at least
    # The restart starts from the last snapshot: fewer batches to apply than the journal has.
    proc, _ = start(tmp_path, journal)
    err = stop(proc)
    recovered = int(err.split("recovered ")[1].split(" batches")[0])
    assert 0 < recovered < batches - 900, err
    verify = subprocess.run([str(KVBROKER), "replay", "--journal", journal, "--verify", "--json"], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr
    assert '"snapshots_wrong": 0' in verify.stdout and '"snapshots_checked": 0' not in verify.stdout
