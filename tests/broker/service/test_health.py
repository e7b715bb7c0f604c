"""gRPC health checking and reflection on a real broker, with a Redis journal that goes away.

The broker is assembled here as ``start_broker`` will assemble it once health and telemetry
are wired in (``start_ops_broker``): the same journal, service and servicer, plus
``broker.service.health.install`` and ``broker.service.telemetry.install`` before the server starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import subprocess
import sys
import time
import tomllib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from broker.config import BrokerConfig, ConfigError
from broker.config.health import health_config_from_dict
from broker.journal import Journal
from broker.service import health as health_mod
from broker.service import telemetry as telemetry_mod
from broker.service.broker_service import BrokerService
from broker.service.health import LIVENESS_SERVICE, SERVICE_NAME, HealthConfig, JournalWatch
from broker.service.server import SERVICE_NAME as SERVER_SERVICE_NAME
from broker.service.server import BrokerServicer, add_servicer, journal_for
from broker.service.telemetry import TelemetryConfig
from clients.broker_client import BrokerClient
from tests.conftest import small_config
from tests.redis_server import RedisServer, free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
ROOT = Path(__file__).parents[3]


@dataclasses.dataclass
class OpsBroker:
    server: grpc.aio.Server
    service: BrokerService
    port: int
    health: health_mod.Health
    telemetry: telemetry_mod.Telemetry

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def journal(self) -> Journal:
        return self.service.journal

    async def stop(self, grace: float = 1.0) -> None:
        # The order proposed for RunningBroker.stop: NOT_SERVING first, drain, flush, telemetry.
        await self.health.stop()
        await self.server.stop(grace)
        await asyncio.wait_for(self.service.journal.close(), 30)
        await self.telemetry.stop()


async def start_ops_broker(
    config: BrokerConfig, health_config: HealthConfig | None = None, telemetry_config: TelemetryConfig | None = None
) -> OpsBroker:
    """``start_broker`` with the health and telemetry ``install`` calls where they will go."""
    journal = journal_for(config)
    await journal.start()
    service = BrokerService(config, journal)
    server = grpc.aio.server()
    add_servicer(BrokerServicer(service), server)
    health = await health_mod.install(server, service, health_config or HealthConfig(poll_ms=50))
    telemetry = await telemetry_mod.install(server, service, telemetry_config or TelemetryConfig())
    port = server.add_insecure_port(config.listen)
    assert port, f"cannot listen on {config.listen}"
    await server.start()
    return OpsBroker(server, service, port, health, telemetry)


@contextlib.asynccontextmanager
async def ops_broker(config: BrokerConfig, **kwargs: HealthConfig | TelemetryConfig | None) -> AsyncIterator[OpsBroker]:
    broker = await start_ops_broker(config, **kwargs)  # type: ignore[arg-type]
    try:
        yield broker
    finally:
        await broker.stop()


async def check(target: str, service: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        status: int = response.status
        return status


async def wait_for(predicate: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


# ---- tests ----------------------------------------------------------------------------------------


async def test_check_is_serving_for_the_broker_the_server_and_liveness() -> None:
    async with ops_broker(small_config()) as broker:
        assert SERVICE_NAME == SERVER_SERVICE_NAME
        for name in (SERVICE_NAME, "", LIVENESS_SERVICE):
            assert await check(broker.target, name) == SERVING, name
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await check(broker.target, "no.such.Service")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


async def test_stopping_turns_every_status_not_serving_before_calls_drain() -> None:
    broker = await start_ops_broker(small_config())
    try:
        await broker.health.stop()
        for name in (SERVICE_NAME, "", LIVENESS_SERVICE):
            assert await check(broker.target, name) == NOT_SERVING, name
        # The broker itself still answers while it drains.
        async with BrokerClient(broker.target, "late") as client:
            await client.allocate("b", 10, ts_us=1)
            assert (await client.flush()) is not None
    finally:
        await broker.stop()


async def test_redis_down_is_not_serving_until_the_backlog_drains(redis_server: RedisServer) -> None:
    # No local spool (journal.spool_dir = ""): with nowhere to put records, the broker is
    # NOT_SERVING as soon as Redis is unreachable. With a spool it is NOT_SERVING once the
    # spool is full too (tests/broker/journal/test_spool.py).
    config = small_config(journal_url=redis_server.url)
    config = dataclasses.replace(config, journal=dataclasses.replace(config.journal, spool_dir=""))
    async with ops_broker(config, health_config=HealthConfig(poll_ms=50)) as broker:
        statuses: list[int] = []

        async def watch() -> None:
            async with grpc.aio.insecure_channel(broker.target) as channel:
                async for response in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME)):
                    statuses.append(response.status)

        watcher = asyncio.create_task(watch())
        try:
            async with BrokerClient(broker.target, "engine", max_batch_events=100) as client:
                # 1. Redis up: a batch is journaled and answered; the broker is SERVING.
                await client.allocate("a", 100, ts_us=1)
                await client.flush()
                assert await check(broker.target, SERVICE_NAME) == SERVING
                written = broker.journal.written

                # 2. Redis goes away; the next batch cannot be journaled (ack_after = journal,
                #    so its answer waits) and, once a write has failed, readiness goes NOT_SERVING.
                redis_server.stop()
                await client.allocate("b", 100, ts_us=2)
                answer = asyncio.create_task(client.flush())
                await wait_for(lambda: broker.journal.errors > 0, "a failed journal write")
                await wait_for(lambda: not broker.health.serving, "NOT_SERVING")
                assert await check(broker.target, SERVICE_NAME) == NOT_SERVING
                assert await check(broker.target, "") == NOT_SERVING
                assert await check(broker.target, LIVENESS_SERVICE) == SERVING  # no restart for a Redis outage
                assert broker.journal.pending > 0 and not answer.done()

                # 3. Redis is back (empty: it keeps nothing): the backlog drains in order,
                #    the waiting batch is answered, and the broker is SERVING again.
                redis_server.start()
                result = await asyncio.wait_for(answer, 20)
                assert result is not None and result.accepted_events == 1
                await wait_for(lambda: broker.health.serving, "SERVING again")
                assert broker.journal.pending == 0 and broker.journal.written > written
                assert await check(broker.target, SERVICE_NAME) == SERVING
            stream = config.stream_key()
            client_redis = redis_server.client()
            try:
                assert client_redis.xlen(stream) >= 1  # the batch sent during the outage is in the journal
            finally:
                client_redis.close()
            await wait_for(lambda: statuses[-1:] == [SERVING] and NOT_SERVING in statuses, "Watch to see the recovery")
            assert statuses == [SERVING, NOT_SERVING, SERVING]
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await watcher
            if redis_server.proc is None:  # a failed step left Redis down: let the journal flush
                redis_server.start()


async def test_reflection_lists_and_describes_the_broker_and_health_services() -> None:
    async with ops_broker(small_config()) as broker, grpc.aio.insecure_channel(broker.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
        ]
        responses = [r async for r in stub.ServerReflectionInfo(iter(requests))]
    names = {s.name for s in responses[0].list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    from google.protobuf import descriptor_pb2

    files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in responses[1].file_descriptor_response.file_descriptor_proto]
    services = {f"{f.package}.{s.name}": [m.name for m in s.method] for f in files for s in f.service}
    assert set(services[SERVICE_NAME]) >= {"Stream", "Submit", "GetResidency", "GetStats"}


async def test_health_probe_module_exit_codes_as_a_container_runs_it() -> None:
    def probe(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "broker.service.health_probe", *args], capture_output=True, text=True, timeout=30, cwd=ROOT
        )

    async with ops_broker(small_config()) as broker:
        ok = await asyncio.to_thread(probe, "--addr", broker.target, "--service", SERVICE_NAME)
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
        unknown = await asyncio.to_thread(probe, "--addr", broker.target, "--service", "nope")
        assert unknown.returncode == 1 and "SERVICE_UNKNOWN" in unknown.stderr
        await broker.health.stop()
        down = await asyncio.to_thread(probe, "--addr", broker.target)
        assert down.returncode == 1 and "NOT_SERVING" in down.stderr
    gone = await asyncio.to_thread(probe, "--addr", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert gone.returncode == 2 and "UNAVAILABLE" in gone.stderr


class FakeJournal:
    """What the watch reads of a journal without a spool: three counters (and no spool)."""

    saturated = None

    def __init__(self) -> None:
        self.errors = self.written = self.pending = 0
        self.last_error = ""


def test_journal_watch_fails_on_a_failed_write_with_a_backlog_and_recovers_on_progress() -> None:
    journal, watch = FakeJournal(), JournalWatch()
    assert watch.update(journal)  # type: ignore[arg-type]
    # Writes going through: healthy.
    journal.written, journal.pending = 10, 2
    assert watch.update(journal)  # type: ignore[arg-type]
    # A write fails and records wait: failing, with the error kept for the log.
    journal.errors, journal.pending, journal.last_error = 1, 5, "ConnectionError: refused"
    assert not watch.update(journal)  # type: ignore[arg-type]
    assert watch.last_error == "ConnectionError: refused"
    # No new failure but no progress either (a stuck writer): still failing.
    journal.pending = 7
    assert not watch.update(journal)  # type: ignore[arg-type]
    # Another failure in the same interval as a success: still failing.
    journal.errors, journal.written = 2, 12
    assert not watch.update(journal)  # type: ignore[arg-type]
    # Writes go through with no failure: healthy, even with records still waiting.
    journal.written, journal.pending = 15, 3
    assert watch.update(journal)  # type: ignore[arg-type]
    # A failure with nothing waiting (the record was written on retry) does not flap.
    journal.errors, journal.pending = 3, 0
    assert watch.update(journal)  # type: ignore[arg-type]


def test_health_config_defaults_values_and_toml_round_trip() -> None:
    assert health_config_from_dict({}) == HealthConfig(poll_ms=500, reflection=True)
    assert health_config_from_dict({"poll_ms": 100, "reflection": False}) == HealthConfig(100, False)
    for hc in (HealthConfig(), HealthConfig(100, False)):
        assert health_config_from_dict(tomllib.loads("\n".join(hc.toml_lines()))["health"]) == hc


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"poll_ms": "fast"}, "health.poll_ms: expected int"),
        ({"poll_ms": True}, "health.poll_ms: expected int"),
        ({"poll_ms": 1}, "health.poll_ms: must be in 10..60000"),
        ({"reflection": "yes"}, "health.reflection: expected bool"),
        ({"poll": 5}, "unknown key(s) health.poll"),
    ],
)
def test_health_config_errors_name_the_key(table: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        health_config_from_dict(table)
