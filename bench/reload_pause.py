#!/usr/bin/env python3
"""The pause a live switch (``kvbroker_settings_file``, vllm_integration/decisions_to_vllm/reload.py) costs:
reading and validating the file (the watcher's thread), then switching the embedded core
(vLLM's scheduler thread: the new policy warmed from a full CPU tier). One JSON line each.

    python bench/reload_pause.py                       # 1,953 and 19,531 chunks
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.policy_calls import Translator
from vllm_integration.decisions_to_vllm.reload import LiveSettings, settings_at_start


class Ctx:
    """A request with an id and nothing else (vLLM's ReqContext, duck-typed)."""

    req_id = "r"
    kv_hints = None

    def __init__(self) -> None:
        self._state: dict[type, object] = {}

    def get_state(self, cls: type) -> object:
        return self._state.get(cls)

    def set_state(self, value: object) -> None:
        self._state[type(value)] = value

    def get_offload_key_position(self, key: object) -> None:
        return None


class Chunk:
    ref_cnt = 0


def main() -> None:
    for chunks in (1953, 19531):
        path = pathlib.Path(tempfile.mkdtemp()) / "kvbroker.json"
        extra = {"kvbroker_policy": "lru", "kvbroker_settings_file": str(path)}
        settings, _ = settings_at_start(extra, {})
        local = EmbeddedCore(settings, chunks)
        translator = Translator(local)
        live = LiveSettings(settings, extra, local=local, translator=translator, capacity=chunks, environ={})
        ctx = Ctx()
        for n in range(chunks):
            translator.insert(n.to_bytes(8, "big") + bytes(4), Chunk(), ctx)
        translator.apply()
        for policy in ("adaptive", "arc", "history_arc"):
            path.write_text(json.dumps({"kvbroker_policy": policy}))
            t0 = time.perf_counter()
            assert live.check()
            t1 = time.perf_counter()
            live.apply_pending()
            t2 = time.perf_counter()
            assert local.core.policy_name == policy
            record = {"chunks": chunks, "policy": policy, "check_ms": round((t1 - t0) * 1e3, 2), "switch_ms": round((t2 - t1) * 1e3, 2)}
            print(json.dumps(record))


if __name__ == "__main__":
    main()
