"""gRPC health checking and server reflection, for grpcurl, load balancers and Kubernetes.

Statuses served by the standard ``grpc.health.v1.Health`` service:

- ``kvbroker.v1.BrokerService`` and ``""`` (the whole server): SERVING, or NOT_SERVING
  while the journal cannot take records durably:

  - a Redis journal with a local spool (``journal.spool_dir``, the default): NOT_SERVING
    while Redis is unreachable AND the spool is full (batches are then refused with
    UNAVAILABLE, or their records dropped, per ``journal.spool_full``). While the spool
    still has room the broker answers as usual, so it stays SERVING; it is SERVING again
    as soon as a write to Redis goes through (the spool then drains);
  - any other journal (a file, or Redis with ``spool_dir = ""``): NOT_SERVING while it is
    unreachable, i.e. a write failed and records are still waiting; SERVING again once
    writes go through (the backlog drains or shrinks with no new failure).

  Use this for readiness: with ``journal.ack_after = "journal"`` a broker whose journal is
  down with nowhere to spool cannot answer batches.
- ``liveness``: SERVING while the process and its event loop answer, whatever the journal
  does. Use this for liveness: restarting the broker never brings Redis back, and a restart
  would drop what is queued in memory.

Every status goes NOT_SERVING for good when the broker starts stopping (``Health.stop``),
so probes and balancers stop sending before calls are drained.

A small task polls the journal (``Journal.saturated``, or ``errors``, ``written``,
``pending``) every ``health.poll_ms`` and sets the statuses; nothing is added to the
request path.
Reflection (``grpc.reflection.v1alpha.ServerReflection``) lists the broker, health and
reflection services, so ``grpcurl -plaintext HOST:PORT list`` works without proto files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from broker.config.health import HealthConfig

if TYPE_CHECKING:
    import grpc

    from broker.journal import Journal
    from broker.service.broker_service import BrokerService

log = logging.getLogger("kvbroker.health")

SERVICE_NAME = "kvbroker.v1.BrokerService"  # broker.service.server.SERVICE_NAME (not imported: this module stays light)
OVERALL = ""
LIVENESS_SERVICE = "liveness"
HEALTH_SERVICE_NAME = "grpc.health.v1.Health"
READINESS_SERVICES = (SERVICE_NAME, OVERALL)


class JournalWatch:
    """Whether the journal is writing, from its counters sampled at each poll.

    Failing: a write failed since the last poll and records are waiting. Healthy again: no
    new failure since the last poll, and either nothing is waiting or writes went through.
    A writer stuck with records waiting and no progress stays failing. A journal with a
    spool says itself (``Journal.saturated``): failing exactly while its backend is
    unreachable and its spool is full.
    """

    def __init__(self) -> None:
        self.failing = False
        self.last_error = ""
        self._errors: int | None = None
        self._written = 0

    def update(self, journal: Journal) -> bool:
        """Sample ``journal``; returns True when it is healthy."""
        errors, written, pending = journal.errors, journal.written, journal.pending
        saturated = journal.saturated
        if saturated is not None:  # a journal with a spool knows: unreachable and spool full
            self._errors, self._written = errors, written
            self.failing = saturated
            if saturated:
                self.last_error = f"{journal.last_error}; spool full"
            return not self.failing
        if self._errors is None:
            self._errors, self._written = errors, written
            return not self.failing
        new_errors = errors > self._errors
        progressed = written > self._written
        self._errors, self._written = errors, written
        if new_errors and pending > 0:
            self.failing = True
            self.last_error = journal.last_error
        elif self.failing and not new_errors and (pending == 0 or progressed):
            self.failing = False
        return not self.failing


class Health:
    """The health servicer plus the journal watcher task; ``stop`` ends both."""

    def __init__(self, servicer: Any, service: BrokerService, config: HealthConfig) -> None:
        self.servicer = servicer
        self.service = service
        self.config = config
        self.watch = JournalWatch()
        self.serving = True
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        from grpc_health.v1 import health_pb2

        for name in (*READINESS_SERVICES, LIVENESS_SERVICE):
            await self.servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvbroker-health")

    async def check_now(self) -> bool:
        """Sample the journal once and set the statuses; returns whether serving."""
        from grpc_health.v1 import health_pb2

        healthy = self.watch.update(self.service.journal)
        if healthy != self.serving:
            self.serving = healthy
            status = health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in READINESS_SERVICES:
                await self.servicer.set(name, status)
            journal = self.service.journal
            if healthy:
                log.info("journal %s writes again (pending %d): SERVING", journal.description, journal.pending)
            else:
                log.warning(
                    "journal %s unreachable (%s; pending %d, spooled %d): NOT_SERVING",
                    journal.description,
                    self.watch.last_error,
                    journal.pending,
                    journal.spool_records,
                    extra={
                        "journal_pending": journal.pending,
                        "journal_errors": journal.errors,
                        "journal_spool_bytes": journal.spool_bytes,
                        "journal_dropped": journal.dropped,
                    },
                )
        return healthy

    async def _run(self) -> None:
        period = self.config.poll_ms / 1000
        while True:
            try:
                await self.check_now()
            except Exception:  # the watcher must outlive any surprise; say so and go on
                log.exception("health check of the journal failed")
            await asyncio.sleep(period)

    async def stop(self) -> None:
        """Every status NOT_SERVING for good, then stop watching (call before draining)."""
        await self.servicer.enter_graceful_shutdown()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def _health_of(config: Any) -> HealthConfig:
    if isinstance(config, HealthConfig):
        return config
    health = getattr(config, "health", None)
    return health if isinstance(health, HealthConfig) else HealthConfig()


async def install(server: grpc.aio.Server, service: BrokerService, config: Any) -> Health:
    """Add the health (and reflection) services to ``server`` before it starts, set every
    status SERVING and start the journal watcher. ``config``: the BrokerConfig (its
    ``health`` field) or a HealthConfig."""
    from grpc_health.v1 import health, health_pb2_grpc

    hc = _health_of(config)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if hc.reflection:
        from grpc_reflection.v1alpha import reflection

        import kvbroker.v1.broker_service_pb2  # noqa: F401  (the broker's descriptors, for reflection)

        reflection.enable_server_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
    handle = Health(servicer, service, hc)
    await handle.start()
    return handle
