"""Which kvbroker events each of vLLM's CachePolicy calls becomes, in which order (no vLLM).

The accesses go where vLLM's own LRU (vllm/v1/kv_offload/cpu/policies/lru.py) ranks chunks
as the newest, in the order it ranks them: ``touch`` and a request's finish read the last
key first (the head ends the most recent), a request's first reads go tail first, and
calls that move nothing in vLLM's LRU send nothing. docs/vllm.md ("How faithful") says
where vLLM's LRU places a chunk elsewhere than the newest end, which no event expresses.
The same against vLLM's real manager and LRU is in test_vllm_manager.py (marker ``vllm``).
"""

from __future__ import annotations

from typing import Any

import pytest

from broker.offload.embedded import EmbeddedCore
from broker.offload.settings import load_settings
from broker.offload.translate import Translator
from kvbroker.v1 import intent_pb2 as pb
from tests.broker.offload.fakes import Chunk, Ctx, k


class Recorded:
    """A translator on kvbroker's lru whose batches are recorded as (kind, block ids)."""

    def __init__(self, capacity: int = 8) -> None:
        settings = load_settings({"kvbroker_policy": "lru"}, {})
        self.t = Translator(EmbeddedCore(settings, capacity))
        self.sent: list[tuple[str, list[str]]] = []
        apply = self.t.local.apply

        def recording(evs: list[bytes]) -> Any:
            self.sent.extend(parse(raw) for raw in evs)
            return apply(evs)

        self.t.local.apply = recording  # type: ignore[method-assign]

    def take(self) -> list[tuple[str, list[int]]]:
        """What was sent since the last take (block ids as the key numbers)."""
        self.t.apply()
        out = [(kind, [int(b[:16], 16) for b in ids]) for kind, ids in self.sent]
        self.sent.clear()
        return out

    def order(self) -> list[int]:
        """The lru's order of the resident chunks, least recent first (what it evicts first)."""
        self.t.apply()
        policy = self.t.local.core.tiers[0].policy
        return [int(b[:16], 16) for b in policy._order]


def parse(raw: bytes) -> tuple[str, list[str]]:
    ev = pb.Event.FromString(raw)
    kind = ev.WhichOneof("kind")
    if kind == "allocated":
        return kind, [ev.allocated.intent.block_id]
    if kind == "accessed":
        return kind, list(ev.accessed.block_ids)
    if kind == "freed":
        return kind, list(ev.freed.block_ids)
    if kind == "eviction_requested":
        return f"evict {ev.eviction_requested.count}", list(ev.eviction_requested.protected_block_ids)
    if kind == "intent_updated":
        return kind, [ev.intent_updated.block_id]
    return str(kind), []


def request(name: str, positions: dict[int, int] | None = None) -> Ctx:
    ctx = Ctx(name)
    for n, at in (positions or {}).items():
        ctx.set_offload_key_position(k(n), at)
    return ctx


def store(r: Recorded, ctx: Ctx, *ns: int) -> None:
    for n in ns:
        r.t.insert(k(n), Chunk(0), ctx)


def test_each_call_sends_the_events_of_its_row_in_order() -> None:
    r = Recorded()
    a = request("a")
    store(r, a, 1, 2, 3)
    assert r.take() == [("allocated", [1]), ("allocated", [2]), ("allocated", [3])]
    # Calls that move nothing in vLLM's LRU send nothing.
    r.t.get(k(1))
    r.t.mark_non_evictable(k(1))
    r.t.mark_evictable(k(1))
    r.t.on_request_access([k(1), k(2)], a)  # no token positions: vLLM's LRU leaves them
    assert r.take() == []
    # touch: the last key read first, so the first ends the most recent; absent keys skipped.
    r.t.touch([k(1), k(9), k(2)], a)
    assert r.take() == [("accessed", [2, 1])]
    assert r.order() == [3, 2, 1]
    r.t.remove(k(3))
    assert r.take() == [("freed", [3])]
    r.t.clear()
    assert r.take() == [("cleared", [])]


def test_a_request_is_read_tail_first_at_its_first_access_and_at_its_finish() -> None:
    r = Recorded()
    positions = {1: 16, 2: 32, 3: 48, 4: 64}
    store(r, request("old"), 1, 2, 3)
    r.take()
    live = request("live", positions)
    # Its first access: the resident keys with a position, tail first (vLLM ranks them
    # (request, -position)); a key not resident is skipped.
    r.t.on_request_access([k(1), k(4), k(3)], live)
    assert r.take() == [("accessed", [3, 1])]
    assert r.order() == [2, 3, 1]
    store(r, live, 4)
    r.take()
    # Its finish: every resident key, sorted by position, tail first: the head ends newest.
    r.t.on_request_finished([[k(3), k(1)], [k(4), k(2)]], {k(4)}, {k(1), k(3)}, live)
    assert r.take() == [("accessed", [4, 3, 2, 1])]
    assert r.order() == [4, 3, 2, 1]
    # Keys at one position (two KV cache groups) share vLLM's rank and leave by key bytes:
    # the smaller is read first, so it stays the older.
    tied = request("tied", {5: 16, 2: 16, 1: 32})
    store(r, request("other"), 5)
    r.take()
    r.t.on_request_access([k(5), k(2), k(1)], tied)
    assert r.take() == [("accessed", [1, 2, 5])]
    # Without every key's position, the groups' keys as given, the last first.
    partial = request("partial", {1: 16})
    r.t.on_request_finished([[k(2), k(1)], [k(3)]], set(), set(), partial)
    assert r.take() == [("accessed", [3, 1, 2])]


@pytest.mark.parametrize("held", [False, True])
def test_an_eviction_asks_then_frees_its_victims(held: bool) -> None:
    r = Recorded(capacity=3)
    store(r, request("a"), 1, 2, 3)
    if held:
        r.t.mark_non_evictable(k(1))
    r.take()
    got = r.t.evict(1, {k(2)})
    assert got is not None
    victim = 3 if held else 1
    assert [key for key, _ in got] == [k(victim)]
    shielded = [2, 1] if held else [2]
    assert r.take() == [("evict 1", shielded), ("freed", [victim])]
