"""The demo's deadline-bound workload: deadlines are missed there, and where a policy puts
the announced blocks decides how many."""

from __future__ import annotations

from typing import Any

import pytest

from broker.cli.demo_workload import DEADLINE_CONFIG, DemoWorkload
from broker.config import parse_config
from broker.replay.replay import replay
from kvbroker.v1 import intent_pb2 as pb


def batches(seed: int, requests: int = 40) -> list[pb.IntentBatch]:
    """One batch per engine iteration, as the demo's client sends them."""
    workload = DemoWorkload(requests=requests, seed=seed, deadline_bound=True)
    out: list[pb.IntentBatch] = []
    while not workload.done:
        events = workload.step()
        if events:
            out.append(pb.IntentBatch(client_id="engine", batch_seq=len(out) + 1, events=events))
    return out


def run(seed: int, policy: str) -> dict[str, Any]:
    got = batches(seed)
    return replay(lambda: ((1, b) for b in got), parse_config(DEADLINE_CONFIG).core, policy).metrics


def test_announced_blocks_carry_deadlines_but_no_pin() -> None:
    workload = DemoWorkload(requests=8, seed=1, deadline_bound=True)
    announced = []
    for _ in range(20):
        announced += [e.intent_updated for e in workload.step() if e.intent_updated.HasField("deadline_us")]
    assert announced
    assert all(not u.HasField("priority") and not u.pin_requested and u.slack_us == 0 for u in announced)


@pytest.mark.parametrize("seed", [1, 4, 7])
def test_deadlines_bind_and_deadline_edf_misses_fewer_than_priority_lru(seed: int) -> None:
    lru, plru, edf = (run(seed, p) for p in ("lru", "priority_lru", "deadline_edf"))
    assert lru["deadline_accesses"] == plru["deadline_accesses"] == edf["deadline_accesses"] > 0
    for m in (lru, plru, edf):
        assert m["rejected_events"] == 0
        assert m["deadline_misses"] > 0  # the deadlines bind, for every policy
    assert edf["deadline_misses"] < plru["deadline_misses"]
