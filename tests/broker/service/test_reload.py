"""Live config reload (SIGHUP, file change, RPC) and shadow policies."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from broker.config import JournalConfig, parse_config
from broker.journal import JournalSource
from broker.replay.replay import replay_source
from broker.service.server import start_broker, watch_config
from clients.broker_client import BrokerClient
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import broker_service_pb2_grpc as spb_grpc
from kvbroker.v1 import intent_pb2 as pb

KVBROKER = Path(sys.executable).parent / "kvbroker"

TIERS = """
[[tiers]]
name = "hbm"
capacity = 2000
[[tiers]]
name = "dram"
capacity = 1000000
"""


def config_text(policy: str, extra: str = "") -> str:
    return f'[policy]\nname = "{policy}"\n{extra}\n{TIERS}'


def test_reload_three_ways_while_streaming(tmp_path: Path) -> None:
    """A real `kvbroker serve`: SIGHUP, a file change and the Reload RPC, while a client
    streams; bad configs are refused and the old one keeps serving."""
    config = tmp_path / "broker.toml"
    config.write_text(config_text("lru"))
    journal = f"file://{tmp_path}/j.journal"
    proc = subprocess.Popen(
        [str(KVBROKER), "serve", "--config", str(config), "--listen", "127.0.0.1:0", "--journal", journal],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    port = json.loads(proc.stdout.readline())["port"]
    target = f"127.0.0.1:{port}"

    async def scenario() -> list[tuple[int, str]]:
        seen: list[tuple[int, str]] = []  # (generation, policy) of every directive
        async with grpc.aio.insecure_channel(target) as channel:
            stub = spb_grpc.BrokerServiceStub(channel)

            async def generation() -> int:
                return int((await stub.GetConfig(spb.GetConfigRequest())).config_generation)

            async with BrokerClient(target, "engine", max_batch_events=8) as client:
                n = 0

                async def stream(batches: int) -> None:
                    nonlocal n
                    for _ in range(batches):
                        for _ in range(8):
                            await client.allocate(f"b{n}", 100, ts_us=n)
                            n += 1
                        result = await client.flush()
                        assert result is not None and not result.rejections
                        seen.extend((d.config_generation, d.policy) for d in client.drain_directives())

                await stream(5)
                # 1. SIGHUP after editing the file to priority_lru (the watcher may see the
                # edit first: either way it is one reload).
                config.write_text(config_text("priority_lru"))
                os.kill(proc.pid, signal.SIGHUP)
                deadline = time.monotonic() + 10
                while await generation() < 2 and time.monotonic() < deadline:
                    await stream(1)
                assert await generation() == 2
                await stream(5)
                # 2. A file change alone: the watcher reloads it.
                config.write_text(config_text("arc"))
                deadline = time.monotonic() + 10
                while await generation() < 3 and time.monotonic() < deadline:
                    await stream(1)
                    await asyncio.sleep(0.05)
                assert await generation() == 3
                await stream(5)
                # 3. The RPC.
                reply = await stub.Reload(spb.ReloadRequest(config_toml=config_text("two_queue")))
                assert reply.ok and reply.config_generation == 4 and reply.policy == "two_queue"
                await stream(5)
                # Invalid configs are refused with the reason; the old one keeps serving.
                for bad, needle in (
                    (config_text("no_such_policy"), "policy.name"),
                    ('[[tiers]]\nname = "hbm"\ncapacity = -1\n', "tiers[0].capacity"),
                    ("[policy\nname =", "malformed TOML"),
                ):
                    refused = await stub.Reload(spb.ReloadRequest(config_toml=bad))
                    assert not refused.ok and needle in refused.error and refused.config_generation == 4
                await stream(3)
                assert (await stub.GetConfig(spb.GetConfigRequest())).policy == "two_queue"
        return seen

    try:
        seen = asyncio.run(scenario())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0
    # Directives come from the policy of the generation they were decided under.
    policies = {1: "lru", 2: "priority_lru", 3: "arc", 4: "two_queue"}
    assert {(g, p) for g, p in seen} <= set(policies.items())
    assert {g for g, _ in seen} >= {1, 4}
    # Every batch in the journal exactly once, in order; the journal replays exactly.
    seqs = [pb.IntentBatch.FromString(r.payload).batch_seq for r in JournalSource(journal).batches()]
    assert seqs == list(range(1, len(seqs) + 1))
    [verified] = replay_source(JournalSource(journal), ["lru"], verify=True)
    assert verified.mismatches == 0


async def test_shadow_counters_equal_a_replay_of_the_journal(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/j.journal"
    text = config_text("priority_lru", 'shadows = ["lru", "arc"]\n[journal]\nurl = "none"\n') + '\n[broker]\nlisten = "127.0.0.1:0"\n'
    # the [journal] table above is replaced by the test's journal
    config = parse_config(text.replace('[journal]\nurl = "none"\n', ""))
    import dataclasses

    config = dataclasses.replace(config, journal=JournalConfig(url=url))
    broker = await start_broker(config)
    try:
        async with BrokerClient(f"127.0.0.1:{broker.port}", "engine", max_batch_events=16) as client:
            for i in range(200):
                await client.allocate(f"b{i}", 100, ts_us=i, priority=(1, 2, 3)[i % 3])
                if i % 5 == 0 and i > 20:
                    await client.access([f"b{i - 20}", f"b{i // 2}"], ts_us=i)
            await client.flush()
        stats = broker.service.stats()
    finally:
        await broker.stop(grace=1)
    arms = {a.name: a for a in stats.arms}
    assert set(arms) == {"priority_lru", "lru", "arc"} and arms["lru"].role == "shadow"
    replays = {r.policy: r.metrics for r in replay_source(JournalSource(url), ["lru", "arc", "priority_lru"])}
    for name, arm in arms.items():
        m = replays[name]
        got = (arm.accesses, arm.evictions, arm.demotions, arm.prefetches)
        assert got == (m["accesses"], m["evictions"], m["demotions"], m["prefetches"])
        assert arm.hit_rate == m["hit_rate"]
    # The shadows really decided differently from the primary.
    assert arms["arc"].demotions != arms["priority_lru"].demotions or arms["arc"].hit_rate != arms["priority_lru"].hit_rate


async def test_a_reload_may_not_shrink_a_tier_below_what_it_holds() -> None:
    config = parse_config('[broker]\nlisten = "127.0.0.1:0"\n[journal]\nurl = "none"\n' + TIERS)
    broker = await start_broker(config)
    try:
        async with BrokerClient(f"127.0.0.1:{broker.port}", "engine") as client:
            for i in range(15):
                await client.allocate(f"b{i}", 100, ts_us=i)
            await client.flush()
        rest = '[journal]\nurl = "none"\n[broker]\nlisten = "127.0.0.1:0"\n'
        refused = broker.service.reload(TIERS.replace("capacity = 2000", "capacity = 500") + rest)
        assert not refused.ok and "tiers[0].capacity" in refused.error and "holds now" in refused.error
        moved = broker.service.reload(rest + '[[tiers]]\nname = "other"\ncapacity = 5\n')
        assert not moved.ok and "cannot change while running" in moved.error
        assert broker.service.generation == 1
    finally:
        await broker.stop(grace=1)


def test_ab_shows_the_primary_and_its_shadows_side_by_side(tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_text(config_text("priority_lru", 'shadows = ["lru", "arc"]'))
    proc = subprocess.Popen(
        [str(KVBROKER), "serve", "--config", str(config), "--listen", "127.0.0.1:0", "--journal", "none"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    port = json.loads(proc.stdout.readline())["port"]
    try:

        async def drive() -> None:
            async with BrokerClient(f"127.0.0.1:{port}", "engine", max_batch_events=10) as client:
                for i in range(60):
                    await client.allocate(f"b{i}", 100, ts_us=i)
                    if i > 30:
                        await client.access([f"b{i - 25}"], ts_us=i)
                await client.flush()

        asyncio.run(drive())
        done = subprocess.run([str(KVBROKER), "ab", "--target", f"127.0.0.1:{port}", "--json"], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        record = json.loads(done.stdout)
        arms = {a["name"]: a for a in record["arms"]}
        assert set(arms) == {"priority_lru", "lru", "arc"}
        assert arms["priority_lru"]["role"] == "primary" and arms["lru"]["role"] == "shadow"
        assert all(a["accesses"] == 29 for a in arms.values())
        human = subprocess.run([str(KVBROKER), "ab", "--target", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=30)
        assert "arc" in human.stdout and "shadow" in human.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


async def test_ab_counts_each_policy_in_force_and_shows_no_twin_of_the_primary(tmp_path: Path) -> None:
    """Reloads deadline_edf -> arc -> lru with shadows lru and arc: the primary row counts
    what lru did since it took over (it was credited with what deadline_edf and arc served),
    and the lru shadow, the primary's twin now, is not a row of its own."""
    rest = '[journal]\nurl = "none"\n[broker]\nlisten = "127.0.0.1:0"\n'
    shadows = 'shadows = ["lru", "arc"]'
    broker = await start_broker(parse_config(config_text("deadline_edf", shadows) + rest))
    accesses: list[int] = []
    try:
        async with BrokerClient(f"127.0.0.1:{broker.port}", "engine", max_batch_events=8) as client:
            for phase, policy in enumerate(("deadline_edf", "arc", "lru")):
                if phase:
                    assert broker.service.reload(config_text(policy, shadows) + rest).ok
                before = broker.service.core.stats.accesses
                for i in range(40):
                    await client.allocate(f"p{phase}-b{i}", 100, ts_us=1000 * phase + i)
                    if i > 10:
                        await client.access([f"p{phase}-b{i - 10}"], ts_us=1000 * phase + i)
                await client.flush()
                accesses.append(broker.service.core.stats.accesses - before)
        stats = broker.service.stats()
    finally:
        await broker.stop(grace=1)
    rows = [(a.name, a.role) for a in stats.arms]
    assert rows == [("lru", "primary"), ("arc", "shadow")]
    primary = stats.arms[0]
    assert accesses[2] > 0 and primary.accesses == accesses[2]  # lru's own, not the run's
    assert stats.arms[1].accesses == sum(accesses)  # a shadow ran its one policy all along


# A policy parameter that passed validation and then raised building the policy (issue 41:
# OverflowError, a 46-line traceback at start, UNKNOWN over the Reload RPC, and the config
# file's watcher task died, so later good files were never applied).
BAD_PARAM = config_text("lru_k", "[policy.params]\nretained_ratio = 1e308")


def test_a_bad_policy_parameter_is_one_config_error_at_start(tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_text(BAD_PARAM)
    done = subprocess.run(
        [str(KVBROKER), "serve", "--config", str(config), "--listen", "127.0.0.1:0", "--journal", "none"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "policy.params: policy lru_k: retained_ratio must be a number in [0, 1024], got 1e+308" in done.stderr


async def test_a_bad_policy_parameter_is_refused_by_rpc_and_by_the_file_watcher_which_lives_on(tmp_path: Path) -> None:
    path = tmp_path / "broker.toml"
    rest = '[journal]\nurl = "none"\n[broker]\nlisten = "127.0.0.1:0"\n'
    path.write_text(config_text("lru") + rest)
    broker = await start_broker(parse_config(path.read_text()), str(path))
    watcher = asyncio.get_running_loop().create_task(watch_config(broker.service, str(path), interval=0.02))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{broker.port}") as channel:
            stub = spb_grpc.BrokerServiceStub(channel)
            refused = await stub.Reload(spb.ReloadRequest(config_toml=BAD_PARAM + rest))
            assert not refused.ok and refused.config_generation == 1
            assert refused.error == "policy.params: policy lru_k: retained_ratio must be a number in [0, 1024], got 1e+308"
        # Through the file: refused, the watcher lives, a good file written after applies.
        path.write_text(BAD_PARAM + rest)
        await asyncio.sleep(0.3)
        assert broker.service.generation == 1 and not watcher.done()
        path.write_text(config_text("arc") + rest)
        deadline = time.monotonic() + 10
        while broker.service.generation == 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert broker.service.generation == 2 and broker.service.policy_name == "arc" and not watcher.done()
    finally:
        watcher.cancel()
        await broker.stop(grace=1)
