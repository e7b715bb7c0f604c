"""Hostile KV hints through vLLM's real CPUOffloadingManager (vLLM 0.33.0, marker ``vllm``;
issue 33, items 1-4 and 17): whatever a request's hint holds, no exception reaches vLLM,
the adapter's core mirrors vLLM's chunks, and kvbroker's lru answers as vLLM's own LRU
(so no store is refused that vLLM's LRU would take for lack of a decision). The same
without vLLM, call by call: test_hostile_hints.py.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_integration.hints import ACTION_TYPE, PAYLOAD_KEYS

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def driver() -> Any:
    """tests/vllm_integration/decisions_to_vllm/manager_driver.py, imported when a test runs (it imports vLLM)."""
    from tests.vllm_integration.decisions_to_vllm import manager_driver

    return manager_driver


def envelope(payload: Any) -> Any:
    """vLLM's own KvHintsEnvelope with one kvbroker action carrying ``payload`` (built
    directly: in-process, vLLM validates nothing of it)."""
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    return KvHintsEnvelope("1", "m", [KvHintAction("a", ACTION_TYPE, "1", payload)])


def first_difference(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mirrored(manager: Any) -> None:
    """The adapter's core holds exactly the manager's chunks; nothing failed, and the core
    rejected no event but the evictions it refused (too few chunks evictable)."""
    adapter = manager._policy
    adapter.translator.apply()
    core_ids = {b.block_id for b in adapter.local.core.blocks.values() if b.tier == 0}
    assert core_ids == {k.hex() for k in adapter.translator.entries}
    assert manager._num_allocated_chunks - len(manager._free_list) == len(adapter.translator.entries)
    stats = adapter.translator.stats
    assert stats.errors == 0 and stats.events_dropped == 0 and adapter.local.rejected == stats.evictions_refused


def nested(depth: int) -> list[Any]:
    top: list[Any] = []
    cur = top
    for _ in range(depth):
        nxt: list[Any] = []
        cur.append(nxt)
        cur = nxt
    return top


def test_a_hint_that_made_prepare_store_raise_is_ignored_and_counted() -> None:
    """deadline_ms 1e306 (a float, as it passes vLLM's msgpack hand-off) made prepare_store
    raise OverflowError into vLLM."""
    from vllm.v1.kv_offload.base import ReqContext

    key = driver().key
    manager = driver().kvbroker_manager("lru", 8)
    for n, payload in enumerate([{"deadline_ms": 1e306}, {"deadline_ms": 10**400}, {"tenant": "\ud800"}, {"priority": nested(100_000)}]):
        ctx = ReqContext(req_id=f"r{n}", kv_hints=envelope(payload))
        manager.on_new_request(ctx)
        keys = [key(n * 4 + i) for i in range(4)]
        out = manager.prepare_store(keys, ctx)
        assert out is not None
        manager.complete_store(keys, ctx)
        manager.on_request_finished(ctx)
    mirrored(manager)
    assert sum(manager._policy.translator.stats.hints_ignored.values()) == 4


def test_one_request_in_20_with_a_deadline_past_int64_no_longer_empties_the_core() -> None:
    """The issue's measure: 1 request in 20 hinted deadline_ms 1e16 left the core holding 0
    of vLLM's 64 chunks, and 256 of 400 stores refused (vLLM's LRU: 0). Now the traces are
    vLLM LRU's, and the core holds vLLM's chunks."""

    def hints(rng: random.Random) -> Any:
        return envelope({"deadline_ms": 1e16, "priority": "hot"}) if rng.random() < 0.05 else None

    stream = {"positions": True, "docs": 20, "concurrency": 8, "hints": hints}
    theirs = driver().random_stream(driver().vllm_manager("lru", 64), 7, 6000, **stream)
    manager = driver().kvbroker_manager("lru", 64)
    ours = driver().random_stream(manager, 7, 6000, **stream)
    assert first_difference(theirs, ours) is None
    # Refused exactly where vLLM's LRU refuses (too few chunks evictable), and it evicts.
    assert sum(len(x[3]) for x in ours if x[0] == "store" and x[2] is not None) > 500
    mirrored(manager)
    assert sum(manager._policy.translator.stats.hints_ignored.values()) > 5


# JSON-like values as a request may carry them, hostile: ints of any size, floats with
# inf and nan, strings with lone surrogates, long strings, deep nesting.
TEXT = st.text(st.characters(codec=None, categories=None), max_size=40)
LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(10**400), 10**400),
    st.sampled_from([2**63, 2**64, 10**16, 9.3e15, 1e306, float("inf"), float("nan"), -0.0, 4.9e-324]),
    st.floats(),
    TEXT,
    st.sampled_from(["cold", "warm", "hot", "HOT", "decode_critical"]),
    st.builds(lambda c, n: c * n, st.characters(codec=None, categories=None), st.integers(0, 1 << 20)),
)
VALUE = st.one_of(
    st.recursive(LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12),
    st.integers(0, 50_000).map(nested),
)
PAYLOAD = st.one_of(
    st.dictionaries(st.sampled_from(PAYLOAD_KEYS), VALUE, max_size=len(PAYLOAD_KEYS)),
    st.dictionaries(st.sampled_from(PAYLOAD_KEYS) | TEXT, VALUE, max_size=3),
    VALUE,
)
REQ_ID = st.one_of(st.just(""), TEXT, st.builds(lambda c, n: c * n, st.characters(codec=None, categories=None), st.integers(1, 4096)))


class Decided:
    """Wraps the adapter's evict: a refusal only when fewer than n chunks can be chosen
    (what vLLM's own LRU refuses too), and each grant is n chunks the manager can drop."""

    def __init__(self, manager: Any) -> None:
        self.policy = manager._policy
        self.inner = self.policy.evict
        self.policy.evict = self.evict
        self.granted = 0

    def evict(self, n: int, protected: set[Any]) -> Any:
        entries = self.policy.translator.entries
        candidates = {k for k, (chunk, _, _) in entries.items() if chunk.ref_cnt == 0 and k not in protected}
        got = self.inner(n, protected)
        if got is None:
            assert len(candidates) < n, "a store refused for lack of a decision"
            return None
        keys = [k for k, _ in got]
        assert len(set(keys)) == n and set(keys) <= candidates
        self.granted += 1
        return got


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    st.lists(PAYLOAD, min_size=1, max_size=6),
    st.lists(REQ_ID, min_size=1, max_size=4),
    st.integers(0, 2**32),
    st.booleans(),
    st.sampled_from(["lru", "lru", "priority_lru", "deadline_edf", "intent_aware"]),
)
def test_whatever_the_hints_hold_vllm_never_sees_an_exception_and_the_core_mirrors_it(
    payloads: list[Any], names: list[str], seed: int, positions: bool, policy: str
) -> None:
    """Arbitrary payloads (and request ids) through the real manager: nothing raises into
    it (random_stream would raise), the core mirrors its chunks, no store is refused but
    where fewer chunks can go than asked; and kvbroker's lru answers exactly as vLLM's."""
    envelopes = [envelope(p) for p in payloads]

    def hints(rng: random.Random) -> Any:
        return envelopes[rng.randrange(len(envelopes))] if rng.random() < 0.6 else None

    def req_ids(n: int) -> str:
        # Distinct per request, as vLLM's are; hostile in content and size.
        return f"{names[n % len(names)]}#{n}"

    stream = {"positions": positions, "docs": 6, "concurrency": 4, "hints": hints, "req_ids": req_ids, "reset_every": 700}
    manager = driver().kvbroker_manager(policy, 16)
    decided = Decided(manager)
    ours = driver().random_stream(manager, seed, 1500, **stream)
    mirrored(manager)
    assert decided.granted > 0
    if policy == "lru":
        theirs = driver().random_stream(driver().vllm_manager("lru", 16), seed, 1500, **stream)
        assert first_difference(theirs, ours) is None
