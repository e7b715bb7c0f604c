"""deadline_edf's lazy filing decides exactly as filing every block at its own event.

The lazy path (the default) parks re-keyed blocks until the policy's lists are read; the
eager path (``lazy = False``) is its reference. Random streams of every event kind, with
deadlines, intent updates, pins, shared and reused blocks, failed acks and clock jumps, go
through the real core (``apply_batch``) under both; the directives, the stats and the
policies' answers must be identical.
"""

from __future__ import annotations

import random

import pytest

from broker.config import parse_config
from broker.model.apply import apply_batch
from broker.model.core import Core
from kvbroker.v1 import intent_pb2 as pb
from policies.deadline_edf import NEAR, DeadlineEDFPolicy

CONFIG = """
[policy]
name = "deadline_edf"
[prefetch]
margin_us = 300
[[tiers]]
name = "hbm"
capacity = 6000
read_latency_us = 0.0
bandwidth_gb_per_s = 0.0005
[[tiers]]
name = "dram"
capacity = 9000
read_latency_us = 2.0
bandwidth_gb_per_s = 0.00005
[[tiers]]
name = "nvme"
capacity = 40000
read_latency_us = 40.0
bandwidth_gb_per_s = 0.00001
"""

TIERS = ("", "hbm", "dram", "nvme")


def random_stream(seed: int, batches: int = 120) -> list[pb.IntentBatch]:
    rng = random.Random(seed)
    now = 0
    live: list[str] = []
    released: list[str] = []
    next_id = 0
    directive_ids = list(range(1, 400))
    out = []
    for seq in range(1, batches + 1):
        events = []
        for _ in range(rng.randint(1, 12)):
            now += rng.choice((0, 0, 1, 5, 50, 400, 3000, 20000))
            roll = rng.random()
            if roll < 0.28 or not live:
                if released and rng.random() < 0.4:
                    block_id = rng.choice(released)  # prefix reuse of a cached block
                    released.remove(block_id)
                else:
                    next_id += 1
                    block_id = f"b{next_id}"
                intent = pb.MemoryIntent(
                    block_id=block_id,
                    request_id=f"r{rng.randint(0, 5)}",
                    size_bytes=rng.choice((100, 200, 300, 500)),
                    priority=rng.choice((0, 1, 2, 3, 3, 4)),  # type: ignore[arg-type]
                    phase=rng.choice((1, 2)),  # type: ignore[arg-type]
                    parent_block_id=rng.choice(live) if live and rng.random() < 0.5 else "",
                    pin_requested=rng.random() < 0.05,
                )
                if rng.random() < 0.6:
                    intent.deadline_us = now + rng.choice((0, 100, 1000, 5000, 30000))
                if rng.random() < 0.3:
                    intent.recompute_cost_us = rng.choice((0, 10, 500, 50000))
                if rng.random() < 0.3:
                    intent.request_priority = rng.randint(0, 100)
                if rng.random() < 0.15:
                    intent.allowed_tiers.extend(sorted(rng.sample(TIERS[1:], rng.randint(1, 2))))
                shared = block_id in live and rng.random() < 0.5
                events.append(pb.Event(ts_us=now, allocated=pb.BlockAllocated(intent=intent, tier=rng.choice(TIERS), reuse=shared)))
                if block_id not in live:
                    live.append(block_id)
            elif roll < 0.6:
                ids = rng.sample(live, min(len(live), rng.randint(1, 8)))
                accessed = pb.BlocksAccessed(block_ids=ids)
                if rng.random() < 0.7:
                    accessed.next_use_us = now + rng.choice((0, 200, 1000, 20000))
                events.append(pb.Event(ts_us=now, accessed=accessed))
            elif roll < 0.75:
                upd = pb.IntentUpdated(block_id=rng.choice(live))
                if rng.random() < 0.5:
                    upd.priority = rng.choice((1, 2, 3, 4))  # type: ignore[assignment]
                if rng.random() < 0.5:
                    upd.deadline_us = now + rng.choice((0, 300, 4000, 40000))
                elif rng.random() < 0.2:
                    upd.clear_deadline = True
                if rng.random() < 0.3:
                    upd.recompute_cost_us = rng.choice((0, 100, 90000))
                if rng.random() < 0.2:
                    upd.request_priority = rng.randint(0, 100)
                if rng.random() < 0.1:
                    upd.pin_requested = rng.random() < 0.5
                events.append(pb.Event(ts_us=now, intent_updated=upd))
            elif roll < 0.85:
                ids = rng.sample(live, min(len(live), rng.randint(1, 4)))
                events.append(pb.Event(ts_us=now, released=pb.BlocksReleased(block_ids=ids)))
                released.extend(b for b in ids if b not in released)
            elif roll < 0.93:
                ids = rng.sample(live, min(len(live), rng.randint(1, 3)))
                events.append(pb.Event(ts_us=now, freed=pb.BlocksFreed(block_ids=ids)))
                for b in ids:
                    live.remove(b)
                    if b in released:
                        released.remove(b)
            else:
                did = rng.choice(directive_ids)
                failed = rng.random() < 0.5
                status = pb.ACK_STATUS_FAILED if failed else pb.ACK_STATUS_DONE
                events.append(pb.Event(ts_us=now, acked=pb.DirectiveAcked(directive_id=did, status=status, actual_tier=rng.choice(TIERS))))
        out.append(pb.IntentBatch(client_id="c", batch_seq=seq, events=events))
    return out


def run(
    batches: list[pb.IntentBatch],
    lazy: bool,
    monkeypatch: pytest.MonkeyPatch,
    counts: list[tuple[int, int]],
    *,
    ablate: bool = False,
    compact_floor: int = 4096,
) -> tuple[list[object], dict[str, object], list[object]]:
    monkeypatch.setattr(DeadlineEDFPolicy, "lazy", lazy)
    monkeypatch.setattr(DeadlineEDFPolicy, "compact_floor", compact_floor)
    core = Core(parse_config(CONFIG).core, ablate_intent=ablate)
    directives: list[object] = []
    placeholders = 0
    answers: list[object] = []
    for i, batch in enumerate(batches):
        outcome = apply_batch(core, batch)
        directives.extend(d.key() for d in outcome.directives)
        directives.extend((r.index, r.field, r.reason) for r in outcome.rejections)
        for tier in core.tiers:
            policy = tier.policy
            assert isinstance(policy, DeadlineEDFPolicy)
            # A record says it is parked exactly while it waits in _pending.
            assert {block_id for block_id, held in policy._held.items() if held.parked} == set(policy._pending)
        if i % 7 == 6:
            # What a reader of the policies sees now: every held block, coldest first, and
            # which are protected (reads file the parked blocks, so only now and then).
            for tier in core.tiers:
                policy = tier.policy
                assert isinstance(policy, DeadlineEDFPolicy)
                held = [b for b in core.blocks.values() if b.tier == tier.index and not b.pinned]
                answers.append(sorted(b.block_id for b in held if policy.is_near(b)))
                placeholders += check_free_entries(policy)
                # A partial scan (it moves the placeholders it meets), then the whole order.
                total = sum(b.size for b in held)
                for need in (total // 3, total):
                    order = policy.choose_victims(need, frozenset())
                    answers.append([b.block_id for b in order or []])
                    check_free_entries(policy)
    compactions = sum(t.policy.compactions for t in core.tiers if isinstance(t.policy, DeadlineEDFPolicy))
    counts.append((compactions, placeholders))
    return directives, core.stats.as_dict([t.name for t in core.tiers]), answers


def check_free_entries(policy: DeadlineEDFPolicy) -> int:
    """Right after a read (nothing parked): ``_free`` holds one entry per free block, its
    current key or a placeholder before it, and ``_stale`` other entries; ``in_free`` says
    whether a block's ``free_key`` is there."""
    assert not policy._pending
    # Keys a scan moved wait in _moved until the next read merges them into _free.
    present = {id(key) for key in policy._free} | {id(key) for key in policy._moved}
    assert policy._moved == sorted(policy._moved)
    live = 0
    for held in policy._held.values():
        assert not held.parked, held.block.block_id  # nothing is parked right after a read
        assert held.in_free == (id(held.free_key) in present), held.block.block_id
        if held.state != NEAR:
            # Its entry: its current key, or a placeholder earlier in the order.
            assert held.in_free and held.free_key <= policy._free_key(held), held.block.block_id
            live += 1
    assert len(policy._free) + len(policy._moved) - policy._stale == live
    if not policy.lazy:
        assert policy._stale == 0
    return sum(1 for h in policy._held.values() if h.state != NEAR and h.free_key != policy._free_key(h))


@pytest.mark.parametrize("seed", range(20))
def test_lazy_filing_decides_as_eager_filing_on_random_streams(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    batches = random_stream(seed)
    ablate = seed % 5 == 4  # an intent ablation hides deadlines from the policy
    # Odd seeds rebuild _free as soon as half of it is stale (see "Stale entries").
    floor = 0 if seed % 2 else 4096
    counts: list[tuple[int, int]] = []  # (rebuilds of _free, placeholders seen) of each run
    eager = run(batches, False, monkeypatch, counts, ablate=ablate)
    lazy = run(batches, True, monkeypatch, counts, ablate=ablate, compact_floor=floor)
    assert len(eager[0]) > 0
    assert lazy == eager
    (eager_rebuilds, eager_placeholders), (rebuilds, placeholders) = counts
    assert eager_rebuilds == eager_placeholders == 0 and (rebuilds > 0) == (floor == 0), counts
    assert placeholders > 0, counts  # the lazy run kept placeholders, and was read with them
