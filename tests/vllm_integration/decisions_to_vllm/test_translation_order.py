"""Which kvbroker events each of vLLM's CachePolicy calls becomes, in which order (no vLLM).

The accesses go where vLLM's own LRU (vllm/v1/kv_offload/cpu/policies/lru.py) ranks chunks,
in the order it ranks them: ``touch`` and a request's finish read the last key first (the
head ends the most recent); a running request's reads and positioned stores are scoped by
the request (kvbroker's lru ranks them with it, tails first), its finish ends the scope;
calls that move nothing in vLLM's LRU send nothing.
The same against vLLM's real manager and LRU is in test_vllm_manager.py (marker ``vllm``).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvbroker.v1 import intent_pb2 as pb
from tests.vllm_integration.decisions_to_vllm.fakes import Chunk, Ctx, k
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.policy_calls import Translator
from vllm_integration.decisions_to_vllm.settings import load_settings


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
        ranked = policy.choose_victims(len(policy), set()) or []
        return [int(b.block_id[:16], 16) for b in ranked]


def parse(raw: bytes) -> tuple[str, list[str]]:
    ev = pb.Event.FromString(raw)
    kind = ev.WhichOneof("kind")
    if kind == "allocated" and not ev.allocated.scope:
        return kind, [ev.allocated.intent.block_id]
    if kind == "accessed":
        a = ev.accessed
        name = kind + (f" scope {a.scope} at {list(a.token_positions)}" if a.scope else "") + (" refresh" if a.refresh_only else "")
        return name + (f" ends {a.ends_scope}" if a.ends_scope else ""), list(a.block_ids)
    if kind == "allocated" and ev.allocated.scope:
        return f"allocated scope {ev.allocated.scope} at {ev.allocated.intent.token_start}", [ev.allocated.intent.block_id]
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
    # No token positions: vLLM's LRU leaves them, but the request takes its rank (a scoped
    # access of nothing).
    r.t.on_request_access([k(1), k(2)], a)
    assert r.take() == [("accessed scope a at []", [])]
    assert r.order() == [1, 2, 3]
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
    # Its first access: the resident keys with a position, tail first, scoped by the request
    # (vLLM ranks them (request, -position)); a key not resident is skipped.
    r.t.on_request_access([k(1), k(4), k(3)], live)
    assert r.take() == [("accessed scope live at [48, 16]", [3, 1])]
    assert r.order() == [2, 3, 1]
    # A positioned store ranks with the request too: below what was used since it began.
    r.t.touch([k(2)], request("other"))
    store(r, live, 4)
    assert r.take() == [("accessed", [2]), ("allocated scope live at 64", [4])]
    assert r.order() == [4, 3, 1, 2]
    # Its finish: every resident key, sorted by position, tail first: the head ends newest.
    # The keys it loaded (reused: 1, 3) are reads, the others refreshes, one event per run;
    # the last ends the request's scope.
    r.t.on_request_finished([[k(3), k(1)], [k(4), k(2)]], {k(4)}, {k(1), k(3)}, live)
    assert r.take() == [
        ("accessed refresh", [4]),
        ("accessed", [3]),
        ("accessed refresh", [2]),
        ("accessed ends live", [1]),
    ]
    assert r.order() == [4, 3, 2, 1]
    # Keys at one position (two KV cache groups) share vLLM's rank and leave by key bytes:
    # the smaller is read first, so it stays the older.
    tied = request("tied", {5: 16, 2: 16, 1: 32})
    store(r, request("other"), 5)
    r.take()
    r.t.on_request_access([k(5), k(2), k(1)], tied)
    assert r.take() == [("accessed scope tied at [32, 16, 16]", [1, 2, 5])]
    # Without every key's position, the groups' keys as given, the last first.
    partial = request("partial", {1: 16})
    r.t.on_request_finished([[k(2), k(1)], [k(3)]], set(), set(), partial)
    assert r.take() == [("accessed refresh ends partial", [3, 1, 2])]
    # A finish with nothing resident still ends the scope.
    r.t.on_request_finished([[k(7)]], set(), set(), request("gone"))
    assert r.take() == [("accessed ends gone", [])]


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
