"""The live broker and replay run the same core: a journal replays to the same directives,
one for one, from the file journal and from Redis."""

from __future__ import annotations

import dataclasses

from broker.cli.demo_workload import DEMO_CONFIG, DemoWorkload
from broker.config import JournalConfig, parse_config
from broker.journal import JournalSource
from broker.model.wire import directive_to_pb
from broker.replay.replay import journal_batches, journal_config, replay, replay_source
from broker.service.server import start_broker
from clients.broker_client import BrokerClient
from kvbroker.v1 import directive_pb2 as dpb
from tests.conftest import REDIS_URL


async def live_session(journal_url: str) -> list[dpb.Directive]:
    """Drive the demo workload (a short one) through a real broker; return what it sent."""
    config = dataclasses.replace(parse_config(DEMO_CONFIG), journal=JournalConfig(url=journal_url))
    broker = await start_broker(config)
    received: list[dpb.Directive] = []
    workload = DemoWorkload(requests=12, seed=3)
    try:
        async with BrokerClient(f"127.0.0.1:{broker.port}", "engine", max_batch_events=97, max_delay_s=0.01) as client:
            while not workload.done:
                for event in workload.step():
                    await client.add(event)
                await client.flush()
                for directive in client.drain_directives():
                    received.append(directive)
                    # Fail one in seven acks, as an engine sometimes must.
                    if directive.directive_id % 7 == 0:
                        await client.ack(directive.directive_id, failed=True, actual_tier=directive.from_tier, ts_us=workload.now_us)
                    else:
                        await client.ack(directive.directive_id, ts_us=workload.now_us)
    finally:
        await broker.stop(grace=1)
    return received


def replayed(source: JournalSource) -> list[dpb.Directive]:
    config = journal_config(source)
    assert config is not None
    sink: list = []
    replay(journal_batches(source), config, config.policy.name, sink=sink)
    return [directive_to_pb(d) for d in sink]


async def test_file_journal_replays_to_the_live_directives_one_for_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    url = f"file://{tmp_path}/live.journal"
    live = await live_session(url)
    assert len(live) > 100
    kinds = {d.kind for d in live}
    assert dpb.DIRECTIVE_KIND_DEMOTE in kinds and dpb.DIRECTIVE_KIND_PREFETCH in kinds
    assert replayed(JournalSource(url)) == live
    # And the built-in verification agrees.
    [result] = replay_source(JournalSource(url), ["priority_lru"], verify=True)
    assert result.mismatches == 0 and result.directives == len(live)


async def test_redis_journal_replays_to_the_live_directives_one_for_one(redis_stream_key: str) -> None:
    url = f"{REDIS_URL}?stream={redis_stream_key}"
    live = await live_session(url)
    assert len(live) > 100
    assert replayed(JournalSource(url)) == live
    [result] = replay_source(JournalSource(url), ["priority_lru"], verify=True)
    assert result.mismatches == 0


async def test_verification_catches_a_replay_that_differs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    url = f"file://{tmp_path}/live.journal"
    await live_session(url)
    source = JournalSource(url)
    config = journal_config(source)
    assert config is not None
    # Replaying on smaller tiers cannot give the same directives: verification must say so.
    smaller = dataclasses.replace(config, tiers=(dataclasses.replace(config.tiers[0], capacity_bytes=64 * 2**20), *config.tiers[1:]))
    result = replay(journal_batches(source), smaller, "priority_lru", expected=source.directives())
    assert result.mismatches and result.first_mismatch
