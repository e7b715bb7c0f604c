"""What one batch costs the broker's event loop, by the work limits.max_batch_work counts.

In process, on the compiled core (no gRPC, no journal): one client holds N blocks, then
times one ``apply_batch`` of (a) 10,000 ``cleared`` events from another client that holds
none, (b) accesses naming 20,000 block ids, (c) one ``cleared`` of the holder's N blocks.
Every stream waits while one batch applies, so these are the stalls a batch can cause.

    python bench/batch_work.py [--blocks 20000,50000,100000]

Wall-clock figures: noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.config import CoreConfig
from broker.model.apply import apply_batch
from broker.model.core import Core
from kvbroker.v1 import intent_pb2 as pb


def alloc(i: int) -> pb.Event:
    intent = pb.MemoryIntent(block_id=f"b{i}", size_bytes=4096, request_id=f"r{i // 64}")
    return pb.Event(ts_us=1, allocated=pb.BlockAllocated(intent=intent))


def timed(core: Core, batch: pb.IntentBatch) -> float:
    raw = batch.SerializeToString()
    started = time.perf_counter()
    apply_batch(core, raw)
    return time.perf_counter() - started


def run(n: int) -> dict[str, float]:
    core = Core(CoreConfig())
    seq = 0
    for start in range(0, n, 5000):
        seq += 1
        apply_batch(core, pb.IntentBatch(client_id="a", batch_seq=seq, events=[alloc(i) for i in range(start, start + 5000)]))
    clears = [pb.Event(ts_us=2, cleared=pb.AllBlocksCleared())] * 10_000
    t_clears = timed(core, pb.IntentBatch(client_id="z", batch_seq=1, events=clears))
    ids = [[f"b{i}" for i in range(j, j + 100)] for j in range(0, 20_000, 100)]
    accesses = [pb.Event(ts_us=3, accessed=pb.BlocksAccessed(block_ids=chunk)) for chunk in ids]
    t_access = timed(core, pb.IntentBatch(client_id="a", batch_seq=seq + 1, events=accesses))
    t_own = timed(core, pb.IntentBatch(client_id="a", batch_seq=seq + 2, events=[pb.Event(ts_us=4, cleared=pb.AllBlocksCleared())]))
    return {
        "blocks": n,
        "clears_by_other_ms": round(t_clears * 1000, 1),
        "access_20000_ids_ms": round(t_access * 1000, 1),
        "clear_own_ms": round(t_own * 1000, 1),
        "clear_own_us_per_block": round(t_own / n * 1e6, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", default="20000,50000,100000")
    args = parser.parse_args()
    for n in (int(b) for b in args.blocks.split(",")):
        print(json.dumps(run(n)))


if __name__ == "__main__":
    main()
