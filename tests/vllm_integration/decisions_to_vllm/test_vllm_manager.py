"""kvbroker's CachePolicy inside vLLM's real CPUOffloadingManager (vLLM 0.33.0, marker
``vllm``: run by .ci/run in its own venv, ``pytest -m vllm``).

- faithfulness: kvbroker's ``lru`` makes vLLM's manager answer exactly as vLLM's own LRU
  does (every lookup, every store's stored and evicted keys) over long random streams of
  concurrent requests, without and with token positions (a running request's chunks rank
  with the request: request-scoped events), one or two KV cache groups, with cache resets;
  on the same streams an LRU that renews a request's rank at each call
  (``LRUAnchoredPerCall``) answers otherwise, so the streams exercise the request's rank.
  Where vLLM's ARC differs (docs/vllm.md), the traces agree up to the first eviction that
  differs, and the difference is measured.
- contract: through the manager, every eviction the adapter grants names chunks the manager
  can drop (evictable, not protected), the manager never raises, and the adapter's core
  holds exactly the manager's chunks.
- intent: a request whose KvHintsEnvelope says "hot" keeps its chunks over hint-less ones
  under priority_lru.
- replay: the journal written in embedded mode replays with ``kvbroker replay --verify``.
- configuration: the real CPUOffloadingSpec hands its kv_connector_extra_config to the policy,
  loaded by the module path of today and by the one older configs name.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_integration.hints import intent_envelope

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]


def driver() -> Any:
    """tests/vllm_integration/decisions_to_vllm/manager_driver.py, imported when a test runs (it imports vLLM,
    which the main venv does not install: there these tests are deselected)."""
    from tests.vllm_integration.decisions_to_vllm import manager_driver

    return manager_driver


def first_difference(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def evicted(trace: list[tuple[Any, ...]]) -> int:
    return sum(len(x[3]) for x in trace if x[0] == "store" and x[2] is not None)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kvbroker_lru_evicts_exactly_what_vllm_lru_evicts(seed: int) -> None:
    steps = 30_000
    for capacity, docs, concurrency in ((24, 8, 4), (64, 20, 8)):
        stream = {"docs": docs, "concurrency": concurrency, "reset_every": 9_000}
        theirs = driver().random_stream(driver().vllm_manager("lru", capacity), seed, steps, **stream)
        ours = driver().random_stream(driver().kvbroker_manager("lru", capacity), seed, steps, **stream)
        assert first_difference(theirs, ours) is None
        assert evicted(ours) > 1000 and sum(x[2] for x in ours if x[0] == "lookup") > 200  # it evicts, and hits
        assert ("reset",) in ours


@pytest.mark.parametrize(("seed", "groups"), [(1, 1), (2, 1), (3, 2), (4, 2)])
def test_with_token_positions_kvbroker_lru_evicts_exactly_what_vllm_lru_evicts(seed: int, groups: int) -> None:
    """Token positions as vLLM's scheduler sets them, several requests in flight, one or two
    KV cache groups (a hybrid model's: two keys per position), cache resets: kvbroker's lru
    answers exactly as vLLM's own LRU, which ranks a running request's chunks at the rank
    the request took at its first use (the adapter sends them as request-scoped uses)."""
    steps = 20_000
    for capacity, docs, concurrency in ((40, 12, 4), (128, 40, 8)):
        stream = {"positions": True, "docs": docs, "concurrency": concurrency, "groups": groups, "reset_every": 7_000}
        theirs = driver().random_stream(driver().vllm_manager("lru", capacity), seed, steps, **stream)
        ours = driver().random_stream(driver().kvbroker_manager("lru", capacity), seed, steps, **stream)
        assert first_difference(theirs, ours) is None
        assert evicted(ours) > 1000 and sum(x[2] for x in ours if x[0] == "lookup") > 200
        assert ("reset",) in ours
        # The request's rank matters on this stream: renewing it at each call answers otherwise.
        anchored = driver().random_stream(driver().anchored_lru_manager(capacity), seed, steps, **stream)
        assert first_difference(anchored, ours) is not None


def lru_answers(manager: Any) -> tuple[list[Any], list[Any]]:
    """The smallest case where vLLM's LRU places a chunk below the newest end: what the
    manager evicts (once for room, once more), keys a, b, k.

    a and b are stored (b the older); request A reads a (its first use: A's rank), then
    another request touches b (newer than A), then A stores k at a later token position:
    vLLM ranks k with A, tail before head, so below a and b."""
    from vllm.v1.kv_offload.base import ReqContext

    key = driver().key
    a, b, k = key(1), key(2), key(3)
    first = ReqContext(req_id="first")
    manager.on_new_request(first)
    manager.prepare_store([a, b], first)
    manager.complete_store([a, b], first)
    manager.on_request_finished(first)
    running = ReqContext(req_id="running")
    running.set_offload_key_position(a, 16)
    running.set_offload_key_position(k, 32)
    manager.on_new_request(running)
    manager.prepare_load([a], running)
    manager.complete_load([a], running)
    toucher = ReqContext(req_id="toucher")
    manager.on_new_request(toucher)
    manager.touch([b], toucher)
    out = manager.prepare_store([k], running)
    assert out is not None and out.evicted_keys == []
    manager.complete_store([k], running)
    victims = []
    for n in (4, 5):
        late = ReqContext(req_id=f"late{n}")
        manager.on_new_request(late)
        got = manager.prepare_store([key(n)], late)
        assert got is not None
        victims += list(got.evicted_keys)
    return victims, [a, b, k]


def test_a_running_requests_new_chunk_ranks_below_older_uses_as_in_vllm_lru() -> None:
    """vLLM's LRU evicts k (just stored by a running request) before a and b: k ranks with
    its request, whose rank is older than b's touch. kvbroker's lru does the same through a
    request-scoped allocation; an LRU where each use is the newest evicts a, then b."""
    theirs, (a, b, k) = lru_answers(driver().vllm_manager("lru", 3))
    assert theirs == [k, a]
    ours, _ = lru_answers(driver().kvbroker_manager("lru", 3))
    assert ours == theirs
    anchored, _ = lru_answers(driver().anchored_lru_manager(3))
    assert anchored == [a, b]


def test_chunks_of_one_token_position_leave_in_vllms_key_order() -> None:
    """Two KV cache groups' keys at one position, read by a request: vLLM's LRU gives them
    one rank and evicts the smaller key first; so does kvbroker's lru through the adapter."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    def victims(manager: Any) -> list[Any]:
        high, low = make_offload_key(b"\xff" * 8, 0), make_offload_key(b"\x00" * 8, 1)
        first = ReqContext(req_id="first")
        manager.on_new_request(first)
        manager.prepare_store([high, low], first)
        manager.complete_store([high, low], first)
        manager.on_request_finished(first)
        reader = ReqContext(req_id="reader")
        for x in (high, low):
            reader.set_offload_key_position(x, 16)
        manager.on_new_request(reader)
        manager.prepare_load([high, low], reader)
        manager.complete_load([high, low], reader)
        out = manager.prepare_store([driver().key(9)], ReqContext(req_id="new"))
        assert out is not None
        return list(out.evicted_keys)

    assert victims(driver().vllm_manager("lru", 2)) == [make_offload_key(b"\x00" * 8, 1)]
    assert victims(driver().kvbroker_manager("lru", 2)) == victims(driver().vllm_manager("lru", 2))


def test_on_the_mooncake_trace_with_token_positions_lru_evicts_what_vllm_lru_evicts() -> None:
    """Requests one after another, token positions set as vLLM's scheduler sets them: the
    two LRU definitions agree there (bench/vllm_offload.py runs the whole trace)."""
    requests = list(driver().mooncake_requests(1500))
    for size in (300, 1200):
        theirs: list[Any] = []
        ours: list[Any] = []
        a = driver().mooncake(driver().vllm_manager("lru", size), requests, evictions=theirs)
        b = driver().mooncake(driver().kvbroker_manager("lru", size), requests, evictions=ours)
        assert a == b and ours == theirs
        assert sum(len(e or ()) for e in ours) > 1000 and a[0] > 0


@pytest.mark.parametrize(("policy", "positions"), [("arc", False), ("arc", True)])
def test_where_the_definitions_differ_the_traces_agree_until_an_eviction_differs(policy: str, positions: bool) -> None:
    theirs = driver().random_stream(driver().vllm_manager(policy, 40), 1, 20_000, positions=positions, docs=12)
    ours = driver().random_stream(driver().kvbroker_manager(policy, 40), 1, 20_000, positions=positions, docs=12)
    at = first_difference(theirs, ours)
    assert at is not None  # documented: they do differ
    mine, vllms = ours[at], theirs[at]
    # The first answer that differs is an eviction choice: the same keys stored, other victims.
    assert mine[0] == vllms[0] == "store" and mine[2] == vllms[2] and mine[3] != vllms[3]
    hits = [sum(x[2] for x in t if x[0] == "lookup") for t in (theirs, ours)]
    print(f"{policy} positions={positions}: first difference at step {at} of {len(theirs)}; chunk hits vLLM {hits[0]}, kvbroker {hits[1]}")


class Checked:
    """Wraps the adapter's evict: every grant is checked against the manager's own view."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.policy = manager._policy
        self.inner = self.policy.evict
        self.granted = 0
        self.policy.evict = self.evict

    def evict(self, n: int, protected: set[Any]) -> Any:
        before = {k for k, (chunk, _, _) in self.policy.translator.entries.items() if chunk.ref_cnt == 0 and k not in protected}
        got = self.inner(n, protected)
        if got is None:
            assert len(before) < n  # None only when fewer than n can be chosen
            return None
        keys = [k for k, _ in got]
        assert len(keys) == len(set(keys)) == n and set(keys) <= before
        assert all(chunk.ref_cnt == 0 for _, chunk in got)
        self.granted += 1
        return got


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(["lru", "arc", "s3fifo", "prefix_aware", "adaptive", "priority_lru", "sieve"]), st.integers(0, 2**32), st.booleans())
def test_contract_through_the_manager(policy: str, seed: int, positions: bool) -> None:
    manager = driver().kvbroker_manager(policy, 16)
    checked = Checked(manager)
    driver().random_stream(manager, seed, 3000, positions=positions, docs=6, reset_every=1000)
    assert checked.granted > 0
    adapter = manager._policy
    adapter.translator.apply()
    core_ids = {b.block_id for b in adapter.local.core.blocks.values() if b.tier == 0}
    assert core_ids == {k.hex() for k in adapter.translator.entries}
    held = manager._num_allocated_chunks - len(manager._free_list)
    assert held == len(adapter.translator.entries)  # every chunk the manager uses, the policy holds


def test_a_hinted_request_keeps_its_chunks_under_priority_lru() -> None:
    from vllm.v1.kv_offload.base import ReqContext

    key = driver().key

    for policy, hinted_kept in (("priority_lru", True), ("lru", False)):
        manager = driver().kvbroker_manager(policy, 8)
        hot = ReqContext(req_id="hot", kv_hints=intent_envelope(priority="hot", request_priority=90))
        plain = ReqContext(req_id="plain")
        for ctx, keys in ((hot, [key(i) for i in range(4)]), (plain, [key(i) for i in range(4, 8)])):
            manager.on_new_request(ctx)
            out = manager.prepare_store(keys, ctx)
            assert out is not None
            manager.complete_store(keys, ctx)
            manager.on_request_finished(ctx)
        newcomer = ReqContext(req_id="new")
        manager.on_new_request(newcomer)
        out = manager.prepare_store([key(i) for i in range(8, 12)], newcomer)
        assert out is not None and len(out.evicted_keys) == 4
        gone_hot = set(out.evicted_keys) == {key(i) for i in range(4)}
        assert gone_hot is not hinted_kept, policy
        assert manager._policy.translator.stats.hinted_requests == 1


@pytest.mark.parametrize(("policy", "other"), [("s3fifo", "lru"), ("lru", "s3fifo"), ("arc", "lru"), ("history_arc", "lru")])
def test_the_embedded_journal_replays_with_verify(tmp_path: Path, policy: str, other: str) -> None:
    """The journal (with request-scoped events: token positions) replays to the same
    evictions, and runs another policy on the same traffic."""
    url = f"file://{tmp_path}/vllm.journal"
    manager = driver().kvbroker_manager(policy, 24, journal=url)
    trace = driver().random_stream(manager, 5, 8000, positions=True, docs=8)
    manager._policy.close()
    assert evicted(trace) > 100
    cli = [sys.executable, "-m", "broker.cli.main", "replay", "--journal", url, "--policy", f"{policy},{other}", "--verify", "--json"]
    run = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    records = {r["policy"]: r for r in json.loads(run.stdout)}
    assert records[policy]["verified"] is True and records[policy]["evictions"] == evicted(trace)
    assert records[policy]["tail"] == "complete"  # closed: its trailer counts every batch
    assert records[other]["verified"] is None  # another policy on the same traffic: an A/B, not a check


# The path configs name today, and the one they named before the vLLM integration had a
# room of its own (broker/offload/vllm_policy.py re-exports the class).
MODULE_PATHS = ("vllm_integration.decisions_to_vllm.cache_policy", "broker.offload.vllm_policy")


def test_the_old_module_path_is_the_same_class() -> None:
    from broker.offload.vllm_policy import KvbrokerCachePolicy as old
    from vllm_integration.decisions_to_vllm.cache_policy import KvbrokerCachePolicy as new

    assert old is new


@pytest.mark.parametrize("module_path", MODULE_PATHS)
def test_the_real_offloading_spec_hands_its_extra_config_to_the_policy(tmp_path: Path, module_path: str) -> None:
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    from vllm_integration.decisions_to_vllm.cache_policy import KvbrokerCachePolicy

    extra = {
        "eviction_policy": "KvbrokerCachePolicy",
        "cache_policy_module_path": module_path,
        "kvbroker_policy": "arc",
        "kvbroker_client_id": "engine-7",
    }
    config = driver().offloading_config(extra)
    spec = CPUOffloadingSpec(config)  # type: ignore[arg-type]
    policy = spec.get_manager()._policy
    assert type(policy) is KvbrokerCachePolicy
    assert (policy.settings.policy, policy.local.client_id, policy.cache_capacity) == ("arc", "engine-7", spec.num_chunks)
    assert spec.num_chunks > 0 and policy.local.core.tiers[0].capacity == spec.num_chunks
    bad = SimpleNamespace(**{**vars(config), "extra_config": {**config.extra_config, "kvbroker_policy": "nope"}})
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.kvbroker_policy"):
        CPUOffloadingSpec(bad).get_manager()  # type: ignore[arg-type]
