"""kvbroker.intent v1 on vLLM's KV hints: the orchestrator's helper and the policy's parser."""

from __future__ import annotations

import pytest

from vllm_integration.hints import ACTION_TYPE, IntentHint, envelope_dict, intent_payload, parse_intent


def test_the_envelope_round_trips_through_the_parser() -> None:
    env = envelope_dict(priority="hot", request_priority=90, deadline_ms=250, expected_reuse_tokens=4096, tenant="acme", is_draft=False)
    assert env["protocol_version"] == "1" and env["actions"][0]["action_type"] == ACTION_TYPE
    hint, reason = parse_intent(env)
    assert reason == ""
    assert hint == IntentHint(priority=3, request_priority=90, deadline_ms=250.0, expected_reuse_tokens=4096, tenant="acme", is_draft=False)


def test_no_kvbroker_action_is_no_intent_and_no_complaint() -> None:
    other = {"protocol_version": "1", "message_id": "m", "actions": [{"action_type": "acme.route", "action_version": "2", "payload": {}}]}
    assert parse_intent(other) == (None, "")
    assert parse_intent(None) == (None, "")


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        ({"priority": "decode_critical"}, "payload.priority: expected one of cold, warm, hot"),
        ({"request_priority": 101}, "payload.request_priority: expected an integer in 0..100"),
        ({"request_priority": True}, "payload.request_priority"),
        ({"deadline_ms": -1}, "payload.deadline_ms: expected a finite number in 0..1000000000000"),
        ({"deadline_ms": float("nan")}, "payload.deadline_ms"),
        ({"tenant": 3}, "payload.tenant: expected a string"),
        ({"is_draft": "yes"}, "payload.is_draft: expected true or false"),
        ({"priorty": "hot"}, "payload.priorty: unknown key"),
        ([1, 2], "payload: expected an object"),
    ],
)
def test_a_malformed_action_is_ignored_with_a_reason_naming_the_field(payload: object, words: str) -> None:
    env = {"actions": [{"action_type": ACTION_TYPE, "action_version": "1", "payload": payload}]}
    hint, reason = parse_intent(env)
    assert hint is None and words in reason


def test_another_version_or_two_actions_are_refused() -> None:
    v2 = {"actions": [{"action_type": ACTION_TYPE, "action_version": "2", "payload": {}}]}
    assert "action_version: '2' is not supported" in parse_intent(v2)[1]
    two = {"actions": [{"action_type": ACTION_TYPE, "action_version": "1", "payload": {}}] * 2}
    assert "2 kvbroker.intent actions" in parse_intent(two)[1]
    assert "expected a list" in parse_intent({"actions": "x"})[1]


def test_the_helper_refuses_what_the_parser_would_ignore() -> None:
    with pytest.raises(ValueError, match=r"payload\.priority"):
        intent_payload(priority="urgent")
    assert intent_payload(priority="cold", tenant="t") == {"priority": "cold", "tenant": "t"}
