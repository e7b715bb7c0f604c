"""Soak: a real ``kvbroker serve`` holds several concurrent client streams for a while.

Four BrokerClient streams on loopback each drive the built-in demo workload
(broker/cli/demo_workload.py: prefill with a shared prefix, round-robin decode announced one
iteration ahead, requests freed when done) round after round, with their own block ids,
acking every directive, until the time is up. Asserted: no stream error, no rejected event,
every batch answered, the file journal holds every batch exactly once (per client, batch_seq
1..N in order), and the broker's resident memory stays flat once warmed up.

Duration: ``KVBROKER_SOAK_SECONDS`` (default 20, the CI run); a long run sets e.g. 600:

    KVBROKER_SOAK_SECONDS=600 .venv/bin/python -m pytest -p no:cacheprovider -n 0 -m soak tests/e2e/test_soak.py

Marked ``e2e`` and ``soak`` (``-m "not soak"`` leaves it out).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from broker.cli.demo_workload import DEMO_CONFIG, ITERATION_US, DemoWorkload
from broker.journal import JournalSource
from clients.broker_client import BrokerClient
from kvbroker.v1 import intent_pb2 as pb
from tests.broker.service.test_fuzz_server import Broker

pytestmark = [pytest.mark.e2e, pytest.mark.soak]

SOAK_SECONDS = float(os.environ.get("KVBROKER_SOAK_SECONDS", "20"))
STREAMS = 4
# Memory is sampled once this share of the run is over (imports, gRPC threads, the first
# rounds' allocator arenas, the policy structures at their working-set size are all there
# by then), and again at the end.
WARMUP_SHARE = 0.3
# Allowed RSS growth from warm-up to the end. The event working set is bounded (each round
# frees its requests' blocks; only the 4 shared-prefix blocks per stream stay cached), so
# the broker's state does not grow; what moves is allocator slack, gRPC buffers and the
# journal writer's group buffer: well under 1 MiB here (68 KiB over a 120 s run of 144k
# batches). 16 MiB over the short run catches a leak of ~0.5 KiB per batch (the CI run
# answers 15-35k batches) with room for that noise; a long run gets 32 MiB.
RSS_GROWTH_KIB = (16 if SOAK_SECONDS <= 60 else 32) * 1024
# The demo's tiers with HBM for four engines: each pins its next decode set (up to ~40
# blocks of 2 MiB), which the demo's 128 MiB HBM holds for one engine, not four.
SOAK_CONFIG = DEMO_CONFIG.replace('capacity = "128MiB"', 'capacity = "1GiB"', 1)
assert SOAK_CONFIG != DEMO_CONFIG


def scoped(event: pb.Event, prefix: str, base_us: int) -> pb.Event:
    """The event with its ids under ``prefix`` (the broker keys blocks globally) and its
    times moved on by ``base_us`` (a new round starts where the last one ended)."""
    out = pb.Event()
    out.CopyFrom(event)
    out.ts_us += base_us
    kind = out.WhichOneof("kind")
    if kind == "allocated":
        intent = out.allocated.intent
        intent.block_id = prefix + intent.block_id
        intent.request_id = prefix + intent.request_id
        if intent.parent_block_id:
            intent.parent_block_id = prefix + intent.parent_block_id
    elif kind == "intent_updated":
        out.intent_updated.block_id = prefix + out.intent_updated.block_id
        if out.intent_updated.HasField("deadline_us"):
            out.intent_updated.deadline_us += base_us
    elif kind in ("accessed", "released", "freed"):
        body = getattr(out, kind)
        body.block_ids[:] = [prefix + b for b in body.block_ids]
        if kind == "accessed" and out.accessed.HasField("next_use_us"):
            out.accessed.next_use_us += base_us
    return out


class StreamReport:
    def __init__(self) -> None:
        self.batches = 0
        self.events = 0
        self.rejections: list[str] = []
        self.rounds = 0


async def drive(target: str, index: int, deadline: float) -> tuple[StreamReport, BrokerClient]:
    """One engine: demo workload rounds until ``deadline`` (monotonic), one batch a step."""
    report = StreamReport()
    prefix = f"s{index}/"
    base_us = 0
    client = BrokerClient(target, f"soak-{index}", max_batch_events=4096, max_delay_s=0.05, reconnect=False)
    async with client:
        while time.monotonic() < deadline:
            workload = DemoWorkload(requests=12, seed=100 + index)
            while not workload.done and time.monotonic() < deadline:
                events = workload.step()
                if not events:  # an idle iteration (no request has arrived yet)
                    continue
                for event in events:
                    await client.add(scoped(event, prefix, base_us))
                report.events += len(events)
                result = await client.flush(timeout=30)
                assert result is not None, f"stream {index}: a batch was not answered"
                report.batches += 1
                report.rejections += [f"{r.field}: {r.reason}" for r in result.rejections]
                for directive in client.drain_directives():
                    await client.ack(directive.directive_id, ts_us=base_us + workload.now_us)
            report.rounds += 1
            base_us += workload.now_us + ITERATION_US
        await client.flush(timeout=30)
    return report, client


async def soak(broker: Broker, seconds: float) -> tuple[list[tuple[StreamReport, BrokerClient]], int, int]:
    start = time.monotonic()
    tasks = [asyncio.create_task(drive(f"127.0.0.1:{broker.port}", i, start + seconds)) for i in range(STREAMS)]
    await asyncio.sleep(seconds * WARMUP_SHARE)
    broker.alive()
    warm = broker.rss_kib()
    results = await asyncio.gather(*tasks)
    broker.alive()
    return results, warm, broker.rss_kib()


def test_soak_concurrent_streams_zero_errors_every_batch_journaled_once_flat_memory(tmp_path: Path) -> None:
    broker = Broker(tmp_path, config_text=SOAK_CONFIG)
    try:
        results, warm_kib, end_kib = asyncio.run(soak(broker, SOAK_SECONDS))
        stats = broker.stats()
    finally:
        code = broker.stop()
    assert code == 0, "".join(broker.output[-60:])

    sent: dict[str, int] = {}
    for i, (report, client) in enumerate(results):
        c = client.counters
        assert client.failed is None, f"stream {i} failed: {client.failed}"
        assert not report.rejections, f"stream {i}: {report.rejections[:5]}"
        assert report.rounds >= 1 and report.batches > 0
        assert (c.connects, c.disconnects, c.connect_failures) == (1, 0, 0), c
        assert c.batches_sent == c.batches_answered, c
        assert c.lost_answers == c.dropped_batches == c.abandoned_batches == c.resent_batches == 0, c
        sent[client.client_id] = c.batches_answered
    assert stats.rejected_events == 0 and stats.duplicate_batches == 0
    assert stats.batches == sum(sent.values())

    # The journal: every batch of every stream exactly once, in each stream's order.
    seqs: dict[str, list[int]] = {}
    for record in JournalSource(f"file://{broker.journal}").batches():
        batch = pb.IntentBatch.FromString(record.payload)
        seqs.setdefault(batch.client_id, []).append(batch.batch_seq)
    assert {client: len(s) for client, s in seqs.items()} == sent
    for client, s in seqs.items():
        assert s == list(range(1, sent[client] + 1)), f"{client}: journal batch_seq not 1..{sent[client]} once each"

    growth = end_kib - warm_kib
    print(
        f"soak {SOAK_SECONDS:g}s: {sum(sent.values())} batches on {STREAMS} streams, "
        f"RSS {warm_kib} KiB after warm-up, {end_kib} KiB at the end"
    )
    assert growth < RSS_GROWTH_KIB, f"broker RSS grew {growth} KiB ({warm_kib} -> {end_kib}) after warm-up"
