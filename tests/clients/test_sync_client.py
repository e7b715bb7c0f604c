"""SyncBrokerClient: a synchronous engine's calls are bounded in time, drops are counted;
EngineHooks send what the KV events cannot carry."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time

import pytest

from broker.config import BrokerConfig, JournalConfig
from broker.service.server import RunningBroker, start_broker
from clients.sync_client import QueueFull, SyncBrokerClient
from kvbroker.v1 import intent_pb2 as pb
from tests.conftest import small_config
from vllm_integration.events_from_vllm.engine_hooks import EngineHooks
from vllm_integration.events_from_vllm.zmq_events import block_id

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def config_on(port: int) -> BrokerConfig:
    config = small_config()
    tiers = tuple(dataclasses.replace(t, capacity_bytes=t.capacity_bytes * 10_000) for t in config.core.tiers)
    return dataclasses.replace(
        config, listen=f"127.0.0.1:{port}", journal=JournalConfig(url="none"), core=dataclasses.replace(config.core, tiers=tiers)
    )


async def wait_for(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_calls_never_block_past_the_bound_when_the_broker_is_down_and_drops_are_counted() -> None:
    bound = 0.002
    client = SyncBrokerClient(
        f"127.0.0.1:{free_port()}",
        "engine",
        max_queued_events=100,
        max_block_s=bound,
        call_timeout_s=0.3,
        max_batch_events=10,
        max_pending_batches=5,
        backoff_max_s=0.1,
    )
    try:
        slowest = 0.0
        for i in range(1000):
            started = time.monotonic()
            client.allocate(f"b{i}", 100, ts_us=i)
            slowest = max(slowest, time.monotonic() - started)
        # The bound, plus scheduling slack of a busy machine.
        assert slowest < bound + 0.05
        counters = client.counters()
        assert counters["accepted_events"] == 1000
        # Held at most: 100 queued, 10 in the pump's hands, 5 batches of 10 unanswered, one
        # open batch of 10. Everything else was dropped here, oldest first, and counted.
        assert counters["queued_events"] == 100 and counters["client_unanswered_batches"] == 5
        assert 1000 - 170 <= counters["dropped_events"] < 1000 and counters["client_dropped_events"] == 0
        assert not client.connected
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            client.flush(timeout=0.2)
        assert time.monotonic() - started < 0.5
        assert client.wait_connected(0.1) is False
    finally:
        started = time.monotonic()
        assert client.close(timeout=0.3) is False  # not everything could be delivered
        assert time.monotonic() - started < 1.0
    assert client.counters()["client_abandoned_events"] > 0


def test_drop_newest_and_raise_refuse_the_new_event() -> None:
    port = free_port()
    newest = SyncBrokerClient(
        f"127.0.0.1:{port}", "a", max_queued_events=4, when_full="drop_newest", max_batch_events=1, max_pending_batches=1
    )
    raising = SyncBrokerClient(f"127.0.0.1:{port}", "b", max_queued_events=4, when_full="raise", max_batch_events=1, max_pending_batches=1)
    try:
        results = [newest.free([f"x{i}"]) for i in range(50)]
        assert results[:4] == [True] * 4 and results[-1] is False
        assert newest.counters()["refused_events"] == results.count(False) > 0
        with pytest.raises(QueueFull):
            for i in range(50):
                raising.free([f"x{i}"])
        assert raising.counters()["refused_events"] == 1
    finally:
        newest.close(timeout=0.1)
        raising.close(timeout=0.1)


async def test_events_queued_while_the_broker_is_down_arrive_when_it_comes() -> None:
    port = free_port()
    client = SyncBrokerClient(f"127.0.0.1:{port}", "engine", backoff_max_s=0.1, call_timeout_s=10)
    try:
        for i in range(50):
            assert client.allocate(f"b{i}", 100, ts_us=i)
        broker = await start_broker(config_on(port))
        try:
            await wait_for(lambda: len(broker.service.core.blocks) == 50)
            await asyncio.to_thread(client.flush, 10)
            counters = client.counters()
            assert counters["dropped_events"] == 0 and counters["queued_events"] == 0 and client.connected
            assert await asyncio.to_thread(client.close, 5) is True
        finally:
            await broker.stop(grace=1)
    finally:
        client.close(timeout=0.1)


async def test_directives_are_drained_and_acked_from_the_engine_thread(running_broker: RunningBroker) -> None:
    client = SyncBrokerClient(f"127.0.0.1:{running_broker.port}", "engine", call_timeout_s=10, max_batch_events=5)
    try:
        assert await asyncio.to_thread(client.wait_connected, 5)
        for i in range(30):  # small_config's HBM holds 1000 bytes: demotions follow
            client.allocate(f"b{i}", 100, ts_us=i)
        await asyncio.to_thread(client.flush, 10)
        directives = client.drain_directives()
        assert directives and client.drain_directives() == []
        for directive in directives:
            client.ack(directive.directive_id, ts_us=100)
        await asyncio.to_thread(client.flush, 10)
        assert running_broker.service.core.stats.acks_done == len(directives)
    finally:
        await asyncio.to_thread(client.close, 5)


async def test_hooks_send_phase_deadline_priority_and_drafts_for_the_bridges_blocks() -> None:
    broker = await start_broker(config_on(0))
    # The bridge of rank 1 of 2 allocated these (its ids: dp1/<hash key>).
    hashes: list[bytes | int] = [b"\x01" * 32, 2**64 - 1, b"\x03" * 32, 4]
    ids = [block_id(h, namespace="dp1/") for h in hashes]
    bridge = SyncBrokerClient(f"127.0.0.1:{broker.port}", "vllm-dp1", call_timeout_s=10)
    hooks_client = SyncBrokerClient(f"127.0.0.1:{broker.port}", "vllm-dp1-hooks", call_timeout_s=10)
    try:
        for bid in ids:
            bridge.allocate(bid, 100, ts_us=1)
        await asyncio.to_thread(bridge.flush, 10)
        hooks = EngineHooks(hooks_client, dp_rank=1, dp_size=2)
        assert hooks.block_ids(hashes) == ids
        core = broker.service.core
        now = 1_000_000

        hooks.prefill(hashes[:2], deadline_us=now + 50, request_priority=80, ts_us=now)
        hooks.drafts(hashes[2:], ts_us=now)
        await asyncio.to_thread(hooks_client.flush, 10)
        a, _, c, d = (core.blocks[bid] for bid in ids)
        assert (a.phase, a.priority, a.deadline_us, a.request_priority) == (pb.PHASE_PREFILL, pb.PRIORITY_HOT, now + 50, 80)
        assert c.is_draft and d.is_draft and c.phase == pb.PHASE_VERIFY

        hooks.decode_step(hashes[:2], next_step_us=now + 20_000, ts_us=now + 10)
        hooks.verified(hashes[2:], accepted=1, ts_us=now + 10)
        await asyncio.to_thread(hooks_client.flush, 10)
        assert (a.phase, a.priority, a.pinned, a.deadline_us) == (pb.PHASE_DECODE, pb.PRIORITY_DECODE_CRITICAL, True, now + 20_000)
        assert (c.is_draft, c.is_committed) == (False, True) and (d.phase, d.priority) == (pb.PHASE_ROLLBACK, pb.PRIORITY_COLD)

        hooks.finished(hashes[:2], ts_us=now + 30)
        await asyncio.to_thread(hooks_client.flush, 10)
        assert (a.phase, a.pinned, a.deadline_us) == (pb.PHASE_DONE, False, None)
        assert hooks.sent == 11 and hooks.refused == 0
        # A hint for a block the bridge has not allocated yet is rejected, and harmless.
        hooks.preempted([b"not-yet"], ts_us=now + 40)
        result = await asyncio.to_thread(hooks_client.flush, 10)
        assert result is not None and result.rejections[0].code == "FAILED_PRECONDITION"
    finally:
        await asyncio.to_thread(bridge.close, 5)
        await asyncio.to_thread(hooks_client.close, 5)
        await broker.stop(grace=1)


async def test_a_clean_close_logs_no_warning(running_broker: RunningBroker, caplog: pytest.LogCaptureFixture) -> None:
    """Everything answered, nothing pending: close() returns True and says nothing (it used
    to log "closing without every answer (TimeoutError)" on every close)."""
    client = SyncBrokerClient(f"127.0.0.1:{running_broker.port}", "engine", call_timeout_s=10, max_batch_events=5)
    assert await asyncio.to_thread(client.wait_connected, 5)
    for i in range(12):
        client.allocate(f"b{i}", 10, ts_us=i)
    await asyncio.to_thread(client.flush, 10)
    with caplog.at_level(logging.WARNING):
        assert await asyncio.to_thread(client.close, 5) is True
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert len(running_broker.service.core.blocks) == 12


async def test_a_close_with_events_it_cannot_deliver_still_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """The warning stays for what it is for: events that never reached a broker."""
    client = SyncBrokerClient(f"127.0.0.1:{free_port()}", "engine", call_timeout_s=0.3, backoff_max_s=0.05)
    client.allocate("b0", 10, ts_us=0)
    with caplog.at_level(logging.WARNING):
        assert await asyncio.to_thread(client.close, 0.3) is False
    assert any("closing without every answer" in r.getMessage() or "unanswered" in r.getMessage() for r in caplog.records)
