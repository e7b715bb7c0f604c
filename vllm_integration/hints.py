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
                               milliseconds of when the policy first sees the request
                               (0..``MAX_DEADLINE_MS``, 10^12: about 31 years).
  ``expected_reuse_tokens``    tokens until the chunks are expected to be read again
                               (0..2^32-1, the wire's uint32).
  ``tenant``                   the tenant the request acts for (a string of at most
                               ``MAX_TENANT_BYTES``, 256, bytes of UTF-8).
  ``is_draft``                 the chunks hold speculative draft tokens (a bool).
  ============================ ==================================================================

The bounds are those the core accepts (a deadline in microseconds after "now" must fit
MemoryIntent's int64 deadline_us) and keep what a request costs bounded: every chunk's
event carries the tenant.

An action of another type is not kvbroker's and is skipped silently. A kvbroker action
that is malformed (another version, a key it does not know, a value out of range) is
ignored whole, with a reason (``IntentHint`` is None); the request then runs without
intent. Nothing here raises on bad input from a request, whatever it holds (a float of
1e306, an int of 10**400, lone surrogates, a value nested 100k deep, an object whose
attribute reads raise): it must never stop vLLM. A reason shows a value shortened
(``reprlib``), never the whole of it.

This module imports neither the broker nor vLLM (vLLM lazily, in ``intent_envelope``).
"""

from __future__ import annotations

import dataclasses
import reprlib
import sys
import uuid
from collections.abc import Mapping
from typing import Any, Final

ACTION_TYPE: Final = "kvbroker.intent"
ACTION_VERSION: Final = "1"
PROTOCOL_VERSION: Final = "1"

# Priority names a hint may use, and their numbers (kvbroker.v1.Priority).
PRIORITIES: Final = {"cold": 1, "warm": 2, "hot": 3}
PAYLOAD_KEYS: Final = ("priority", "request_priority", "deadline_ms", "expected_reuse_tokens", "tenant", "is_draft")
# The largest deadline a hint may give: about 31 years, far below what keeps "now" plus it
# (in microseconds) inside MemoryIntent's int64 deadline_us (2^63 us is about 292,000 years).
MAX_DEADLINE_MS: Final = 10**12
# expected_reuse_window_tokens is a uint32 on the wire.
MAX_REUSE_TOKENS: Final = 2**32 - 1
# A tenant name's bound in UTF-8 bytes: each chunk's event carries it.
MAX_TENANT_BYTES: Final = 256

# Values shown in a reason: shortened, and never recursing deep (a hint is hostile).
_short = reprlib.Repr()
_short.maxstring = 40
_short.maxother = 40
_short.maxlong = 40
_short.maxlevel = 2


def key_name(key: Any) -> str:
    """A payload key as a field name in a reason: shortened, escaped, unquoted if a string."""
    name = show(key)
    return name[1:-1] if isinstance(key, str) and len(name) >= 2 and name[0] == name[-1] and name[0] in "'\"" else name


def show(value: Any) -> str:
    """A short, safe repr of a value from a request (for reasons and logs)."""
    try:
        return _short.repr(value)
    except Exception:  # an int past Python's digit limit, a repr that raises, ...
        return f"<{type(value).__name__}>"


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
    Needs vLLM installed (in the clone: ``python3 -m venv .venv-vllm && .venv-vllm/bin/pip install -e '.[vllm]'``)."""
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
    field. The first kvbroker action counts; a second one is refused (which would win?).
    Never raises: an envelope that cannot be read at all is (None, "kv_hints: unreadable
    (<exception type>)")."""
    if envelope is None:
        return None, ""
    try:
        return _parse(envelope)
    except Exception as exc:  # RecursionError, MemoryError, a property that raises: all hostile
        return None, f"kv_hints: unreadable ({type(exc).__name__})"


def _parse(envelope: Any) -> tuple[IntentHint | None, str]:
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
        return (
            None,
            f"kv_hints.actions[{ACTION_TYPE}].action_version: {show(version)} is not supported (this policy reads {ACTION_VERSION!r})",
        )
    return read_payload(_field(action, "payload"))


def read_payload(payload: Any) -> tuple[IntentHint | None, str]:
    """Validate a version-1 payload; (hint, "") or (None, reason naming the key). Never raises."""
    try:
        return _read_payload(payload)
    except Exception as exc:
        return None, f"kv_hints.actions[{ACTION_TYPE}].payload: unreadable ({type(exc).__name__})"


def _read_payload(payload: Any) -> tuple[IntentHint | None, str]:
    where = f"kv_hints.actions[{ACTION_TYPE}].payload"
    if not isinstance(payload, Mapping):
        return None, f"{where}: expected an object, got {type(payload).__name__}"
    for key in payload:
        if key not in PAYLOAD_KEYS:
            return None, f"{where}.{key_name(key)}: unknown key (known: {', '.join(PAYLOAD_KEYS)})"
    values: dict[str, Any] = {}
    priority = payload.get("priority")
    if priority is not None:
        name = str.lower(priority) if isinstance(priority, str) else None
        if name not in PRIORITIES:
            return None, f"{where}.priority: expected one of {', '.join(PRIORITIES)}, got {show(priority)}"
        values["priority"] = PRIORITIES[name]
    for key, top in (("request_priority", 100), ("expected_reuse_tokens", MAX_REUSE_TOKENS)):
        value = payload.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
                return None, f"{where}.{key}: expected an integer in 0..{top}, got {show(value)}"
            values[key] = int.__index__(value)  # a plain int, whatever subclass came
    deadline = payload.get("deadline_ms")
    if deadline is not None:
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not 0 <= deadline <= MAX_DEADLINE_MS:
            return None, f"{where}.deadline_ms: expected a finite number in 0..{MAX_DEADLINE_MS}, got {show(deadline)}"
        values["deadline_ms"] = float(deadline)
    tenant = payload.get("tenant")
    if tenant is not None:
        if not isinstance(tenant, str):
            return None, f"{where}.tenant: expected a string, got {type(tenant).__name__}"
        if len(tenant) > MAX_TENANT_BYTES:  # before encoding a megabyte only to refuse it
            return None, f"{where}.tenant: longer than {MAX_TENANT_BYTES} bytes ({len(tenant)} characters)"
        try:
            size = len(tenant.encode())
        except UnicodeEncodeError:
            return None, f"{where}.tenant: not valid UTF-8 (a lone surrogate), got {show(tenant)}"
        if size > MAX_TENANT_BYTES:
            return None, f"{where}.tenant: longer than {MAX_TENANT_BYTES} bytes ({size} bytes of UTF-8)"
        # One string per tenant name, however many requests name it.
        values["tenant"] = sys.intern(str.__str__(tenant))
    is_draft = payload.get("is_draft")
    if is_draft is not None:
        if not isinstance(is_draft, bool):
            return None, f"{where}.is_draft: expected true or false, got {show(is_draft)}"
        values["is_draft"] = is_draft
    return IntentHint(**values), ""
