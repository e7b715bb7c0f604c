"""The adapter's translator against its contract (vLLM's CachePolicy), with stand-ins for
vLLM's request contexts and chunks; the same through vLLM's real manager is in
test_vllm_manager.py (marker ``vllm``).

- contract: ``evict`` names exactly n distinct resident chunks, none protected, none vLLM
  holds (a store in flight, a load reading it), or returns None and changes nothing; None
  exactly when too few can be chosen; ``remove`` and ``clear`` forget; the embedded core
  holds exactly the chunks vLLM holds.
- intent: a hinted request's chunks outlive hint-less ones under priority_lru.
- replay: the journal replays with --verify to the same evictions.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.journal import JournalSource
from broker.model.core import Directive
from broker.replay.replay import journal_batches, replay, replay_source
from tests.vllm_integration.decisions_to_vllm.fakes import Chunk, Ctx, k
from vllm_integration.decisions_to_vllm import policy_calls
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.policy_calls import Translator
from vllm_integration.decisions_to_vllm.settings import load_settings
from vllm_integration.hints import envelope_dict


def translator(policy: str, capacity: int, journal: str = "none") -> Translator:
    settings = load_settings({"kvbroker_policy": policy, "kvbroker_journal": journal}, {})
    return Translator(EmbeddedCore(settings, capacity))


def resident(t: Translator) -> set[str]:
    """Block ids in the embedded core's tier (after applying what is buffered)."""
    t.apply()
    return {b.block_id for b in t.local.core.blocks.values() if b.tier == 0}


def drive(t: Translator, rng: random.Random, steps: int, capacity: int) -> list[list[bytes]]:
    """A random stream as vLLM's manager makes it; checks the contract at every eviction.
    Returns the victims of each granted eviction."""
    chunks: dict[bytes, Chunk] = {}
    evictions: list[list[bytes]] = []
    fresh = 0
    ctxs = [Ctx(f"r{i}") for i in range(4)]
    for _ in range(steps):
        roll = rng.random()
        ctx = rng.choice(ctxs)
        keys = list(chunks)
        if roll < 0.3:
            free = capacity - len(chunks)
            group = [k(fresh + i) for i in range(rng.randint(1, 3))]
            fresh += len(group)
            need = len(group) - free
            evictable = [x for x in keys if chunks[x].ref_cnt == 0]
            protected = set(rng.sample(keys, min(len(keys), rng.randint(0, 3)))) | set(group)
            if need > 0:
                before = dict(t.entries)
                got = t.evict(need, protected)
                choosable = [x for x in evictable if x not in protected]
                if got is None:
                    assert len(choosable) < need and t.entries == before
                    continue
                victims = [x for x, _ in got]
                assert len(victims) == len(set(victims)) == need
                assert set(victims) <= set(choosable)
                assert all(chunk is chunks[x] for x, chunk in got)
                for x in victims:
                    del chunks[x]
                    assert t.get(x) is None
                evictions.append(victims)
            for x in group:
                chunks[x] = Chunk(-1)
                t.insert(x, chunks[x], ctx)
        elif roll < 0.5 and keys:  # a store completes (or fails), or a load ends
            x = rng.choice(keys)
            chunk = chunks[x]
            if chunk.ref_cnt == -1 and rng.random() < 0.1:
                t.remove(x)
                del chunks[x]
            elif chunk.ref_cnt == -1 or chunk.ref_cnt == 1:
                chunk.ref_cnt = 0
                t.mark_evictable(x)
            elif chunk.ref_cnt > 1:
                chunk.ref_cnt -= 1
        elif roll < 0.6 and keys:  # a load starts
            x = rng.choice(keys)
            chunk = chunks[x]
            if chunk.ref_cnt >= 0:
                if chunk.ref_cnt == 0:
                    t.mark_non_evictable(x)
                chunk.ref_cnt += 1
        elif roll < 0.8 and keys:
            t.touch([*rng.sample(keys, min(len(keys), 4)), k(10**9)], ctx)  # an unknown key is skipped
        elif roll < 0.95 and keys:
            t.on_request_finished([rng.sample(keys, min(len(keys), 5))], set(), set(), ctx)
        elif roll < 0.97:
            t.clear()
            chunks.clear()
            assert t.entries == {}
        assert {x for x in chunks if t.get(x) is not chunks[x]} == set()
    assert resident(t) == {x.hex() for x in chunks}
    assert t.local.core.stats.evictions == t.stats.chunks_evicted  # the core evicted nothing on its own
    assert t.local.rejected == t.stats.evictions_refused  # and refused no event but those
    return evictions


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["lru", "arc", "s3fifo", "fifo", "sieve", "two_queue", "prefix_aware", "adaptive", "priority_lru"]),
    st.integers(0, 2**32),
)
def test_contract_under_a_random_stream(policy: str, seed: int) -> None:
    drive(translator(policy, 12), random.Random(seed), 300, 12)


@pytest.mark.parametrize("step_ms", [0, 1, 300, 2000])
def test_contract_whatever_the_clock_does_to_batching(step_ms: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffered events are applied once per decision, or when they waited FLUSH_MS: with a
    clock that moves ``step_ms`` per call, batches are cut anywhere; nothing is lost."""
    ticks = itertools.count()
    monkeypatch.setattr(policy_calls.time, "time_ns", lambda: next(ticks) * step_ms * 1_000_000)
    for policy in ("arc", "lru", "s3fifo"):
        for seed in range(5):
            drive(translator(policy, 12), random.Random(seed), 300, 12)


def test_a_hinted_request_keeps_its_chunks_over_hintless_ones_under_priority_lru() -> None:
    """priority_lru (policies/priority_lru.py) evicts the coldest priority class first, then
    the lowest request priority, then the least recent: a request hinted "hot" keeps its
    chunks over newer hint-less ones; under lru, the same stream evicts them (oldest)."""
    for policy, survivor in (("priority_lru", "hinted"), ("lru", "plain")):
        t = translator(policy, 8)
        hinted, plain = Ctx("hinted", envelope_dict(priority="hot", request_priority=80)), Ctx("plain")
        for i, ctx in enumerate([hinted] * 4 + [plain] * 4):
            t.insert(k(i), Chunk(0), ctx)
        victims = t.evict(4, set())
        assert victims is not None
        kept = {x for x in map(k, range(8))} - {x for x, _ in victims}
        expected = {k(i) for i in (range(4) if survivor == "hinted" else range(4, 8))}
        assert kept == expected, policy
    assert t.stats.hinted_requests == 1


def test_a_malformed_hint_is_ignored_counted_and_the_request_still_runs() -> None:
    t = translator("lru", 4)
    bad = Ctx("r", {"actions": [{"action_type": "kvbroker.intent", "action_version": "1", "payload": {"priority": "urgent"}}]})
    t.insert(k(1), Chunk(0), bad)
    t.insert(k(2), Chunk(0), bad)  # parsed once per request
    assert resident(t) == {k(1).hex(), k(2).hex()}
    assert sum(t.stats.hints_ignored.values()) == 1
    assert "payload.priority" in next(iter(t.stats.hints_ignored))


def test_the_journal_replays_with_verify_to_the_same_evictions(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/vllm.journal"
    t = translator("s3fifo", 10, url)
    evictions = drive(t, random.Random(7), 600, 10)
    t.flush()
    t.local.close()
    assert evictions, "the stream must make the policy choose"
    (result,) = replay_source(JournalSource(url), ["s3fifo"], verify=True)
    assert result.mismatches == 0
    sink: list[Directive] = []
    config = t.local.config
    replay(journal_batches(JournalSource(url)), config, None, sink=sink)
    assert [d.block_id for d in sink] == [x.hex() for group in evictions for x in group]


class Wrong:
    """A decider out of step with vLLM (a remote one may be): it names what it is told."""

    def __init__(self, answer: list[str] | None = None, fail: bool = False) -> None:
        self.answer = answer
        self.fail = fail

    def evict(self, count: int, protected: list[str]) -> list[str] | None:
        if self.fail:
            raise RuntimeError("broker gone")
        return self.answer


@pytest.mark.parametrize(
    ("decider", "n"),
    [
        (Wrong(fail=True), 1),
        (Wrong(["nope"]), 1),
        (Wrong([k(1).hex(), k(1).hex()]), 2),
        (Wrong([k(0).hex()]), 1),
        (Wrong([k(1).hex()]), 2),
    ],
    ids=["raises", "unknown", "twice", "protected", "too-few"],
)
def test_a_decider_that_fails_or_names_impossible_victims_refuses_the_store_and_changes_nothing(decider: Wrong, n: int) -> None:
    t = translator("lru", 4)
    for i in range(3):
        t.insert(k(i), Chunk(0), Ctx("r"))
    t.decider = decider
    before = dict(t.entries)
    assert t.evict(n, {k(0)}) is None
    assert t.entries == before and t.stats.evictions_refused == 1 and t.stats.errors == 1


def test_a_policy_that_raises_does_not_stop_the_engine() -> None:
    t = translator("lru", 4)
    t.insert(k(1), Chunk(0), Ctx("r"))

    def broken(evs: list[bytes]) -> object:
        raise RuntimeError("policy bug")

    t.local.apply = broken  # type: ignore[method-assign]
    assert t.apply() is None and t.stats.errors == 1
    assert t.evict(1, set()) is None  # the local decider gets no outcome: the store is refused


def test_an_engine_restarted_on_the_same_journal_replays_both_runs(tmp_path: Path) -> None:
    """A restart writes on the journal of the run before (same client id): its batches number
    on above the last run's, its first clears the last run's chunks, and its config may size
    the tier anew. Replay makes both runs' evictions; --verify checks one run's journal only
    (the restarted core numbers its directives from 1 again: docs/vllm.md says to give each
    run its own journal, "{pid}" in the path)."""
    url = f"file://{tmp_path}/vllm.journal"
    runs = []
    for capacity, seed in ((10, 1), (6, 2)):
        t = translator("lru", capacity, url)
        runs.append(drive(t, random.Random(seed), 400, capacity))
        t.flush()
        t.local.close()
    sink: list[Directive] = []
    replay(journal_batches(JournalSource(url)), translator("lru", 10).local.config, None, sink=sink)
    assert [d.block_id for d in sink] == [x.hex() for run in runs for group in run for x in group]


def test_placeholders_name_the_process_and_the_data_parallel_rank() -> None:
    settings = load_settings({"kvbroker_client_id": "vllm-dp{rank}", "kvbroker_journal": "file:///j/{rank}-{pid}.journal"}, {}, rank=3)
    assert settings.resolved_client_id() == "vllm-dp3"
    assert settings.resolved_journal() == f"file:///j/3-{os.getpid()}.journal"


def test_the_counters_are_logged_every_minute(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    now = [1_000_000_000_000]
    monkeypatch.setattr(policy_calls.time, "time_ns", lambda: now[0])
    t = translator("lru", 4)
    with caplog.at_level("INFO", logger="vllm.kvbroker"):
        t.insert(k(1), Chunk(0), Ctx("r"))
        assert not [r for r in caplog.records if "chunks held" in r.getMessage()]
        now[0] += policy_calls.REPORT_MS * 1_000_000
        t.insert(k(2), Chunk(0), Ctx("r"))
    (line,) = [r.getMessage() for r in caplog.records if "chunks held" in r.getMessage()]
    assert line.startswith("kvbroker: 2 chunks held, 0 evictions asked (0 refused)") and "journal none" in line


@pytest.mark.parametrize("policy", ["lru", "history_arc", "s3fifo"])
def test_calls_vllms_interface_allows_answer_as_vllms_lru(policy: str, caplog: pytest.LogCaptureFixture) -> None:
    # vLLM never makes these today, but its CachePolicy interface allows them (issue 41):
    # its LRU answers evict(-1) with [] and takes a 0-byte key as any other.
    t = translator(policy, 16)
    ctx = Ctx("r")
    keys = [b"", *(k(i) for i in range(1, 16))]
    for key in keys:
        t.insert(key, Chunk(0), ctx)
    assert t.evict(-1, set()) == [] and t.evict(0, set()) == []
    victims = t.evict(16, set())
    assert victims is not None and sorted(key for key, _ in victims) == sorted(keys)
    assert t.stats.errors == 0 and not [r for r in caplog.records if r.levelno >= logging.WARNING]
