#!/usr/bin/env python3
"""The pause a live switch (``kvbroker_settings_file``, vllm_integration/decisions_to_vllm/reload.py) costs:
reading and validating the file (the watcher's thread), then switching the embedded core
(vLLM's scheduler thread: the new policy warmed from a full CPU tier). One JSON line each.

    python bench/reload_pause.py                       # 1,953 and 19,531 chunks

``--serve BLOCKS``: the pause a reload that adds a shadow costs ``kvbroker serve`` (issue 41,
item 13): a broker service holding BLOCKS blocks, one batch submitted per event-loop
iteration, and a reload adding two shadows (arc, s3fifo); per way of copying, the reload
call's time, the longest gap between two batches served until the shadows report, and the
batches served meanwhile. ``sync`` is the copy on the loop (as before), ``forked`` the copy
off it (broker.service.shadow_builds), ``none`` the same batches without a reload (the
baseline: the loop's own longest gap, the garbage collector's).

    python bench/reload_pause.py --serve 50000
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


SERVE_TIERS = """
[journal]
url = "none"
[[tiers]]
name = "hbm"
capacity = 1000000000000
[[tiers]]
name = "dram"
capacity = 100000000000
"""


def serve_config(shadows: str) -> str:
    return f'[policy]\nname = "lru"\nshadows = [{shadows}]\n{SERVE_TIERS}'


def serve_run(blocks: int, way: str, batches: int) -> dict[str, object]:
    """One broker service holding ``blocks`` blocks; a reload adding two shadows copied
    ``way`` ("none": no reload, ``batches`` batches served)."""
    import asyncio
    import gc

    from broker.config import parse_config
    from broker.journal.base import NullJournal
    from broker.model.wire import read_batch
    from broker.service import shadow_builds
    from broker.service.broker_service import BrokerService
    from kvbroker.v1 import intent_pb2 as pb

    service = BrokerService(parse_config(serve_config("")), NullJournal(512))
    seq = 0

    def batch(events: list[pb.Event]) -> None:
        nonlocal seq
        seq += 1
        raw = pb.IntentBatch(client_id="c", batch_seq=seq, events=events).SerializeToString()
        service.submit(read_batch(raw), raw)

    def allocated(i: int) -> pb.Event:
        return pb.Event(ts_us=i, allocated=pb.BlockAllocated(intent=pb.MemoryIntent(block_id=f"b{i}", size_bytes=1000)))

    for start in range(0, blocks, 500):
        batch([allocated(i) for i in range(start, min(blocks, start + 500))])
    gc.collect()
    gc.freeze()  # as serve does with its startup heap; the blocks are untracked anyway
    forking = shadow_builds.forking_available
    if way == "sync":
        shadow_builds.forking_available = lambda: False

    async def run() -> dict[str, object]:
        t0 = time.perf_counter()
        if way != "none":
            assert service.reload(serve_config('"arc", "s3fifo"')).ok
        t1 = time.perf_counter()
        served, gap, last, n = 0, t1 - t0, t1, blocks
        while service.shadow_builds or (way == "none" and served < batches):
            batch([pb.Event(ts_us=10**9 + n, accessed=pb.BlocksAccessed(block_ids=[f"b{n % blocks}"])), allocated(n)])
            n += 1
            served += 1
            await asyncio.sleep(0)
            now = time.perf_counter()
            gap, last = max(gap, now - last), now
        call_ms, gap_ms = round((t1 - t0) * 1e3, 1), round(gap * 1e3, 1)
        return {"blocks": blocks, "copy": way, "reload_call_ms": call_ms, "longest_gap_ms": gap_ms, "served": served}

    try:
        return asyncio.run(run())
    finally:
        shadow_builds.forking_available = forking
        gc.unfreeze()


def serve_pause(blocks: int) -> None:
    forked = serve_run(blocks, "forked", 0)
    print(json.dumps(forked), flush=True)
    print(json.dumps(serve_run(blocks, "sync", 0)), flush=True)
    # The baseline: as many batches as the forked copy served, without a reload.
    print(json.dumps(serve_run(blocks, "none", int(str(forked["served"])))), flush=True)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        serve_pause(int(sys.argv[2]))
        return
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
