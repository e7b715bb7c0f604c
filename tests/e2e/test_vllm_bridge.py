"""`kvbroker vllm-bridge` (a real process) between vLLM 0.33's frames and `kvbroker serve` (a real process).

The engine side is tests/vllm_integration/events_from_vllm/vllm_wire.py's VllmPublisher: vLLM 0.33's PUB and replay
ROUTER with its exact bytes (checked against vLLM's own publisher by the ``vllm``-marked
tests). ``Truth`` is the test's account of what vLLM holds: per block, the announcements
outstanding per medium. After every scenario the broker must hold exactly that, per client
and tier, through GetResidency and `kvbroker status --json`.

Each scenario is one of issue 21's defects; each fails on main.
"""

from __future__ import annotations

import collections
import json
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from clients import kvsize
from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import broker_service_pb2_grpc as spb_grpc
from tests.vllm_integration.events_from_vllm.vllm_wire import (
    Engine,
    Truth,
    WireEvent,
    all_blocks_cleared,
    block_removed,
    block_stored,
    engines,
    offloaded,
)
from vllm_integration.events_from_vllm.zmq_events import block_id

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

KVBROKER = pathlib.Path(sys.executable).parent / "kvbroker"
BLOCK_BYTES = kvsize.bytes_per_block(kvsize.get_model("llama-3-8b"), 16)
TIB = 2**40
BROKER_TOML = f"""
[policy]
name = "lru"
[[tiers]]
name = "hbm"
capacity = {TIB}
[[tiers]]
name = "dram"
capacity = {4 * TIB}
[[tiers]]
name = "nvme"
capacity = {16 * TIB}
"""


# ---- the processes -------------------------------------------------------------------------------


class Process:
    """A kvbroker process; its stdout lines are collected by a thread."""

    def __init__(self, args: list[str], log: pathlib.Path) -> None:
        self.log = log
        self._err = log.open("w")
        self.proc = subprocess.Popen([str(KVBROKER), *args], stdout=subprocess.PIPE, stderr=self._err, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def json_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in list(self.lines) if line.startswith("{")]

    def first_json(self, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self.json_lines():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.proc.args[1]} did not start: {self.log.read_text()}")
            time.sleep(0.02)
        return self.json_lines()[0]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(30)
        self._reader.join(5)
        self._err.close()
        return code


@pytest.fixture
def broker(tmp_path: pathlib.Path) -> Iterator[str]:
    config = tmp_path / "broker.toml"
    config.write_text(BROKER_TOML)
    serve = Process(
        ["serve", "--config", str(config), "--listen", "127.0.0.1:0", "--journal", f"file://{tmp_path}/broker.journal"],
        tmp_path / "serve.log",
    )
    try:
        yield f"127.0.0.1:{serve.first_json()['port']}"
    finally:
        assert serve.stop() == 0


def start_bridge(tmp_path: pathlib.Path, target: str, ranks: list[Engine], *extra: str) -> Process:
    bridge = Process(
        [
            "vllm-bridge",
            "--events",
            f"tcp://127.0.0.1:{ranks[0].pub_port}",
            "--replay",
            f"tcp://127.0.0.1:{ranks[0].replay_port}",
            "--topic",
            "kv-events",
            "--broker",
            target,
            "--model",
            "llama-3-8b",
            "--dp-size",
            str(len(ranks)),
            "--replay-timeout",
            "5",
            *extra,
        ],
        tmp_path / "bridge.log",
    )
    assert bridge.first_json()["event"] == "bridging"
    for engine in ranks:
        engine.publisher.wait_subscribed(20)
    return bridge


# ---- the broker's view -------------------------------------------------------------------------


def residency(target: str, **query: Any) -> spb.GetResidencyResponse:
    """GetResidency; a block the broker does not hold answers with no block."""
    with grpc.insecure_channel(target) as channel:
        try:
            response: spb.GetResidencyResponse = spb_grpc.BrokerServiceStub(channel).GetResidency(
                spb.GetResidencyRequest(**query), timeout=10
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND and "block_id" in query:
                return spb.GetResidencyResponse()
            raise
        return response


def tier_totals(target: str) -> dict[str, int]:
    totals = residency(target, totals=True)
    assert totals.dropped_blocks == 0
    return {t.name: t.blocks for t in totals.tiers if t.blocks}


def mirrors(target: str, expected: dict[str, str]) -> bool:
    """The broker holds exactly ``expected``: each block in its tier (GetResidency by id), and
    per tier no other block (the totals)."""
    if tier_totals(target) != dict(collections.Counter(expected.values())):
        return False
    for bid, tier in expected.items():
        found = residency(target, block_id=bid).blocks
        if [(b.tier, b.size_bytes) for b in found] != [(tier, BLOCK_BYTES)]:
            return False
    return True


def until_mirrors(target: str, truth: Truth, timeout: float = 20.0) -> None:
    expected = truth.expected()
    deadline = time.monotonic() + timeout
    while not mirrors(target, expected):
        if time.monotonic() > deadline:
            got = {bid: [b.tier for b in residency(target, block_id=bid).blocks] for bid in expected}
            raise AssertionError(f"the broker does not hold what vLLM holds: totals {tier_totals(target)}, expected {expected}, got {got}")
        time.sleep(0.05)


def status(target: str) -> dict[str, Any]:
    done = subprocess.run([str(KVBROKER), "status", "--target", target, "--json"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    record: dict[str, Any] = json.loads(done.stdout)
    return record


def finish(bridge: Process, target: str, truth: Truth) -> dict[str, Any]:
    """Stop the bridge; the broker must still hold exactly what vLLM holds, per client and
    tier. Returns the bridge's last stats line."""
    until_mirrors(target, truth)
    assert bridge.stop() == 0, bridge.log.read_text()
    stopped = bridge.json_lines()[-1]
    assert stopped["event"] == "stopped"
    expected = truth.expected()
    assert mirrors(target, expected)
    per_tier = {t["name"]: t["blocks"] for t in status(target)["tiers"] if t["blocks"]}
    assert per_tier == dict(collections.Counter(expected.values()))
    for rank in stopped["ranks"]:
        assert rank["client"]["rejected_events"] == 0 and rank["lost_batches"] == 0
        namespace = f"dp{rank['rank']}/" if len(stopped["ranks"]) > 1 else ""
        held = {bid for bid in expected if bid.startswith(namespace)} if namespace else set(expected)
        assert rank["held_blocks"] == len(held), rank
    return stopped


def scenario(tmp_path: pathlib.Path, target: str, dp_size: int = 1, *extra: str) -> tuple[Truth, list[Engine], Process]:
    truth = Truth(dp_size)
    ranks = engines(truth, dp_size)
    return truth, ranks, start_bridge(tmp_path, target, ranks, *extra)


def closing(ranks: list[Engine]) -> Callable[[], None]:
    def close() -> None:
        for engine in ranks:
            engine.publisher.close()

    return close


# ---- the scenarios ---------------------------------------------------------------------------


def test_offloaded_copies_with_block_size_0_land_in_dram_and_nvme(tmp_path: pathlib.Path, broker: str) -> None:
    truth, ranks, bridge = scenario(tmp_path, broker)
    try:
        (engine,) = ranks
        chain = [bytes([n]) * 32 for n in range(1, 5)]
        engine.send(block_stored(chain))
        # The offloading connector copies the four blocks to CPU, two of them on to STORAGE,
        # announcing each copy by its hash alone (block_size 0).
        engine.send(*(offloaded(h, "CPU") for h in chain), *(offloaded(h, "STORAGE") for h in chain[2:]))
        # The GPU evicts them; then the CPU drops the two that STORAGE also holds.
        engine.send(block_removed(chain))
        until_mirrors(broker, truth)
        assert truth.expected() == {block_id(h): "dram" for h in chain}
        engine.send(block_removed(chain[2:], "CPU"))
        assert truth.expected() == {**{block_id(h): "dram" for h in chain[:2]}, **{block_id(h): "nvme" for h in chain[2:]}}
        stopped = finish(bridge, broker, truth)
        translator = stopped["ranks"][0]["translator"]
        assert translator["unsized_stored"] == 6 and translator["malformed_events"] == 0 and translator["unknown_medium"] == 0
    finally:
        closing(ranks)()
        bridge.stop()


def test_a_hash_stored_twice_and_removed_once_stays(tmp_path: pathlib.Path, broker: str) -> None:
    truth, ranks, bridge = scenario(tmp_path, broker)
    try:
        (engine,) = ranks
        # Two offloaded chunks overlapping a shared prefix both announce hash 2; two requests
        # computed the same GPU block 9.
        engine.send(block_stored([1, 2], medium="CPU", block_size=16), block_stored([2, 3], 1, medium="CPU"))
        engine.send(block_stored([9]), block_stored([9]))
        # One chunk and one GPU block go.
        engine.send(block_removed([1, 2], "CPU"), block_removed([9]))
        assert set(truth.expected()) == {"2", "3", "9"}
        stopped = finish(bridge, broker, truth)
        translator = stopped["ranks"][0]["translator"]
        assert (translator["duplicate_stored"], translator["shared_removed"]) == (2, 2)
    finally:
        closing(ranks)()
        bridge.stop()


@pytest.mark.parametrize("old_batches", [5, 20], ids=["new-seq-above-the-old", "new-seq-right-after-the-old"])
def test_an_engine_restart_whose_first_20_batches_were_missed_is_detected(tmp_path: pathlib.Path, broker: str, old_batches: int) -> None:
    # Two ranks; rank 1's engine restarts. The bridge misses the new engine's first 20
    # batches while it reconnects, so the first one it sees (seq 20) is above the old
    # engine's last seq (4), or right after it (19): the seq never goes back.
    truth, ranks, bridge = scenario(tmp_path, broker, 2)
    try:
        for n in range(old_batches):
            for engine in ranks:
                engine.send(
                    block_stored([f"old-{n}-a".encode(), f"old-{n}-b".encode()]),
                    *([block_removed([f"old-{n - 1}-a".encode()])] if n else []),
                )
        until_mirrors(broker, truth)
        old_rank1 = {bid for bid in truth.expected() if bid.startswith("dp1/")}
        assert old_rank1
        ranks[1].restart()
        for n in range(20):
            ranks[1].send(block_stored([f"new-{n}".encode()], f"new-{n - 1}".encode() if n else None), missed=True)
        ranks[1].publisher.wait_subscribed(20)
        for n in range(20, 25):
            ranks[1].send(block_stored([f"new-{n}".encode()], f"new-{n - 1}".encode()))
        ranks[0].send(block_stored([b"rank-0-goes-on"]))
        expected = truth.expected()
        assert not old_rank1 & set(expected) and len([b for b in expected if b.startswith("dp1/")]) == 25
        stopped = finish(bridge, broker, truth)
        rank0, rank1 = stopped["ranks"]
        assert rank0["restarts"] == 0 and rank1["restarts"] == 1
        assert rank1["restart_causes"] == {"replay_differs": 1} and rank1["disconnects"] >= 1
        assert rank1["translator"]["clears"] == 1 and rank1["last_seq"] == 24
        log = bridge.log.read_text()
        assert "rank 1: the engine restarted (its replay socket holds another batch at seq" in log
    finally:
        closing(ranks)()
        bridge.stop()


def test_unknown_keys_are_counted_per_name_and_logged(tmp_path: pathlib.Path, broker: str) -> None:
    truth, ranks, bridge = scenario(tmp_path, broker)
    try:
        (engine,) = ranks
        # A newer vLLM's events: the known fields count, the unknown keys are skipped.
        engine.send(block_stored([1]), (block_stored([5]), {"priority_hint": 2}), (block_removed([1]), {"reason": "lru"}))
        engine.send(block_stored([6]), (block_stored([7]), {"priority_hint": 2}))
        stopped = finish(bridge, broker, truth)
        assert stopped["unknown_keys"] == {"BlockRemoved.reason": 1, "BlockStored.priority_hint": 2}
        assert stopped["ranks"][0]["translator"]["unknown_keys"] == stopped["unknown_keys"]
        log = bridge.log.read_text()
        assert log.count("unknown key 'BlockStored.priority_hint'") == 1 and "unknown key 'BlockRemoved.reason'" in log
    finally:
        closing(ranks)()
        bridge.stop()


def test_the_counters_are_visible_while_the_bridge_runs(tmp_path: pathlib.Path, broker: str) -> None:
    stats_file = tmp_path / "bridge-stats.json"
    truth, ranks, bridge = scenario(tmp_path, broker, 1, "--stats-interval", "0.2", "--stats-file", str(stats_file))
    try:
        (engine,) = ranks
        engine.send(block_stored([1, 2]), (block_stored([3]), {"priority_hint": 2}))
        until_mirrors(broker, truth)
        # A stats line on stdout and the stats file both show it, while the bridge runs.
        deadline = time.monotonic() + 20
        while not any(line.get("unknown_keys") for line in bridge.json_lines() if line["event"] == "stats"):
            assert time.monotonic() < deadline, bridge.json_lines()[-1:]
            time.sleep(0.05)
        while json.loads(stats_file.read_text())["ranks"][0]["applied"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        record = json.loads(stats_file.read_text())
        assert record["unknown_keys"] == {"BlockStored.priority_hint": 1} and record["time"] > time.time() - 60
        assert record["ranks"][0]["held_blocks"] == 3
        finish(bridge, broker, truth)
    finally:
        closing(ranks)()
        bridge.stop()


def test_a_clear_and_every_medium_together_leave_exactly_what_vllm_holds(tmp_path: pathlib.Path, broker: str) -> None:
    # All of the above in one stream, with a prefix-cache reset in the middle, on two ranks.
    truth, ranks, bridge = scenario(tmp_path, broker, 2)
    try:
        rng = random.Random(21)
        for n in range(60):
            for engine in ranks:
                held = sorted(_hashes(truth, engine.rank))
                events: list[WireEvent] = [block_stored([n * 10 + engine.rank, n * 10 + 5], rng.choice(held) if held else None)]
                if held and rng.random() < 0.6:
                    events.append(offloaded(rng.choice(held), rng.choice(["CPU", "STORAGE"])))
                if held and rng.random() < 0.5:
                    victim = rng.choice(held)
                    medium = rng.choice([m for m, c in _hashes(truth, engine.rank)[victim].items() if c > 0])
                    events.append(block_removed([victim], medium))
                if n == 30 and engine.rank == 0:
                    events.append(all_blocks_cleared())
                engine.send(*events)
        expected = truth.expected()
        assert {"hbm", "dram", "nvme"} <= set(expected.values())
        finish(bridge, broker, truth)
    finally:
        closing(ranks)()
        bridge.stop()


def _hashes(truth: Truth, rank: int) -> dict[int, collections.Counter[str]]:
    """The int hashes rank ``rank`` holds, with their media."""
    prefix = f"dp{rank}/" if truth.dp_size > 1 else ""
    return {int(bid[len(prefix) :]): media for bid, media in truth.ranks[rank].items()}
