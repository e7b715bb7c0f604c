"""BrokerClient and SyncBrokerClient with batches the broker refuses whole (issue 19, item 4):
nothing may be dropped in silence. Each test failed before its fix (the refusal only
bumped ``counters.rejected_events``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from broker.service.server import RunningBroker
from clients.broker_client import BrokerClient, BrokerError
from clients.sync_client import SyncBrokerClient
from tests.conftest import small_config

BIG_TIERS = '[[tiers]]\nname = "hbm"\ncapacity = "1GiB"\n'


def target(broker: RunningBroker) -> str:
    return f"127.0.0.1:{broker.port}"


def allocated(broker: RunningBroker) -> int:
    return broker.service.stats().events.get("allocated", 0)


@pytest.mark.parametrize("running_broker", [small_config(extra="[limits]\nmax_events_per_batch = 100\n")], indirect=True)
async def test_the_client_sends_no_batch_over_the_brokers_event_limit(running_broker: RunningBroker) -> None:
    """Broker limit 100, client default 256: all 1,001 events are applied (1,000 were lost)."""
    async with BrokerClient(target(running_broker), "e", max_delay_s=30) as client:
        assert client.hello_reply is not None and client.hello_reply.max_events_per_batch == 100
        for i in range(1001):
            await client.allocate(f"b{i}", 1, ts_us=i)
        await client.flush()
        assert client.counters.refused_batches == 0
    assert allocated(running_broker) == 1001


class RefuseJournal:
    """The journal refuses the next ``n`` batches as a full spool does (UNAVAILABLE)."""

    def __init__(self, broker: RunningBroker, n: int) -> None:
        self.left = n
        self.real: Callable[[int], str | None] = broker.service.journal.refusal
        broker.service.journal.refusal = self  # type: ignore[method-assign]

    def __call__(self, nbytes: int) -> str | None:
        if self.left > 0:
            self.left -= 1
            return "Redis unreachable and the spool is full (test)"
        return self.real(nbytes)


async def test_unavailable_refusals_are_resent_with_the_same_batch_seq_and_nothing_is_lost(running_broker: RunningBroker) -> None:
    refuse = RefuseJournal(running_broker, 5)
    async with BrokerClient(target(running_broker), "e", max_batch_events=4, backoff_initial_s=0.02, max_delay_s=30) as client:
        client.keep_results = True
        for i in range(40):
            await client.allocate(f"b{i}", 1, ts_us=i)
        await asyncio.wait_for(client.flush(), 30)
        assert refuse.left == 0
        assert client.counters.refused_batches >= 5 and client.counters.retried_batches >= 5
        assert client.counters.failed_batches == 0
        applied = sorted(r.batch_seq for r in client.results if r.accepted_events)
    assert allocated(running_broker) == 40
    assert applied == list(range(1, 11))  # each batch applied once, with its own number
    assert running_broker.service.stats().refused_batches["journal"] == 5


@pytest.mark.parametrize("running_broker", [small_config(extra="[limits]\nmax_batch_work = 30\n")], indirect=True)
async def test_a_refusal_no_resend_can_fix_fails_loudly_and_later_batches_still_apply(running_broker: RunningBroker) -> None:
    async with BrokerClient(target(running_broker), "e", max_batch_events=50, max_delay_s=30) as client:
        for i in range(3):
            await client.allocate(f"ok{i}", 1, ts_us=i)
        await client.flush()
        for i in range(40):  # one batch of 40 events: over 30 block operations
            await client.allocate(f"big{i}", 1, ts_us=10 + i)
        with pytest.raises(BrokerError, match="max_batch_work"):
            await client.flush()
        assert client.counters.failed_batches == 1
        for i in range(3):  # the client numbers on past the hole the refused batch left
            await client.allocate(f"after{i}", 1, ts_us=100 + i)
        result = await client.flush()
        assert result is not None and result.accepted_events == 3
    assert allocated(running_broker) == 6


@pytest.mark.parametrize("running_broker", [small_config(extra="[limits]\nmax_batch_work = 30\n")], indirect=True)
async def test_the_sync_client_surfaces_a_refusal_through_flush(running_broker: RunningBroker) -> None:
    def run() -> dict[str, int]:
        with SyncBrokerClient(target(running_broker), "s", call_timeout_s=10, max_batch_events=50, max_delay_s=30) as client:
            for i in range(40):
                client.allocate(f"big{i}", 1, ts_us=i)
            with pytest.raises(BrokerError, match="refused"):
                client.flush()
            return client.counters()

    counters = await asyncio.to_thread(run)
    assert counters["client_failed_batches"] == 1 and counters["client_refused_batches"] == 1
