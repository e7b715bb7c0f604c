#!/usr/bin/env python3
"""What a broker's restart costs as its file journal grows (issue 41, item 14): the time
to rebuild the state from the journal and the peak RSS of the process doing it, and the
same for ``kvbroker replay``'s reading of it. One JSON line per journal size.

Each measurement runs in a fresh process (its peak RSS is its own, ``ru_maxrss``), with the
kvbroker found on ``--root`` (default: this checkout), so two checkouts compare on the same
journals:

    python bench/restart_time.py --batches 5000,20000
    python bench/restart_time.py --batches 5000,20000 --root /work/main --python /work/main/.venv/bin/python
    python bench/restart_time.py --batches 5000,20000 --snapshot-every 2000   # serve's snapshots
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Writes a journal of BATCHES batches of 32 allocations and 32 frees each, with the config
# record a broker writes first; with SNAPSHOT_EVERY > 0, through a broker service on a file
# journal taking snapshots that often (each copy let arrive before the next 100 batches).
WRITE = r"""
import asyncio, sys
from broker.config import core_to_json, parse_config
from broker.journal.records import MAGIC, JournalRecord, RecordKind, encode
from kvbroker.v1 import intent_pb2 as pb
path, batches, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = parse_config(CONFIG)

def batches_of():
    for seq in range(1, batches + 1):
        events = [pb.Event(ts_us=seq * 64 + i, allocated=pb.BlockAllocated(intent=pb.MemoryIntent(
            block_id=f"blk-{seq % 2000}-{i:02d}-{'p' * 40}", size_bytes=1000))) for i in range(32)]
        gone = [f"blk-{(seq - 1) % 2000}-{i:02d}-{'p' * 40}" for i in range(32)]
        events.append(pb.Event(ts_us=seq * 64 + 40, freed=pb.BlocksFreed(block_ids=gone)))
        yield pb.IntentBatch(client_id="c", batch_seq=seq, events=events).SerializeToString()

async def through_serve():
    from broker.journal.file import FileJournal
    from broker.model.wire import read_batch
    from broker.service.broker_service import BrokerService
    text = CONFIG.replace('url = "none"', f'url = "file://{path}"\nsnapshot_batches = {every}')
    journal = FileJournal(path)
    await journal.start()
    service = BrokerService(parse_config(text), journal)
    for i, raw in enumerate(batches_of()):
        service.submit(read_batch(raw), raw)
        if service.snapshots.copy is not None and i % every == 100:
            service.snapshots.copy.wait(600)
        if i % 500 == 0:
            await asyncio.sleep(0)
    await journal.close()

if every:
    asyncio.run(through_serve())
else:
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(encode(JournalRecord(RecordKind.CONFIG, 1, 1, core_to_json(config.core).encode())))
        for raw in batches_of():
            f.write(encode(JournalRecord(RecordKind.BATCH, 1, 1, raw)))
"""

# Rebuilds the state as `serve` does at start (its recovery), then reads the journal as
# replay does; prints seconds and peak RSS of each.
MEASURE = r"""
import json, resource, sys, time
from broker.config import parse_config
from broker.journal import JournalSource
from broker.journal.base import NullJournal
from broker.service.broker_service import BrokerService
path, what = sys.argv[1], sys.argv[2]
t = time.perf_counter()
if what == "recover":
    source = JournalSource(path)
    records = source.recovery() if hasattr(source, "recovery") else source.ordered()  # what serve reads
    service = BrokerService(parse_config(CONFIG), NullJournal(512), records)
    n = service.recovered_batches
else:
    n = sum(1 for _ in JournalSource(path).batches())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"s": round(time.perf_counter() - t, 2), "peak_rss_mib": round(peak, 1), "batches": n}))
"""

CONFIG = '[journal]\nurl = "none"\n[[tiers]]\nname = "hbm"\ncapacity = 100000000\n[[tiers]]\nname = "dram"\ncapacity = 1000000000\n'


def run(python: str, root: str, code: str, *args: str) -> str:
    prelude = f"import sys; sys.path.insert(0, {root!r}); CONFIG = {CONFIG!r}\n"
    out = subprocess.run([python, "-c", prelude + code, *args], capture_output=True, text=True, check=True, cwd=root)
    return out.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="5000,20000", help="journal sizes, in batches, comma-separated")
    parser.add_argument("--root", default=str(ROOT), help="the kvbroker checkout to measure")
    parser.add_argument("--python", default=sys.executable, help="its interpreter (its venv's, for its compiled modules)")
    parser.add_argument("--snapshot-every", type=int, default=0, help="write the journal through serve, a snapshot every N batches")
    args = parser.parse_args()
    for batches in (int(b) for b in args.batches.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            path = str(pathlib.Path(tmp) / "j.journal")
            run(sys.executable, str(ROOT), WRITE, path, str(batches), str(args.snapshot_every))
            size = pathlib.Path(path).stat().st_size
            recover = json.loads(run(args.python, args.root, MEASURE, path, "recover"))
            read = json.loads(run(args.python, args.root, MEASURE, path, "read"))
            mib = round(size / 2**20, 1)
            record = {"batches": batches, "snapshot_every": args.snapshot_every, "journal_mib": mib, "recover": recover, "read": read}
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
