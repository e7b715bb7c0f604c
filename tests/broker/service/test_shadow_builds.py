"""A reload that adds a shadow copies the primary off the event loop (issue 41, item 13):
the loop keeps serving batches while the copy is taken, and the shadow that joins is the
one a synchronous copy at the reload would have given."""

from __future__ import annotations

import asyncio
import copy
import os
import random
from pathlib import Path
from typing import Any

import pytest

from broker.config import parse_config
from broker.journal.base import NullJournal
from broker.model.core import Core
from broker.model.wire import read_batch
from broker.service import shadow_builds
from broker.service.broker_service import BrokerService
from broker.service.forked_copy import ForkedCopy
from kvbroker.v1 import intent_pb2 as pb
from tests.builders import access, alloc

TIERS = """
[journal]
url = "none"
[[tiers]]
name = "hbm"
capacity = 3000000
[[tiers]]
name = "dram"
capacity = 40000000
"""


def config_text(shadows: str = "") -> str:
    return f'[policy]\nname = "lru"\nshadows = [{shadows}]\n{TIERS}'


class Feed:
    """The same batches for every service: allocations, then a mix of accesses and new blocks."""

    def __init__(self) -> None:
        self.seq = 0
        self.blocks = 0
        self.rng = random.Random(41)

    def fill(self, count: int) -> list[bytes]:
        out = []
        for start in range(0, count, 500):
            out.append(self._batch([alloc(f"b{i}", 1000, ts=i) for i in range(start, min(count, start + 500))]))
        self.blocks = count
        return out

    def mixed(self) -> bytes:
        ts = 1_000_000 + self.seq
        events = [access(*(f"b{self.rng.randrange(self.blocks)}" for _ in range(8)), ts=ts)]
        events.append(alloc(f"b{self.blocks}", 1000, ts=ts))
        self.blocks += 1
        return self._batch(events)

    def _batch(self, events: list[pb.Event]) -> bytes:
        self.seq += 1
        return pb.IntentBatch(client_id="c", batch_seq=self.seq, events=events).SerializeToString()


def submit(service: BrokerService, raw: bytes) -> None:
    service.submit(read_batch(raw), raw)


def fingerprint(core: Core) -> dict[str, Any]:
    """What a shadow holds and has counted."""
    s = core.stats
    return {
        "policy": core.policy_name,
        "generation": core.generation,
        "tiers": core.tier_usage(),
        "where": {b.block_id: b.tier for b in core.blocks.values()},
        "counts": (s.accesses, s.hit_rate(), s.evictions, s.demotions, s.prefetches, s.bytes_up, s.bytes_down, dict(s.directives)),
    }


def test_a_reload_adding_a_shadow_keeps_serving_and_the_shadow_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    feed = Feed()
    fill = feed.fill(20_000)
    live = BrokerService(parse_config(config_text()), NullJournal(512))
    reference = BrokerService(parse_config(config_text()), NullJournal(512))
    for raw in fill:
        submit(live, raw)
        submit(reference, raw)

    # The reference copies synchronously, as a broker that cannot fork does.
    monkeypatch.setattr(shadow_builds, "forking_available", lambda: False)
    assert reference.reload(config_text('"arc", "s3fifo"')).ok
    monkeypatch.undo()

    async def scenario() -> int:
        served_during_copy = 0
        deep_copy = copy.deepcopy

        def no_deep_copy_here(x: Any, *args: Any) -> Any:
            if isinstance(x, Core):
                raise AssertionError("the reload deep-copied the core on the event loop")
            return deep_copy(x, *args)

        copy.deepcopy = no_deep_copy_here
        try:
            reply = live.reload(config_text('"arc", "s3fifo"'))
        finally:
            copy.deepcopy = deep_copy
        assert reply.ok and reply.config_generation == 2
        # The loop goes on serving, one batch per iteration, while the copy is taken.
        while live.shadow_builds:
            raw = feed.mixed()
            submit(live, raw)
            submit(reference, raw)
            served_during_copy += 1
            await asyncio.sleep(0.001 if served_during_copy % 50 else 0.05)
            assert served_during_copy < 100_000, "the shadows never joined"
        return served_during_copy

    served = asyncio.run(scenario())
    assert served > 0, "no batch was served while the shadows were copied"
    assert list(live.shadows) == ["arc", "s3fifo"]
    for _ in range(200):
        raw = feed.mixed()
        submit(live, raw)
        submit(reference, raw)
    for name in ("arc", "s3fifo"):
        assert fingerprint(live.shadows[name]) == fingerprint(reference.shadows[name])
    assert live.shadows["arc"].stats.evictions + live.shadows["arc"].stats.demotions > 0  # it decided something


def test_a_shadow_being_copied_follows_a_later_reload_and_can_be_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    feed = Feed()
    live = BrokerService(parse_config(config_text()), NullJournal(512))
    reference = BrokerService(parse_config(config_text()), NullJournal(512))
    for raw in feed.fill(3000):
        submit(live, raw)
        submit(reference, raw)
    monkeypatch.setattr(shadow_builds, "forking_available", lambda: False)
    assert reference.reload(config_text('"arc", "sieve"')).ok
    monkeypatch.undo()
    assert live.reload(config_text('"arc", "sieve"')).ok
    assert set(live.shadow_builds) == {"arc", "sieve"}
    # A second reload while they are copied: sieve goes, a tier grows; arc must follow it.
    grown = config_text('"arc"').replace("40000000", "50000000")
    for raw in [feed.mixed() for _ in range(5)]:
        submit(live, raw)
        submit(reference, raw)
    assert live.reload(grown).ok and reference.reload(grown).ok
    assert set(live.shadow_builds) == {"arc"}
    for build in live.shadow_builds.values():
        assert build.copy.wait(60)
    while live.shadow_builds:
        raw = feed.mixed()
        submit(live, raw)
        submit(reference, raw)
    assert list(live.shadows) == ["arc"]
    assert fingerprint(live.shadows["arc"]) == fingerprint(reference.shadows["arc"])
    assert live.shadows["arc"].tiers[1].capacity == 50_000_000


def test_a_bad_shadow_is_refused_before_anything_is_copied() -> None:
    live = BrokerService(parse_config(config_text()), NullJournal(512))
    reply = live.reload(config_text('"arc", "no_such_policy"'))
    assert not reply.ok and "shadows" in reply.error
    assert not live.shadow_builds and not live.shadows and live.generation == 1


def test_a_copy_that_fails_in_the_child_is_taken_on_the_loop_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    feed = Feed()
    live = BrokerService(parse_config(config_text()), NullJournal(512))
    reference = BrokerService(parse_config(config_text()), NullJournal(512))
    for raw in feed.fill(2000):
        submit(live, raw)
        submit(reference, raw)

    def unpicklable(*args: Any, **kwargs: Any) -> bytes:
        raise TypeError("cannot pickle this policy")

    monkeypatch.setattr(shadow_builds.pickle, "dumps", unpicklable)  # the child inherits it
    assert live.reload(config_text('"arc"')).ok
    monkeypatch.undo()
    [build] = live.shadow_builds.values()
    assert build.copy.wait(60) and build.copy.error is not None and "cannot pickle this policy" in build.copy.error
    live.advance_shadow_builds()
    assert "the copy off the event loop failed" in caplog.text and "cannot pickle this policy" in caplog.text
    # Copied from the primary as it is now: the same as a synchronous copy at this point.
    monkeypatch.setattr(shadow_builds, "forking_available", lambda: False)
    assert reference.reload(config_text('"arc"')).ok
    assert fingerprint(live.shadows["arc"]) == fingerprint(reference.shadows["arc"])


def test_the_copying_child_holds_none_of_the_parents_files(tmp_path: Path) -> None:
    """A journal's lock held by a copying child would refuse a restart after the broker's
    kill for as long as the child runs."""
    held = os.open(tmp_path / "journal.lock", os.O_RDWR | os.O_CREAT)
    try:

        def probe() -> bytes:
            try:
                os.fstat(held)
            except OSError:
                return b"closed"
            return b"open"

        copied = ForkedCopy(probe)
        assert copied.wait(60)
        assert copied.error is None and copied.result == b"closed"
    finally:
        os.close(held)


async def test_the_copy_off_the_loop_works_in_a_broker_serving_grpc() -> None:
    """The fork of a broker whose gRPC server and a client run in the process: gRPC's fork
    handlers crashed the child (SIGSEGV / SIGABRT), and the copy fell back to the loop."""
    from clients.broker_client import BrokerClient
    from tests.broker.service.test_reload import config_text, start_broker

    assert os.environ.get("GRPC_ENABLE_FORK_SUPPORT") == "false"  # set by broker.service, before gRPC started
    rest = '[journal]\nurl = "none"\n[broker]\nlisten = "127.0.0.1:0"\n'
    broker = await start_broker(parse_config(config_text("lru") + rest))
    try:
        async with BrokerClient(f"127.0.0.1:{broker.port}", "engine", max_batch_events=8) as client:
            for i in range(300):
                await client.allocate(f"b{i}", 100, ts_us=i)
            await client.flush()
            assert broker.service.reload(config_text("lru", 'shadows = ["arc"]') + rest).ok
            build = broker.service.shadow_builds["arc"]
            await client.allocate("after", 100, ts_us=1000)
            await client.flush()
            assert await asyncio.to_thread(build.copy.wait, 60)
            assert build.copy.error is None and build.copy.result is not None
    finally:
        await broker.stop(grace=1)
