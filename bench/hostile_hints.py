"""What hostile KV hints cost vLLM's CPU-offload cache with kvbroker's adapter (issue 33,
items 2 and 4), through vLLM's real CPUOffloadingManager. Needs vLLM::

    python bench/hostile_hints.py

1. Deadlines past int64: a stream of concurrent requests (tests/vllm_integration/decisions_to_vllm/manager_driver.py,
   token positions, 64 chunks), 1 request in 20 hinted ``deadline_ms`` 1e16 (and "hot"), run
   by vLLM's own LRU and by the adapter's lru: the stores each refuses, the chunks vLLM holds
   at the end and how many of them the adapter's core holds, the hints it ignored.
2. A 1 MiB tenant: 4 requests of 256 chunks each, every one hinted with a tenant of 1 MiB,
   with a file journal: the process's resident memory before and after
   (``/proc/self/statm``), the time, and the journal's size.
"""

from __future__ import annotations

import pathlib
import random
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext  # noqa: E402

from tests.vllm_integration.decisions_to_vllm.manager_driver import key, kvbroker_manager, random_stream, vllm_manager  # noqa: E402


def envelope(payload: dict[str, Any]) -> KvHintsEnvelope:
    return KvHintsEnvelope("1", "m", [KvHintAction("a", "kvbroker.intent", "1", payload)])


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * 4096 / 2**20


def deadlines() -> None:
    def hints(rng: random.Random) -> Any:
        return envelope({"deadline_ms": 1e16, "priority": "hot"}) if rng.random() < 0.05 else None

    stream: dict[str, Any] = {"positions": True, "docs": 20, "concurrency": 8, "hints": hints}
    out = {}
    for name, manager in (("vLLM lru", vllm_manager("lru", 64)), ("kvbroker lru", kvbroker_manager("lru", 64))):
        trace = random_stream(manager, 7, 6000, **stream)
        stores = [x for x in trace if x[0] == "store"]
        refused = sum(1 for x in stores if x[2] is None)
        held = manager._num_allocated_chunks - len(manager._free_list)
        out[name] = (len(stores), refused, held, manager)
    for name, (stores, refused, held, manager) in out.items():
        line = f"{name:>13}: {refused} of {stores} stores refused, vLLM holds {held} chunks"
        policy = manager._policy
        if hasattr(policy, "translator"):
            policy.translator.apply()
            core = {b.block_id for b in policy.local.core.blocks.values() if b.tier == 0}
            mine = sum(1 for k in policy.translator.entries if k.hex() in core)
            line += f", the core holds {mine} of them; hints ignored {sum(policy.translator.stats.hints_ignored.values())}"
        print(line)


def big_tenant() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "big.journal"
        manager = kvbroker_manager("lru", 1024, journal=f"file://{path}")
        tenant = "t" * (1 << 20)
        before = rss_mib()
        started = time.perf_counter()
        for r in range(4):
            ctx = ReqContext(req_id=f"big{r}", kv_hints=envelope({"tenant": tenant, "priority": "hot"}))
            manager.on_new_request(ctx)
            keys = [key(r * 1000 + i) for i in range(256)]
            out = manager.prepare_store(keys, ctx)
            assert out is not None
            manager.complete_store(keys, ctx)
            manager.on_request_finished(ctx)
        manager._policy.close()
        took = time.perf_counter() - started
        size = path.stat().st_size / 2**20
        print(f"1 MiB tenant, 4 x 256 chunks: RSS {before:.0f} -> {rss_mib():.0f} MiB, {took:.2f} s, journal {size:.2f} MiB")


if __name__ == "__main__":
    deadlines()
    big_tenant()
