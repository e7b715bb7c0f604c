"""A request's KV hint must never hurt vLLM (issue 33, items 1-4 and 17), with stand-ins for
vLLM's request contexts and chunks; through vLLM's real manager in test_vllm_hints.py.

- whatever a hint holds, no policy call raises; a bad hint is ignored with a counted reason
  and its request runs without intent (its chunks still mirror vLLM's);
- hint values are held to what the core accepts, so no chunk of a hinted request is
  rejected by the core; an event the core cannot read costs only itself;
- the embedded decider's answer is the whole of its decision;
- hint strings and request ids are bounded;
- a negative or absurd token position is a plain use, counted.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from broker.model.wire import read_batch
from tests.vllm_integration.decisions_to_vllm.fakes import Chunk, Ctx, k
from vllm_integration.decisions_to_vllm import intent_bytes, policy_calls
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.policy_calls import Translator
from vllm_integration.decisions_to_vllm.settings import load_settings
from vllm_integration.hints import ACTION_TYPE, MAX_DEADLINE_MS, MAX_TENANT_BYTES, envelope_dict, parse_intent


def translator(policy: str = "lru", capacity: int = 8) -> Translator:
    settings = load_settings({"kvbroker_policy": policy, "kvbroker_journal": "none"}, {})
    return Translator(EmbeddedCore(settings, capacity))


def envelope(payload: Any) -> dict[str, Any]:
    return {
        "protocol_version": "1",
        "message_id": "m",
        "actions": [{"action_id": "a", "action_type": ACTION_TYPE, "action_version": "1", "payload": payload}],
    }


def core_ids(t: Translator) -> set[str]:
    t.apply()
    return {b.block_id for b in t.local.core.blocks.values() if b.tier == 0}


def nested(depth: int) -> list[Any]:
    top: list[Any] = []
    cur = top
    for _ in range(depth):
        nxt: list[Any] = []
        cur.append(nxt)
        cur = nxt
    return top


class Raising:
    """An envelope (or payload) whose every attribute read raises."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"no {name}")


class RaisingMapping(dict):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        raise RuntimeError("iterating")

    def get(self, key: Any, default: Any = None) -> Any:
        raise RuntimeError("get")


HOSTILE = {
    "deadline 1e306 (float)": envelope({"deadline_ms": 1e306}),
    "deadline 10**400 (int)": envelope({"deadline_ms": 10**400}),
    "deadline 1e16 (past int64 us)": envelope({"deadline_ms": 1e16}),
    "deadline inf": envelope({"deadline_ms": float("inf")}),
    "request_priority 10**400": envelope({"request_priority": 10**400}),
    "reuse 2**32": envelope({"expected_reuse_tokens": 2**32}),
    "reuse 10**5000 (no repr)": envelope({"expected_reuse_tokens": 10**5000}),
    "tenant lone surrogate": envelope({"tenant": "\ud800acme"}),
    "tenant 1 MiB": envelope({"tenant": "t" * (1 << 20)}),
    "tenant 257 bytes": envelope({"tenant": "é" * 128 + "x"}),
    "priority nested 100k deep": envelope({"priority": nested(100_000)}),
    "payload key nested": envelope({("k",) * 3: 1}),
    "payload key lone surrogate": envelope({"\udc80": 1}),
    "envelope whose reads raise": Raising(),
    "action whose reads raise": {"actions": [Raising()]},
    "payload whose reads raise": envelope(RaisingMapping()),
    "actions nested 100k deep": {"actions": nested(100_000)},
}


@pytest.mark.parametrize("hint", list(HOSTILE.values()), ids=list(HOSTILE))
def test_no_hint_raises_into_a_policy_call_and_its_request_runs_without_intent(hint: Any) -> None:
    """Each CachePolicy entry point that reads a request's hint, with a hostile one: none
    raises; the hint is ignored once, with a counted reason (or, for an envelope with no
    kvbroker action, silently); the request's chunks are the core's as vLLM's."""
    assert parse_intent(hint)[0] is None
    t = translator()
    ctx = Ctx("r", hint)
    ctx.set_offload_key_position(k(1), 16)
    t.insert(k(1), Chunk(0), ctx)
    t.insert(k(2), Chunk(0), ctx)
    t.on_request_access([k(1), k(2)], ctx)
    t.touch([k(2)], ctx)
    t.on_request_finished([[k(1), k(2)]], set(), {k(1)}, ctx)
    assert core_ids(t) == {k(1).hex(), k(2).hex()}
    assert sum(t.stats.hints_ignored.values()) <= 1 and t.stats.hinted_requests == 0
    assert t.stats.errors == 0 and t.local.rejected == 0
    for reason in t.stats.hints_ignored:
        assert len(reason) < 300  # a value is shown shortened, never whole


def test_the_issues_crashes_are_ignored_with_a_reason_naming_the_field() -> None:
    cases = {
        "payload.deadline_ms": envelope({"deadline_ms": 1e306}),
        "payload.tenant: not valid UTF-8": envelope({"tenant": "\ud800"}),
        "payload.priority: expected one of": envelope({"priority": nested(100_000)}),
        "kv_hints: unreadable (RuntimeError)": Raising(),
    }
    for words, hint in cases.items():
        hint_, reason = parse_intent(hint)
        assert hint_ is None and words in reason, (words, reason)


def test_a_deadline_past_what_the_core_accepts_is_ignored_and_the_chunks_stay_the_cores() -> None:
    """deadline_ms 1e16 made a deadline_us past int64: the core rejected the request's
    chunks (held by vLLM, unknown to the core). Now the hint is ignored; the bound itself
    is accepted and reaches the core."""
    t = translator()
    far = Ctx("far", envelope({"deadline_ms": 1e16}))
    t.insert(k(1), Chunk(0), far)
    t.insert(k(2), Chunk(0), Ctx("plain"))
    assert core_ids(t) == {k(1).hex(), k(2).hex()}
    assert t.local.rejected == 0
    assert any("deadline_ms" in r for r in t.stats.hints_ignored)
    edge = Ctx("edge", envelope({"deadline_ms": MAX_DEADLINE_MS, "request_priority": 100, "expected_reuse_tokens": 2**32 - 1}))
    t.insert(k(3), Chunk(0), edge)
    assert k(3).hex() in core_ids(t) and t.local.rejected == 0
    block = t.local.core.blocks[k(3).hex()]
    assert block.deadline_us is not None and block.deadline_us >= MAX_DEADLINE_MS * 1000
    assert block.request_priority == 100 and t.stats.hinted_requests == 1


def test_an_event_the_core_rejects_does_not_drop_its_batchs_other_events() -> None:
    """apply_batch rejects one event and applies the rest (a deadline_us past int64 reads
    as negative)."""
    t = translator()
    t.insert(k(1), Chunk(0), Ctx("a"))
    bad = intent_bytes.intent_fields("b", deadline_us=2**63 + 1)
    t.record(intent_bytes.allocated(t.timestamp(), intent_bytes.id_field("bad"), bad))
    t.insert(k(2), Chunk(0), Ctx("c"))
    assert core_ids(t) == {k(1).hex(), k(2).hex()}
    assert t.local.rejected == 1


def test_an_event_the_core_cannot_read_costs_only_itself() -> None:
    """Bytes the core cannot read made it refuse the whole batch (every chunk of it lost to
    the core). Now the readable events apply without it, counted."""
    t = translator()
    t.insert(k(1), Chunk(0), Ctx("a"))
    t.record(b"\x08\x01\x12\xff\xff")  # an Event whose allocated claims more bytes than it has
    t.insert(k(2), Chunk(0), Ctx("c"))
    assert core_ids(t) == {k(1).hex(), k(2).hex()}
    assert t.stats.events_dropped == 1
    assert not intent_bytes.readable(intent_bytes.batch(intent_bytes.batch_head("x"), 1, [b"\x08\x01\x12\xff\xff"]))


def test_the_embedded_decision_is_whole_when_an_earlier_event_was_rejected() -> None:
    """A rejected event buffered before an eviction made the decider answer None although
    the core had evicted: vLLM kept a chunk the core forgot. Now the eviction's own outcome
    decides: victims given, and the core and vLLM both drop them."""
    t = translator(capacity=4)
    ctx = Ctx("r")
    for i in range(4):
        t.insert(k(i), Chunk(0), ctx)
    t.record(intent_bytes.freed(t.timestamp(), [intent_bytes.id_field("unknown")]))  # rejected by the core
    victims = t.evict(1, set())
    assert victims is not None and [key for key, _ in victims] == [k(0)]
    assert core_ids(t) == {k(i).hex() for i in range(1, 4)} == {key.hex() for key in t.entries}
    assert t.local.rejected == 1 and t.stats.evictions_refused == 0
    # The same with an unreadable event before it (the batch applies without that event).
    t.record(intent_bytes.freed(t.timestamp(), [intent_bytes.id_field("unknown")]))
    t.record(b"\x08\x01\x12\xff\xff")
    victims = t.evict(1, set())
    assert victims is not None and [key for key, _ in victims] == [k(1)]
    assert core_ids(t) == {k(i).hex() for i in range(2, 4)} == {key.hex() for key in t.entries}
    assert t.stats.events_dropped == 1 and t.local.rejected == 2
    # Refused when the eviction itself is rejected (every chunk protected): nothing changed.
    assert t.evict(1, set(t.entries)) is None
    assert core_ids(t) == {key.hex() for key in t.entries} and len(t.entries) == 2


def test_a_tenant_is_bounded_in_bytes_and_never_copied_per_chunk_beyond_it() -> None:
    """A 1 MiB tenant was copied into every chunk's event (4 requests x 256 chunks: +1 GiB).
    Now a tenant over MAX_TENANT_BYTES ignores the hint; at the bound it is kept, one string
    however many requests name it."""
    at_bound = "é" * (MAX_TENANT_BYTES // 2)
    assert parse_intent(envelope({"tenant": at_bound}))[0] is not None
    assert "payload.tenant: longer than 256 bytes" in parse_intent(envelope({"tenant": at_bound + "x"}))[1]
    t = translator(capacity=64)
    huge = "t" * (1 << 20)
    for r in range(4):
        ctx = Ctx(f"r{r}", envelope({"tenant": huge, "priority": "hot"}))
        for i in range(8):
            t.insert(k(r * 8 + i), Chunk(0), ctx)
    assert max(len(ev) for ev in t._buffer) < 200
    assert t.stats.hints_ignored and t.stats.hinted_requests == 0
    # At the bound: two requests' parsed tenants are the same string object.
    a = parse_intent(envelope({"tenant": "".join(["acme-"] * 40)}))[0]
    b = parse_intent(envelope({"tenant": "".join(["acme-"] * 40)}))[0]
    assert a is not None and b is not None and a.tenant is b.tenant


@pytest.mark.parametrize("req_id", ["r\ud800", "r" * 10_000, "é" * 200])
def test_a_request_id_too_long_or_not_utf8_is_named_by_its_digest(req_id: str) -> None:
    t = translator()
    ctx = Ctx(req_id)
    ctx.set_offload_key_position(k(1), 16)
    ctx.set_offload_key_position(k(2), 32)
    t.insert(k(1), Chunk(0), ctx)
    t.insert(k(2), Chunk(0), ctx)
    t.on_request_access([k(1), k(2)], ctx)
    t.on_request_finished([[k(1), k(2)]], set(), set(), ctx)
    evs = list(t._buffer)
    assert core_ids(t) == {k(1).hex(), k(2).hex()} and t.local.rejected == 0
    names = {b.request_id for b in t.local.core.blocks.values()}
    assert len(names) == 1
    name = names.pop()
    assert len(name.encode()) <= policy_calls.MAX_REQUEST_ID_BYTES
    assert name.startswith("~") and t.request_name(req_id) == name
    assert max(len(ev) for ev in evs) < 400
    # Another request with another such id gets another name.
    assert t.request_name(req_id + "x") != name


@pytest.mark.parametrize("position", [-1, -1000, 2**63, 2**64 + 5])
def test_a_negative_or_absurd_token_position_is_a_plain_use_counted(position: int) -> None:
    """-1000 raised IndexError; -1 was written as 127. Now the key is position-less."""
    t = translator()
    ctx = Ctx("r")
    ctx.set_offload_key_position(k(1), position)
    ctx.set_offload_key_position(k(2), 48)
    t.insert(k(1), Chunk(0), ctx)
    t.insert(k(2), Chunk(0), ctx)
    t.on_request_access([k(1), k(2)], ctx)
    t.on_request_finished([[k(1), k(2)]], set(), set(), ctx)
    assert core_ids(t) == {k(1).hex(), k(2).hex()} and t.local.rejected == 0
    assert t.local.core.blocks[k(1).hex()].token_start == 0
    assert t.local.core.blocks[k(2).hex()].token_start == 48
    assert t.stats.positions_ignored == 2  # insert and the access


def test_a_varint_never_writes_a_negative_value_as_another() -> None:
    assert intent_bytes.varint(127) == b"\x7f"
    for bad in (-1, -1000, 2**64):
        with pytest.raises(ValueError, match="varint"):
            intent_bytes.varint(bad)
        with pytest.raises(ValueError, match="varint"):
            intent_bytes.position_varint(bad)
    assert read_batch(
        intent_bytes.batch(
            intent_bytes.batch_head("x"),
            1,
            [intent_bytes.scoped_accessed(intent_bytes.timestamp(1), [intent_bytes.id_field("a")], intent_bytes.scope("s"), [2**64 - 1])],
        )
    )


def test_ignored_hints_are_logged_rate_limited_and_their_reasons_counted_bounded(caplog: pytest.LogCaptureFixture) -> None:
    t = translator(capacity=4)
    with caplog.at_level(logging.WARNING, logger="vllm.kvbroker"):
        for i in range(500):
            t.request_intent(Ctx(f"r{i}", envelope({"priority": f"urgent-{i}"})))
    warnings = [r for r in caplog.records if "kv_hints ignored" in r.getMessage()]
    assert len(warnings) == 1
    assert sum(t.stats.hints_ignored.values()) == 500
    assert len(t.stats.hints_ignored) == policy_calls.HINT_REASONS + 1 and t.stats.hints_ignored["other"] == 500 - policy_calls.HINT_REASONS


def test_a_valid_hint_still_works() -> None:
    t = translator("priority_lru", 4)
    t.insert(k(1), Chunk(0), Ctx("h", envelope_dict(priority="hot", deadline_ms=500, tenant="acme", expected_reuse_tokens=10)))
    t.apply()
    block = t.local.core.blocks[k(1).hex()]
    assert block.tenant == "acme" and block.priority == 3 and block.deadline_us is not None
    assert t.stats.hinted_requests == 1 and not t.stats.hints_ignored
    assert t.request_name("cmpl-1234-0") == "cmpl-1234-0" and t.stats.request_ids_digested == 0
