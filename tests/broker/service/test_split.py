"""Live A/B split: clients land on arms by a stable hash, each arm drives its clients."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from broker.config import ConfigError, JournalConfig, parse_config
from broker.journal import JournalSource
from broker.model.arms import arm_for, split_label
from broker.replay.replay import journal_batches, journal_config, replay
from broker.service.server import start_broker
from clients.broker_client import BrokerClient
from kvbroker.v1 import broker_service_pb2 as spb

KVBROKER = Path(sys.executable).parent / "kvbroker"
SPLIT = (("lru", 0.5), ("fifo", 0.5))

TIERS = """
[[tiers]]
name = "hbm"
capacity = 2000
[[tiers]]
name = "dram"
capacity = 1000000
"""


def split_config(url: str, extra: str = "") -> str:
    return f'[broker]\nlisten = "127.0.0.1:0"\n[policy]\nsplit = {{lru = 0.5, fifo = 0.5}}\n{extra}\n[journal]\nurl = "{url}"\n{TIERS}'


def clients_per_arm(n: int) -> dict[str, list[str]]:
    """The first ``n`` client ids of each arm, found by the hash itself."""
    out: dict[str, list[str]] = {"lru": [], "fifo": []}
    i = 0
    while min(len(v) for v in out.values()) < n:
        cid = f"engine-{i}"
        arm = arm_for(cid, SPLIT)
        if len(out[arm]) < n:
            out[arm].append(cid)
        i += 1
    return out


def test_split_config_is_validated_and_names_the_key() -> None:
    config = parse_config("[policy]\nsplit = {arc = 0.25, lru = 0.75}\n")
    assert config.core.policy.split == (("arc", 0.25), ("lru", 0.75))
    for text, key in (
        ("split = {arc = 0.5, lru = 0.4}", "shares must sum to 1"),
        ("split = {arc = 1.0}", "at least two arms"),
        ("split = {arc = 0.5, nosuch = 0.5}", "policy.split.nosuch"),
        ("split = {arc = 0.5, belady = 0.5}", "policy.split.belady"),
        ('split = {arc = "half", lru = 0.5}', "policy.split.arc"),
        ("split = {arc = 1.5, lru = -0.5}", "policy.split.arc"),
        ('split = {arc = 0.5, lru = 0.5}\nshadows = ["fifo"]', "cannot be combined with policy.shadows"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            parse_config(f"[policy]\n{text}\n")


def test_a_client_lands_on_the_same_arm_in_every_process() -> None:
    ids = [f"engine-{i}" for i in range(200)]
    here = [arm_for(c, SPLIT) for c in ids]
    # Independent computation: the first 8 bytes of blake2b against cumulative shares.
    expected = ["lru" if int.from_bytes(hashlib.blake2b(c.encode(), digest_size=8).digest(), "big") / 2**64 < 0.5 else "fifo" for c in ids]
    assert here == expected
    code = (
        "import json, sys; from broker.model.arms import arm_for; "
        "print(json.dumps([arm_for(c, (('lru', 0.5), ('fifo', 0.5))) for c in sys.argv[1:]]))"
    )
    for seed in ("1", "2"):  # Python's own str hash differs per seed; the arm must not
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code, *ids], capture_output=True, text=True, env=env, timeout=60, check=True)
        assert json.loads(out.stdout) == here
    shares = here.count("lru") / len(here)
    assert 0.35 < shares < 0.65  # both arms get clients, roughly by share


async def drive(port: int, client_id: str, seq_start: int = 0, n: int = 40) -> tuple[spb.HelloReply, list[str]]:
    """One engine: allocations beyond its arm's HBM share and re-accesses; the policies
    of the directives it got back."""
    async with BrokerClient(f"127.0.0.1:{port}", client_id, max_batch_events=8) as client:
        await client.wait_connected(timeout=10)
        hello = client.hello_reply
        assert hello is not None
        for i in range(seq_start, seq_start + n):
            await client.allocate(f"{client_id}/b{i}", 100, ts_us=1000 + i)
            if i % 3 == 0 and i > seq_start + 12:
                await client.access([f"{client_id}/b{i - 12}", f"{client_id}/b{seq_start}"], ts_us=1000 + i)
        await client.flush()
        got = [d.policy for d in client.drain_directives()]
    return hello, got


async def test_each_arm_drives_its_clients_and_reports_per_arm(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/split.journal"
    config = parse_config(split_config(url))
    arms_of = clients_per_arm(2)
    broker = await start_broker(config)
    try:
        policies_seen: dict[str, set[str]] = {}
        sent = 0
        for arm, ids in arms_of.items():
            for cid in ids:
                hello, got = await drive(broker.port, cid)
                assert hello.policy == arm  # the client learns its arm
                assert got, f"{cid} got no directives: its arm's HBM share must overflow"
                policies_seen[cid] = set(got)
                sent += len(got)
        stats = broker.service.stats()
        residency = broker.service.residency(spb.GetResidencyRequest())
    finally:
        await broker.stop(grace=1)
    for arm, ids in arms_of.items():
        for cid in ids:
            assert policies_seen[cid] == {arm}, f"{cid} belongs to {arm}"
    assert stats.policy == split_label(SPLIT)
    arms = {a.name: a for a in stats.arms}
    assert set(arms) == {"lru", "fifo"} and {a.role for a in arms.values()} == {"split"}
    assert arms["lru"].clients == 2 and arms["fifo"].clients == 2
    assert arms["lru"].accesses + arms["fifo"].accesses == sum(stats.accesses_by_tier.values())
    assert stats.batches == sum(1 for _ in JournalSource(url).batches())
    # Each arm runs on its share of every tier; together they are the configured tiers.
    assert [t.capacity_bytes for t in residency.tiers] == [2000, 1000000]
    assert residency.tiers[0].bytes <= 2000 and sum(t.blocks for t in residency.tiers) == 4 * 40

    # Replay following the journal routes clients the same way and reproduces every directive.
    source = JournalSource(url)
    recorded = journal_config(source)
    assert recorded is not None and recorded.policy.split == SPLIT
    verified = replay(journal_batches(source), recorded, None, expected=source.directives())
    assert verified.mismatches == 0 and verified.policy == split_label(SPLIT)
    assert verified.directives == sent
    # A comparison replay runs one policy for every client on the whole tiers.
    whole = replay(journal_batches(source), recorded, "lru")
    assert whole.policy == "lru" and whole.events == verified.events

    done = subprocess.run(
        [str(KVBROKER), "replay", "--journal", url, "--policies", "lru", "--verify", "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    records = {r["policy"]: r for r in json.loads(done.stdout)}
    assert records[split_label(SPLIT)]["verified"] is True and records["lru"]["verified"] is None


async def test_a_restarted_split_broker_rebuilds_each_arm_and_clients_resume(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/split.journal"
    config = parse_config(split_config(url))
    arms_of = clients_per_arm(1)
    broker = await start_broker(config)
    try:
        for ids in arms_of.values():
            await drive(broker.port, ids[0])
        before = broker.service.residency(spb.GetResidencyRequest(request_id=""))
        blocks_before = {
            b: (broker.service.find_block(b).tier, broker.service.find_block(b).size)  # type: ignore[union-attr]
            for ids in arms_of.values()
            for b in (f"{ids[0]}/b{i}" for i in range(40))
        }
        seqs = {cid: broker.service.core_for(cid).client_seq[cid] for ids in arms_of.values() for cid in ids}
    finally:
        await broker.stop(grace=1)
    again = await start_broker(config)
    try:
        assert again.service.recovered_batches == sum(1 for _ in JournalSource(url).batches())
        after = again.service.residency(spb.GetResidencyRequest(request_id=""))
        assert [(t.name, t.blocks, t.bytes) for t in after.tiers] == [(t.name, t.blocks, t.bytes) for t in before.tiers]
        for block_id, placed in blocks_before.items():
            block = again.service.find_block(block_id)
            assert block is not None and (block.tier, block.size) == placed
        for cid, seq in seqs.items():
            hello, _ = await drive(again.port, cid, seq_start=40, n=4)
            assert hello.last_batch_seq == seq  # resumes after what its arm applied
    finally:
        await again.stop(grace=1)


async def test_entering_a_split_is_refused_while_blocks_are_allocated_then_applies(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/j.journal"
    plain = f'[broker]\nlisten = "127.0.0.1:0"\n[policy]\nname = "lru"\n[journal]\nurl = "{url}"\n{TIERS}'
    broker = await start_broker(parse_config(plain))
    try:
        cid = clients_per_arm(1)["fifo"][0]
        await drive(broker.port, cid, n=10)
        refused = broker.service.reload(split_config(url))
        assert not refused.ok and "policy.split" in refused.error and "10 blocks" in refused.error
        assert broker.service.policy_name == "lru" and broker.service.generation == 1
        async with BrokerClient(f"127.0.0.1:{broker.port}", cid) as client:
            await client.free([f"{cid}/b{i}" for i in range(10)])
            await client.flush()
        seq = broker.service.core.client_seq[cid]
        applied = broker.service.reload(split_config(url))
        assert applied.ok, applied.error
        assert broker.service.policy_name == split_label(SPLIT) and applied.config_generation == 2
        # The client keeps its sequence across the change and now gets its arm's directives.
        hello, got = await drive(broker.port, cid, seq_start=100, n=40)
        assert hello.last_batch_seq == seq and hello.policy == "fifo" and set(got) == {"fifo"}
        # A change inside the split (a tier's capacity) is followed by every arm.
        bigger = split_config(url).replace("capacity = 1000000", "capacity = 2000000")
        assert broker.service.reload(bigger).ok
        assert all(c.tiers[1].capacity == 1000000 for c in broker.service.driving_cores().values())
    finally:
        await broker.stop(grace=1)
    source = JournalSource(url)
    recorded = journal_config(source)
    assert recorded is not None
    # Replay follows the journal through the change into the split, directive for directive.
    assert replay(journal_batches(source), recorded, None, expected=source.directives()).mismatches == 0


def test_split_arms_carry_shares_of_each_tier() -> None:
    from broker.model.arms import Driving

    config = parse_config("[policy]\nsplit = {arc = 0.25, lru = 0.75}\n" + TIERS).core
    driving = Driving(config, 1)
    caps = {name: [t.capacity for t in core.tiers] for name, core in driving.cores().items()}
    assert caps == {"arc": [500, 250000], "lru": [1500, 750000]}
    assert dataclasses.replace(config, policy=dataclasses.replace(config.policy, split=())).policy.split == ()
    assert JournalConfig().ack_after == "journal"


async def test_metrics_carry_each_split_arm(tmp_path: Path) -> None:
    import asyncio

    from tests.broker.service.test_health import free_port
    from tests.broker.service.test_telemetry import labels, scrape, series

    url = f"file://{tmp_path}/split.journal"
    config = parse_config(split_config(url, f"[telemetry]\nprometheus_port = {free_port()}\n"))
    broker = await start_broker(config)
    try:
        arms_of = clients_per_arm(1)
        for ids in arms_of.values():
            await drive(broker.port, ids[0])
        assert broker.telemetry is not None and broker.telemetry.metrics_url is not None
        samples = await asyncio.to_thread(scrape, broker.telemetry.metrics_url)
        stats = broker.service.stats()
    finally:
        await broker.stop(grace=1)
    events = series(samples, "kvbroker_events_total")
    # Each arm counts the events of its own clients: 40 allocations each.
    for arm in ("lru", "fifo"):
        assert events[labels(kind="allocated", policy=arm)] == 40
    directives = series(samples, "kvbroker_directives_total")
    by_arm: dict[str, float] = {}
    for lab, value in directives.items():
        assert dict(lab)["arm"] == "split"
        by_arm[dict(lab)["policy"]] = by_arm.get(dict(lab)["policy"], 0.0) + value
    assert set(by_arm) == {"lru", "fifo"} and all(v > 0 for v in by_arm.values())
    assert sum(by_arm.values()) == sum(stats.directives.values())
