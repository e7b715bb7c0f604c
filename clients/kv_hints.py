"""kvbroker intent on vLLM's KV hints: the helper an orchestrator uses, and the parser the
kvbroker CachePolicy uses.

vLLM 0.33 lets an orchestrator attach a ``KvHintsEnvelope`` to a request
(``vllm/v1/kv_hints/protocol.py``: ``protocol_version``, ``message_id``, ``actions`` of
``KvHintAction(action_id, action_type, action_version, payload)``); the offloading manager
hands it to the cache policy with every call for that request (``ReqContext.kv_hints``).
kvbroker reads one action type:

- ``action_type`` ``"kvbroker.intent"``, ``action_version`` ``"1"``;
- ``payload``, every key optional, what a request can know about its own KV:

  ============================ ==================================================================
  ``priority``                 ``"cold"``, ``"warm"`` or ``"hot"`` (MemoryIntent.priority).
                               ``decode_critical`` is refused: it pins, and a CPU-tier chunk vLLM
                               counts as evictable must stay evictable.
  ``request_priority``         0..100, the owning request's priority (default 50).
  ``deadline_ms``              the request's chunks are needed again within this many
                               milliseconds of when the policy first sees the request (>= 0).
  ``expected_reuse_tokens``    tokens until the chunks are expected to be read again (>= 0).
  ``tenant``                   the tenant the request acts for (a string).
  ``is_draft``                 the chunks hold speculative draft tokens (a bool).
  ============================ ==================================================================

An action of another type is not kvbroker's and is skipped silently. A kvbroker action
that is malformed (another version, a key it does not know, a value out of range) is
ignored whole, with a reason (``IntentHint`` is None); the request then runs without
intent. Nothing here raises on bad input from a request: it must never stop vLLM.

This module imports neither the broker nor vLLM (vLLM lazily, in ``intent_envelope``).
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Mapping
from typing import Any, Final

ACTION_TYPE: Final = "kvbroker.intent"
ACTION_VERSION: Final = "1"
PROTOCOL_VERSION: Final = "1"

# Priority names a hint may use, and their numbers (kvbroker.v1.Priority).
PRIORITIES: Final = {"cold": 1, "warm": 2, "hot": 3}
PAYLOAD_KEYS: Final = ("priority", "request_priority", "deadline_ms", "expected_reuse_tokens", "tenant", "is_draft")


@dataclasses.dataclass(frozen=True, slots=True)
class IntentHint:
    """A request's intent, as read from its kvbroker action (None: not given)."""

    priority: int | None = None
    request_priority: int | None = None
    deadline_ms: float | None = None
    expected_reuse_tokens: int | None = None
    tenant: str | None = None
    is_draft: bool | None = None


def intent_payload(
    *,
    priority: str | None = None,
    request_priority: int | None = None,
    deadline_ms: float | None = None,
    expected_reuse_tokens: int | None = None,
    tenant: str | None = None,
    is_draft: bool | None = None,
) -> dict[str, Any]:
    """The ``payload`` of a kvbroker action (only the keys given); raises ValueError naming
    the key when a value is not one the policy would take."""
    payload: dict[str, Any] = {}
    given = {
        "priority": priority,
        "request_priority": request_priority,
        "deadline_ms": deadline_ms,
        "expected_reuse_tokens": expected_reuse_tokens,
        "tenant": tenant,
        "is_draft": is_draft,
    }
    for key, value in given.items():
        if value is not None:
            payload[key] = value
    _, reason = read_payload(payload)
    if reason:
        raise ValueError(reason)
    return payload


def intent_action(action_id: str | None = None, **intent: Any) -> dict[str, Any]:
    """One kvbroker action as a plain dict (the JSON form of a KvHintAction)."""
    return {
        "action_id": action_id or uuid.uuid4().hex,
        "action_type": ACTION_TYPE,
        "action_version": ACTION_VERSION,
        "payload": intent_payload(**intent),
    }


def envelope_dict(message_id: str | None = None, action_id: str | None = None, **intent: Any) -> dict[str, Any]:
    """A whole envelope with one kvbroker action, as a plain dict (what
    ``msgspec.to_builtins`` makes of vLLM's KvHintsEnvelope; ``msgspec.convert(d,
    KvHintsEnvelope)`` makes it back)."""
    return {
        "protocol_version": PROTOCOL_VERSION,
        "message_id": message_id or uuid.uuid4().hex,
        "actions": [intent_action(action_id, **intent)],
    }


def intent_envelope(message_id: str | None = None, action_id: str | None = None, **intent: Any) -> Any:
    """vLLM's ``KvHintsEnvelope`` carrying one kvbroker action, for
    ``AsyncLLM.generate(..., kv_hints=...)`` / ``LLMEngine.add_request(..., kv_hints=...)``.
    Needs vLLM installed (``pip install 'kvbroker[vllm]'``)."""
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    d = envelope_dict(message_id, action_id, **intent)
    actions = [KvHintAction(a["action_id"], a["action_type"], a["action_version"], a["payload"]) for a in d["actions"]]
    return KvHintsEnvelope(d["protocol_version"], d["message_id"], actions)


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def parse_intent(envelope: Any) -> tuple[IntentHint | None, str]:
    """The kvbroker intent of an envelope (vLLM's KvHintsEnvelope or its dict form).

    Returns (hint, "") when it carries a valid kvbroker action, (None, "") when it carries
    none, and (None, reason) when its kvbroker action is malformed: the reason names the
    field. The first kvbroker action counts; a second one is refused (which would win?)."""
    if envelope is None:
        return None, ""
    actions = _field(envelope, "actions")
    if not isinstance(actions, (list, tuple)):
        return None, "kv_hints.actions: expected a list of actions"
    mine = [a for a in actions if _field(a, "action_type") == ACTION_TYPE]
    if not mine:
        return None, ""
    if len(mine) > 1:
        return None, f"kv_hints.actions: {len(mine)} {ACTION_TYPE} actions in one envelope; send one"
    action = mine[0]
    version = _field(action, "action_version")
    if version != ACTION_VERSION:
        return None, f"kv_hints.actions[{ACTION_TYPE}].action_version: {version!r} is not supported (this policy reads {ACTION_VERSION!r})"
    return read_payload(_field(action, "payload"))


def read_payload(payload: Any) -> tuple[IntentHint | None, str]:
    """Validate a version-1 payload; (hint, "") or (None, reason naming the key)."""
    where = f"kv_hints.actions[{ACTION_TYPE}].payload"
    if not isinstance(payload, Mapping):
        return None, f"{where}: expected an object, got {type(payload).__name__}"
    for key in payload:
        if key not in PAYLOAD_KEYS:
            return None, f"{where}.{key}: unknown key (known: {', '.join(PAYLOAD_KEYS)})"
    values: dict[str, Any] = {}
    priority = payload.get("priority")
    if priority is not None:
        if not isinstance(priority, str) or priority.lower() not in PRIORITIES:
            return None, f"{where}.priority: expected one of {', '.join(PRIORITIES)}, got {priority!r}"
        values["priority"] = PRIORITIES[priority.lower()]
    for key, top in (("request_priority", 100), ("expected_reuse_tokens", 2**32 - 1)):
        value = payload.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
                return None, f"{where}.{key}: expected an integer in 0..{top}, got {value!r}"
            values[key] = value
    deadline = payload.get("deadline_ms")
    if deadline is not None:
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not 0 <= deadline < math.inf:
            return None, f"{where}.deadline_ms: expected a finite number >= 0, got {deadline!r}"
        values["deadline_ms"] = float(deadline)
    tenant = payload.get("tenant")
    if tenant is not None:
        if not isinstance(tenant, str):
            return None, f"{where}.tenant: expected a string, got {type(tenant).__name__}"
        values["tenant"] = tenant
    is_draft = payload.get("is_draft")
    if is_draft is not None:
        if not isinstance(is_draft, bool):
            return None, f"{where}.is_draft: expected true or false, got {is_draft!r}"
        values["is_draft"] = is_draft
    return IntentHint(**values), ""
