"""Switching live inside vLLM 0.33's real CPUOffloadingManager (marker ``vllm``): the
deciding policy goes lru -> adaptive -> arc mid-stream through the settings file, a bad file
is refused while the run goes on, and ``kvbroker replay --journal ... --verify`` reproduces
every eviction across the switches; the evictions after a switch are not lru's.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]
CHUNKS = 400
REQUESTS = 600


def driver() -> Any:
    """tests/vllm_integration/decisions_to_vllm/manager_driver.py, imported when a test runs (it imports vLLM)."""
    from tests.vllm_integration.decisions_to_vllm import manager_driver

    return manager_driver


def replay_verify(url: str, *policies: str) -> dict[str, dict[str, Any]]:
    """``kvbroker replay --journal URL --verify --json``: its records by policy label."""
    cli = [sys.executable, "-m", "broker.cli.main", "replay", "--journal", url, "--policy", ",".join(policies), "--verify", "--json"]
    run = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    return {r["policy"]: r for r in json.loads(run.stdout)}


def write(path: Path, text: str) -> None:
    """Whole, as docs/vllm.md says to (a rename): the watcher never sees it half written."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def evictions_of(stores: list[Any]) -> list[Any]:
    return [key for store in stores if store for key in store]


def test_the_decider_switches_mid_stream_and_replay_verifies_every_eviction(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = f"file://{tmp_path}/vllm.journal"
    settings_file = tmp_path / "kvbroker.json"
    settings_file.write_text(json.dumps({"kvbroker_policy": "lru"}))
    # The watcher's thread would poll the file too: an hour apart, it does not here.
    manager = driver().kvbroker_manager("lru", CHUNKS, journal=url, settings_file=str(settings_file), settings_poll_s=3600)
    policy = manager._policy
    refused_at = []
    stores: list[Any] = []
    cut = [0]

    def switch(n: int) -> None:
        # The watcher's check, called here rather than waited for on its thread.
        if n == 150:
            cut[0] = len(stores)  # the stores made under lru alone
            settings_file.write_text(json.dumps({"kvbroker_policy": "adaptive"}))
            assert policy.live.check()
        elif n == 300:
            settings_file.write_text('{"kvbroker_policy": "arc",')  # half written: refused
            assert not policy.live.check()
            refused_at.append(n)
        elif n == 320:
            settings_file.write_text(json.dumps({"kvbroker_policy": "arc", "kvbroker_journal": "none"}))  # frozen: refused
            assert not policy.live.check()
            refused_at.append(n)
        elif n == 400:
            settings_file.write_text(json.dumps({"kvbroker_policy": "arc"}))
            assert policy.live.check()

    requests = list(driver().mooncake_requests(REQUESTS))
    hits, _ = driver().mooncake(manager, requests, evictions=stores, on_request=switch)
    assert (policy.settings.policy, policy.local.core.policy_name, policy.local.generation) == ("arc", "arc", 3)
    assert policy.live.refused == 2 and refused_at == [300, 320] and policy.live.reloads == 2
    assert "not valid JSON" in caplog.text and "kvbroker_journal: cannot change while vLLM runs" in caplog.text
    policy.close()
    evicted = evictions_of(stores)
    records = replay_verify(url, "lru", "arc")
    followed = records["lru->adaptive->arc"]
    assert followed["verified"] is True and followed["mismatches"] == 0 and followed["tail"] == "complete"
    assert followed["evictions"] == len(evicted) > 1000
    assert records["arc"]["verified"] is None  # another policy on the same traffic: an A/B
    # The switch really happened: kvbroker's lru alone, on the same requests, answers the
    # same up to request 150, and evicts otherwise after it.
    alone: list[Any] = []
    driver().mooncake(driver().kvbroker_manager("lru", CHUNKS), requests, evictions=alone)
    assert cut[0] > 50 and evictions_of(stores[: cut[0]]), "lru must have evicted before the switch"
    assert alone[: cut[0]] == stores[: cut[0]] and alone[cut[0] :] != stores[cut[0] :] and hits > 0


def test_the_watcher_thread_switches_a_running_stream_and_refuses_a_bad_file(tmp_path: Path) -> None:
    """The real thread, a short poll: a switch to arc while requests run concurrently (with
    token positions), then a file that is no JSON object, refused; the run goes on."""
    url = f"file://{tmp_path}/vllm.journal"
    settings_file = tmp_path / "kvbroker.json"
    manager = driver().kvbroker_manager("lru", 24, journal=url, settings_file=str(settings_file), settings_poll_s=0.02)
    policy = manager._policy
    started = [0]

    def wait_for(done: Any) -> None:
        deadline = time.monotonic() + 10
        while not done() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert done()

    def on_new_request(rng: random.Random) -> None:
        started[0] += 1
        if started[0] == 200:
            write(settings_file, json.dumps({"kvbroker_policy": "arc", "kvbroker_settings_poll_s": 0.02}))
            wait_for(lambda: policy.translator.reload_due)  # handed over; applied at the next call
        elif started[0] == 400:
            write(settings_file, "[]")
            wait_for(lambda: policy.live.refused == 1)

    trace = driver().random_stream(manager, 5, 8000, positions=True, docs=8, hints=on_new_request)
    policy.close()
    assert started[0] > 400 and policy.settings.policy == "arc" and policy.local.generation == 2 and policy.live.refused == 1
    assert not policy.live._thread.is_alive()
    records = replay_verify(url, "lru")
    followed = records["lru->arc"]
    assert followed["verified"] is True and followed["tail"] == "complete"
    evicted = sum(len(x[3]) for x in trace if x[0] == "store" and x[2] is not None)
    assert followed["evictions"] == evicted > 100
    # lru alone answers otherwise on the same seeded stream.
    assert driver().random_stream(driver().kvbroker_manager("lru", 24), 5, 8000, positions=True, docs=8) != trace
