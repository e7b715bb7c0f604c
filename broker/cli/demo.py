"""`kvbroker demo`: a real broker, a real client over gRPC, then a replay comparison.

It starts a broker on a free loopback port with a temporary file journal, drives the
built-in workload through BrokerClient (acking every directive, as an engine would),
stops the broker, replays its journal through every policy (belady, the offline optimum
of demand caching, and prefetch_oracle, an offline prefetching bound: see docs/deadlines.md),
checks that the replay of the live policy reproduces the live directives exactly, and
prints the table.

The workload is the deadline-bound one (broker/cli/demo_workload.py, ``DEADLINE_CONFIG``):
bursts of arrivals, the next decode set announced with deadlines but not pinned, host
memory behind two shared copy channels; there deadlines are missed, and where each policy
put the blocks decides how many.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import tempfile
from collections.abc import Callable

from broker.cli.demo_workload import DEADLINE_CONFIG, DemoWorkload
from broker.config import JournalConfig, parse_config
from broker.journal import JournalSource
from broker.replay.replay import ReplayResult, format_table, replay_source
from broker.service.server import start_broker
from clients.broker_client import BrokerClient
from policies import registry

JOURNAL_NAME = "demo.journal"  # in a temporary folder, or in --keep DIR


async def drive(target: str, workload: DemoWorkload) -> tuple[int, int, int]:
    """Run the workload through a client; returns (batches, events, rejected events)."""
    batches = events = rejected = 0
    async with BrokerClient(target, "demo-engine", max_batch_events=4096, max_delay_s=0.05) as client:
        while not workload.done:
            for event in workload.step():
                await client.add(event)
                events += 1
            # One batch per iteration: the engine waits for its directives before the next.
            result = await client.flush()
            if result is not None:
                batches += 1
                rejected += len(result.rejections)
            for directive in client.drain_directives():
                await client.ack(directive.directive_id, ts_us=workload.now_us)
                events += 1
    return batches, events, rejected


async def run_demo(journal_dir: str, *, requests: int = 40, seed: int = 7, out: Callable[[str], None] = print) -> list[ReplayResult]:
    config = parse_config(DEADLINE_CONFIG)
    journal_url = f"file://{os.path.join(journal_dir, JOURNAL_NAME)}"
    config = dataclasses.replace(config, journal=JournalConfig(url=journal_url))
    broker = await start_broker(config)
    target = f"127.0.0.1:{broker.port}"
    out(f"broker listening on {target}, policy {broker.service.policy_name}, journal {journal_url}")
    try:
        batches, events, rejected = await drive(target, DemoWorkload(requests=requests, seed=seed, deadline_bound=True))
        stats = broker.service.stats()
    finally:
        await broker.stop()
    live = stats.directives
    out(
        f"live: {batches} batches, {events} events ({rejected} rejected), directives "
        + ", ".join(f"{k} {live[k]}" for k in sorted(live))
        + f"; journal records written {broker.service.journal.written}"
    )
    results = await asyncio.to_thread(replay_source, JournalSource(journal_url), registry.names(), None, verify=True)
    out("")
    out(f"replay of the journal through every policy ({len(results)}):")
    out(format_table([r.as_record() for r in results]))
    return results


def main(requests: int = 40, seed: int = 7, keep: str | None = None) -> int:
    import uvloop

    if keep:
        os.makedirs(keep, exist_ok=True)  # its parent exists: checked by the command
        results = uvloop.run(run_demo(keep, requests=requests, seed=seed))
    else:
        with tempfile.TemporaryDirectory(prefix="kvbroker-demo-") as tmp:
            results = uvloop.run(run_demo(tmp, requests=requests, seed=seed))
    verified = [r for r in results if r.mismatches is not None]
    if not verified or any(r.mismatches for r in verified):
        bad = verified[0].first_mismatch if verified else "the live policy was not replayed"
        print(f"\nreplay did NOT reproduce the live directives: {bad}")
        return 1
    print(f"\nreplay of {verified[0].policy} reproduced all {verified[0].directives} live directives exactly.")
    return 0
