"""The sidecar decider's rules, one at a time, with a scripted link (no broker, no vLLM):
which answers it takes, when it falls back and why, what it tells the broker afterwards,
and the names the broker sees."""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Sequence

import pytest

from kvbroker.v1 import broker_service_pb2 as spb
from kvbroker.v1 import directive_pb2 as dpb
from kvbroker.v1 import intent_pb2 as pb
from tests.vllm_integration.decisions_to_vllm.fakes import Chunk, Ctx
from vllm_integration.decisions_to_vllm import intent_bytes
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.link import DOWN, TIMEOUT, Unanswered
from vllm_integration.decisions_to_vllm.policy_calls import Translator
from vllm_integration.decisions_to_vllm.settings import SettingsError, load_settings
from vllm_integration.decisions_to_vllm.sidecar import Names, SidecarDecider
from vllm_integration.decisions_to_vllm.sidecar_setup import tier_problem

EVICT = dpb.DIRECTIVE_KIND_EVICT
PREFETCH = dpb.DIRECTIVE_KIND_PREFETCH


class ScriptedLink:
    """BrokerLink's surface; ``answers`` says what each ask gets."""

    client_id = "vllm-dp0"

    def __init__(self) -> None:
        self.connected = True
        self.failed: BaseException | None = None
        self.sent: list[pb.Event] = []
        self.asked: list[pb.Event] = []
        self.answers: collections.deque[dpb.DirectiveBatch | Unanswered] = collections.deque()
        self.directives: collections.deque[dpb.Directive] = collections.deque()
        self.resync = False

    def send(self, events: Sequence[pb.Event]) -> None:
        self.sent.extend(events)

    def send_later(self, make: Callable[[], Sequence[pb.Event]]) -> None:
        self.sent.extend(make())

    def ask(self, events: Sequence[pb.Event], timeout: float) -> dpb.DirectiveBatch | Unanswered:
        self.asked.extend(events)
        answer = self.answers.popleft()
        if isinstance(answer, dpb.DirectiveBatch):
            self.directives.extend(answer.directives)  # as the real link: every directive lands here too
        return answer

    def take_resync(self) -> bool:
        resync, self.resync = self.resync, False
        return resync

    def counters(self) -> dict[str, int]:
        return {"late_answers": 0, "client_rejected_events": 0}

    def close(self) -> None:
        return


def evict(directive_id: int, key: bytes, reason: str = "eviction requested by the engine", kind: int = EVICT) -> dpb.Directive:
    return dpb.Directive(directive_id=directive_id, kind=kind, block_id=f"vllm-dp0/{key.hex()}", from_tier="cpu0", reason=reason)  # type: ignore[arg-type]


def setup(n: int = 4) -> tuple[Translator, SidecarDecider, ScriptedLink, list[bytes]]:
    settings = load_settings({"kvbroker_mode": "sidecar", "kvbroker_broker": "127.0.0.1:1", "kvbroker_policy": "lru"}, environ={})
    local = EmbeddedCore(settings, n)
    translator = Translator(local)
    link = ScriptedLink()
    decider = SidecarDecider(link, translator, local, Names("vllm-dp0/", "cpu0"), now_us=lambda: 7)  # type: ignore[arg-type]
    translator.decider = decider
    keys = [bytes([i]) * 4 for i in range(n)]
    for key in keys:  # stored oldest first: the local LRU's victim is keys[0]
        translator.insert(key, Chunk(0), Ctx("r"))
    return translator, decider, link, keys


def acks(link: ScriptedLink) -> list[tuple[int, int, str]]:
    return [(e.acked.directive_id, e.acked.status, e.acked.actual_tier) for e in link.sent if e.WhichOneof("kind") == "acked"]


def test_an_answer_in_time_is_the_decision_and_is_acked_done() -> None:
    translator, decider, link, keys = setup()
    link.answers.append(dpb.DirectiveBatch(directives=[evict(5, keys[2])]))
    victims = translator.evict(1, {keys[3]})
    assert victims is not None and [k for k, _ in victims] == [keys[2]]  # the broker's, not the local LRU's keys[0]
    request = link.asked[0].eviction_requested
    assert (request.tier, request.count, list(request.protected_block_ids)) == ("cpu0", 1, [f"vllm-dp0/{keys[3].hex()}"])
    assert acks(link) == [(5, pb.ACK_STATUS_DONE, "")]
    decider.flush()  # the copy in link.directives is skipped, not acked twice
    assert acks(link) == [(5, pb.ACK_STATUS_DONE, "")]
    # The mirror freed it and the broker is told so, in its names.
    assert keys[2] not in translator.entries
    freed = [list(e.freed.block_ids) for e in link.sent if e.WhichOneof("kind") == "freed"]
    assert freed == [[f"vllm-dp0/{keys[2].hex()}"]]
    assert decider.counts["broker_decisions"] == 1 and decider.counts["fallback_decisions"] == 0


@pytest.mark.parametrize(
    "named",
    [
        "protected",  # vLLM protects it
        "held",  # vLLM holds it non-evictable (a transfer in flight)
        "unknown",  # vLLM does not have it
        "twice",  # two victims, one chunk
    ],
)
def test_an_answer_vllm_cannot_carry_out_falls_back_and_the_broker_puts_the_victims_back(named: str) -> None:
    translator, decider, link, keys = setup()
    translator.mark_non_evictable(keys[1])
    count = 2 if named == "twice" else 1
    victim = {"protected": keys[3], "held": keys[1], "unknown": b"\xff" * 4, "twice": keys[2]}[named]
    link.answers.append(dpb.DirectiveBatch(directives=[evict(5 + i, victim) for i in range(count)]))
    victims = translator.evict(count, {keys[3]})
    assert decider.counts["fallback_invalid"] == 1
    # The embedded core decided (its LRU: the oldest evictable, unprotected chunks).
    expected = [keys[0], keys[2]][:count]
    assert victims is not None and [k for k, _ in victims] == expected
    decider.flush()
    # The broker dropped what it named; vLLM kept those it still holds: acked FAILED with
    # their tier, so the broker puts them back. One it does not hold: DONE.
    still_held = victim in translator.entries
    status = pb.ACK_STATUS_FAILED if still_held else pb.ACK_STATUS_DONE
    assert acks(link) == [(5 + i, status, "cpu0" if still_held else "") for i in range(count)]


def test_a_refusal_falls_back() -> None:
    translator, decider, link, keys = setup()
    refusal = dpb.EventRejection(event_index=0, field="eviction_requested.count", reason="only 0 can be chosen", code="RESOURCE_EXHAUSTED")
    link.answers.append(dpb.DirectiveBatch(rejections=[refusal]))
    victims = translator.evict(1, set())
    assert victims is not None and [k for k, _ in victims] == [keys[0]]
    assert decider.counts["fallback_refused"] == 1


def test_down_does_not_ask_and_three_timeouts_stop_asking_for_the_cooldown() -> None:
    translator, decider, link, _ = setup(8)
    link.connected = False
    assert translator.evict(1, set()) is not None
    assert link.asked == [] and decider.counts["fallback_down"] == 1
    link.connected = True
    link.answers.extend([Unanswered(TIMEOUT)] * 3)
    for _ in range(3):
        assert translator.evict(1, set()) is not None
    assert decider.counts["fallback_timeout"] == 3 and len(link.asked) == 3
    # Cooling down: decided locally without asking.
    assert translator.evict(1, set()) is not None
    assert len(link.asked) == 3 and decider.counts["fallback_cooldown"] == 1
    decider._cool_until = 0.0  # the cooldown is over
    link.answers.append(Unanswered(DOWN))
    assert translator.evict(1, set()) is not None
    assert len(link.asked) == 4


def test_the_fallback_that_cannot_choose_returns_none_and_changes_nothing() -> None:
    translator, decider, link, keys = setup(2)
    link.connected = False
    assert translator.evict(1, set(keys)) is None
    assert decider.counts["fallback_none"] == 1 and set(translator.entries) == set(keys)


def test_late_and_unsolicited_directives_are_acked_with_where_the_chunk_really_is() -> None:
    translator, decider, link, keys = setup()
    link.connected = False
    victims = translator.evict(1, set())  # the fallback evicts keys[0]
    assert victims is not None and victims[0][0] == keys[0]
    # The request reached the broker later; it chose keys[1] (still held) and keys[0] (gone),
    # and it proposes a prefetch vLLM's manager cannot carry out.
    link.directives.extend([evict(8, keys[1]), evict(9, keys[0]), evict(10, keys[2], reason="prefetch", kind=PREFETCH)])
    decider.flush()
    assert acks(link) == [(8, pb.ACK_STATUS_FAILED, "cpu0"), (9, pb.ACK_STATUS_DONE, ""), (10, pb.ACK_STATUS_FAILED, "cpu0")]
    assert (decider.counts["late_victims_kept"], decider.counts["late_victims_evicted"], decider.counts["other_directives"]) == (1, 1, 1)


def test_a_resync_restates_every_chunk_vllm_holds_oldest_first() -> None:
    translator, decider, link, keys = setup()
    translator.remove(keys[1])
    decider.flush()  # what vLLM did so far goes to the broker first
    link.sent.clear()
    link.resync = True
    decider.flush()
    kinds = [e.WhichOneof("kind") for e in link.sent]
    assert kinds == ["cleared", "allocated", "allocated", "allocated"]
    allocated = [e.allocated for e in link.sent[1:]]
    assert [a.intent.block_id for a in allocated] == [f"vllm-dp0/{k.hex()}" for k in (keys[0], keys[2], keys[3])]
    assert all(a.tier == "cpu0" and list(a.intent.allowed_tiers) == ["cpu0"] and a.intent.size_bytes == 1 for a in allocated)
    assert decider.counts["resyncs"] == 1


def test_names_rewrite_a_batch_into_the_ranks_names_and_tier() -> None:
    names = Names("vllm-dp1/", "cpu1")
    ts = intent_bytes.timestamp(1000)
    a, b = intent_bytes.id_field("aa"), intent_bytes.id_field("bb")
    raw = intent_bytes.batch(
        intent_bytes.batch_head("local"),
        1,
        [
            intent_bytes.allocated(ts, a, intent_bytes.intent_fields("req-1")),
            intent_bytes.accessed(ts, [a, b]),
            intent_bytes.updated(ts, a, intent_bytes.update_fields(priority=3)),
            intent_bytes.eviction_requested(ts, 1, [b]),
            intent_bytes.freed(ts, [b]),
            intent_bytes.cleared(ts),
        ],
    )
    out = names.rewrite(raw)
    assert [e.WhichOneof("kind") for e in out] == ["allocated", "accessed", "intent_updated", "freed", "cleared"]
    allocated = out[0].allocated
    assert (allocated.intent.block_id, allocated.intent.request_id, allocated.tier) == ("vllm-dp1/aa", "req-1", "cpu1")
    assert list(allocated.intent.allowed_tiers) == ["cpu1"]
    assert list(out[1].accessed.block_ids) == ["vllm-dp1/aa", "vllm-dp1/bb"]
    assert out[2].intent_updated.block_id == "vllm-dp1/aa"
    assert list(out[3].freed.block_ids) == ["vllm-dp1/bb"]
    assert (names.local("vllm-dp1/aa"), names.local("vllm-dp0/aa")) == ("aa", None)
    # No tier named: the broker's top tier, nothing forced.
    top = Names("x/", "").rewrite(raw)[0].allocated
    assert (top.tier, list(top.intent.allowed_tiers)) == ("", [])


def test_sidecar_settings() -> None:
    settings = load_settings({"kvbroker_mode": "sidecar", "kvbroker_broker": "b:1", "kvbroker_broker_tier": "cpu{rank}"}, environ={})
    assert settings.broker_tier == "cpu{rank}"
    env = {"KVBROKER_VLLM_MODE": "sidecar", "KVBROKER_VLLM_BROKER": "b:2", "KVBROKER_VLLM_DEADLINE_MS": "2.5"}
    settings = load_settings({}, environ=env)
    assert (settings.mode, settings.broker, settings.deadline_ms) == ("sidecar", "b:2", 2.5)
    with pytest.raises(SettingsError, match=r"kvbroker_broker.*required in sidecar mode"):
        load_settings({"kvbroker_mode": "sidecar"}, environ={})
    with pytest.raises(SettingsError, match="kvbroker_deadline_ms"):
        load_settings({"kvbroker_mode": "sidecar", "kvbroker_broker": "b:1", "kvbroker_deadline_ms": 0}, environ={})
    with pytest.raises(SettingsError, match="kvbroker_fallback_policy"):
        load_settings({"kvbroker_mode": "sidecar", "kvbroker_broker": "b:1", "kvbroker_fallback_policy": "nope"}, environ={})


def test_rank_and_pid_in_the_client_id_and_the_broker_tier() -> None:
    extra = {
        "kvbroker_mode": "sidecar",
        "kvbroker_broker": "b:1",
        "kvbroker_client_id": "vllm-dp{rank}-{pid}",
        "kvbroker_broker_tier": "cpu{rank}",
    }
    settings = load_settings(extra, environ={}, rank=5)
    assert (settings.resolved_client_id(), settings.resolved_broker_tier()) == (f"vllm-dp5-{os.getpid()}", "cpu5")


def test_the_tier_check_names_what_cannot_work() -> None:
    tiers = [spb.TierUsage(name="cpu0", capacity_bytes=4096), spb.TierUsage(name="cpu1", capacity_bytes=1024)]
    assert tier_problem(tiers, "cpu0", 4096) is None
    assert tier_problem(tiers, "", 4096) is None  # the top tier
    missing = tier_problem(tiers, "cpu2", 4096)
    assert missing is not None and "no tier 'cpu2'" in missing and "cpu0, cpu1" in missing
    small = tier_problem(tiers, "cpu1", 4096)
    assert small is not None and "capacity = 4096" in small
    assert tier_problem([], "cpu0", 4096) is None  # a tenant token sees no totals
