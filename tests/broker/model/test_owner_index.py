"""Core.by_owner, the index that makes a client's `cleared` cost its own blocks (issue 19,
item 5): always exactly the blocks each owner holds, through allocation, prefix reuse by
another client, release, free and clear; and rebuilt identically by a replay."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.config import CoreConfig
from broker.model.apply import apply_batch
from broker.model.core import Core
from kvbroker.v1 import intent_pb2 as pb
from tests.builders import alloc, clear, free, release

CLIENTS = ("a", "b", "c")


def owners_by_scan(core: Core) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for block in core.blocks.values():
        out.setdefault(block.owner, set()).add(block.block_id)
    return out


def owners_by_index(core: Core) -> dict[str, set[str]]:
    out = {}
    for owner, entry in core.by_owner.items():
        members = core._owner_members(owner, entry.ids)
        assert entry.live == len(members), (owner, entry.live, members)
        assert len(entry.ids) <= 2 * entry.live + 1  # compacted: O(the owner's blocks)
        out[owner] = set(members)
    return out


def random_batches(seed: int, n: int) -> list[bytes]:
    rng = random.Random(seed)
    seqs = dict.fromkeys(CLIENTS, 0)
    out = []
    for step in range(n):
        client = rng.choice(CLIENTS)
        events: list[pb.Event] = []
        for _ in range(rng.randrange(1, 6)):
            block = f"k{rng.randrange(40)}"
            kind = rng.randrange(10)
            if kind < 5:  # a new block, or prefix reuse of a released one by whoever allocates it
                events.append(alloc(block, size=rng.choice((10, 50)), ts=step, request_id=f"r{rng.randrange(5)}"))
            elif kind < 7:
                events.append(release(block, ts=step))
            elif kind < 9:
                events.append(free(block, ts=step))
            else:
                events.append(clear(ts=step))
        seqs[client] += 1
        out.append(pb.IntentBatch(client_id=client, batch_seq=seqs[client], events=events).SerializeToString())
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), n=st.integers(1, 120))
def test_the_owner_index_holds_exactly_each_clients_blocks(seed: int, n: int) -> None:
    config = CoreConfig()
    core = Core(config)
    for raw in random_batches(seed, n):
        apply_batch(core, raw)
        assert owners_by_index(core) == owners_by_scan(core)
    # A replay of the same batches builds the same index, in the same order.
    again = Core(config)
    for raw in random_batches(seed, n):
        apply_batch(again, raw)
    assert {o: core._owner_members(o, e.ids) for o, e in core.by_owner.items()} == {
        o: again._owner_members(o, e.ids) for o, e in again.by_owner.items()
    }


def test_a_clear_frees_exactly_the_clients_blocks_and_a_reused_block_changes_owner() -> None:
    core = Core(CoreConfig())
    apply_batch(core, pb.IntentBatch(client_id="a", batch_seq=1, events=[alloc("x"), alloc("y"), release("y")]))
    # b takes y by prefix reuse: y is b's now, and a's clear must leave it.
    apply_batch(core, pb.IntentBatch(client_id="b", batch_seq=1, events=[alloc("y"), alloc("z")]))
    assert core.owned("a") == 1 and core.owned("b") == 2
    outcome = apply_batch(core, pb.IntentBatch(client_id="a", batch_seq=2, events=[clear()]))
    assert not outcome.rejections
    assert sorted(core.blocks) == ["y", "z"] and "a" not in core.by_owner
    apply_batch(core, pb.IntentBatch(client_id="b", batch_seq=2, events=[clear()]))
    assert not core.blocks and not core.by_owner
