"""Stand-ins for vLLM's ReqContext and ChunkStatus (the translator is duck-typed), for the
tests that run without vLLM."""

from __future__ import annotations

from typing import Any


class Ctx:
    """vLLM's ReqContext: a request id, its kv_hints, per-type state, key positions."""

    def __init__(self, req_id: str, kv_hints: Any = None) -> None:
        self.req_id = req_id
        self.kv_hints = kv_hints
        self._state: dict[type, Any] = {}
        self._positions: dict[Any, int] = {}

    def get_state(self, cls: type) -> Any:
        return self._state.get(cls)

    def set_state(self, value: Any) -> None:
        self._state[type(value)] = value

    def get_offload_key_position(self, key: Any) -> int | None:
        return self._positions.get(key)

    def set_offload_key_position(self, key: Any, end_token: int) -> None:
        self._positions[key] = end_token


class Chunk:
    """vLLM's ChunkStatus: ref_cnt -1 while stored, 0 evictable, > 0 while loads read it."""

    def __init__(self, ref_cnt: int = -1) -> None:
        self.ref_cnt = ref_cnt


def k(n: int) -> bytes:
    """An OffloadKey: 8 hash bytes and the group index."""
    return n.to_bytes(8, "big") + b"\x00\x00\x00\x00"
