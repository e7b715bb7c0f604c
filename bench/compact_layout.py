#!/usr/bin/env python3
"""What a struct-of-arrays core would hold per block: the layout issue 24 proposes, measured.

Not the broker: a model of its per-block state in the proposed representation, filled with
the memory bench's ids (``broker/bench/memory.py``: engine-like ids, 16 blocks a request),
in a fresh process, RSS after over RSS before, per block:

- the id table: the client's block id (a str, as received) -> an integer handle (a dict);
- one typed array per field the core keeps (``array('q')`` for times, sizes, counters and
  string-table indexes, ``array('b')``/``array('i')`` for enums, flags and the tier), the
  handle indexing them all; request and tenant ids interned once in a string table;
- an LRU as an intrusive doubly linked list over the handles (two ``array('i')``).

Set against the current core's figure (``python bench/memory.py --blocks 1000000 --policy
lru``), this says what the representation change would save, and whether 300 bytes a block
is within reach, before any of it is written.

    python bench/compact_layout.py                    # 1M blocks
    python bench/compact_layout.py --tight            # 8-byte times only, narrower counters
    python bench/compact_layout.py --ids-only         # the id table and the ids alone
    python bench/compact_layout.py --blocks 100000 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.bench.memory import rss

BLOCKS_PER_REQUEST = 16
# The Block fields a core keeps per block (policies/base.py), by width in this layout.
WIDE = (
    "size",
    "created_us",
    "last_access_us",
    "ready_us",
    "deadline_us",
    "due_us",
    "slack_us",
    "recompute_cost_us",
    "reuse_window",
    "token_start",
    "accesses",
    "reuses",
    "heap_version",
    "parent",  # handle of the parent block
    "request",  # index into the string table
    "owner",  # index into the string table
)
NARROW = ("tier", "priority", "phase", "flags", "refs", "children", "request_priority", "token_count", "allowed_mask", "tenant")
# --tight: only event times stay 8 bytes; counters, handles and indexes are 4; enums and
# flags 1 (what the core's fields need, the wire's ranges permitting).
TIGHT_WIDE = ("created_us", "last_access_us", "ready_us", "deadline_us", "due_us", "slack_us")
TIGHT_MID = ("size", "recompute_cost_us", "reuse_window", "token_start", "accesses", "reuses", "heap_version", "parent", "request", "owner")
TIGHT_MID += ("refs", "children", "token_count", "allowed_mask")
TIGHT_BYTE = ("tier", "priority", "phase", "flags", "request_priority", "tenant")


def child(blocks: int, tight: bool = False, ids_only: bool = False) -> dict[str, Any]:
    gc.collect()
    before = rss()
    ids: dict[str, int] = {}
    strings: dict[str, int] = {}
    if tight:
        wide = {name: array("q") for name in TIGHT_WIDE} | {name: array("i") for name in TIGHT_MID}
        narrow = {name: array("b") for name in TIGHT_BYTE}
    else:
        wide = {name: array("q") for name in WIDE}
        narrow = {name: array("i") for name in NARROW}
    if ids_only:
        wide, narrow = {}, {}
    prev, nxt = array("i"), array("i")
    tail = -1
    for i in range(blocks):
        request, k = divmod(i, BLOCKS_PER_REQUEST)
        rid = f"~{request:014x}~c0/r{request}"
        handle = len(ids)
        ids[f"{rid}/b{k}"] = handle
        r = strings.setdefault(rid, len(strings))
        for name, column in wide.items():
            column.append(r if name == "request" else i if column.typecode == "q" else i & 0x7FFFFFFF)
        for column in narrow.values():
            column.append(1)
        if ids_only:
            continue
        prev.append(tail)
        nxt.append(-1)
        if tail >= 0:
            nxt[tail] = handle
        tail = handle
    gc.collect()
    after = rss()
    columns = [] if ids_only else [*wide.values(), *narrow.values(), prev, nxt]
    return {
        "kind": "compact_layout",
        "blocks": blocks,
        "tight": tight,
        "ids_only": ids_only,
        "rss_bytes_per_block": round((after - before) / blocks, 1),
        "columns": len(columns),
        "array_bytes_per_block": sum(c.itemsize for c in columns),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--tight", action="store_true", help="8-byte times only; 4-byte counters and handles, 1-byte enums and flags")
    ap.add_argument("--ids-only", action="store_true", help="the id table and the ids alone, no columns")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.blocks, args.tight, args.ids_only)))
        return 0
    argv_child = (
        [sys.executable, __file__, "--child", "--blocks", str(args.blocks)]
        + (["--tight"] if args.tight else [])
        + (["--ids-only"] if args.ids_only else [])
    )
    done = subprocess.run(argv_child, capture_output=True, text=True, check=True)
    record = json.loads(done.stdout)
    if args.json:
        print(json.dumps(record))
    else:
        print(
            f"{record['blocks']:,} blocks: {record['rss_bytes_per_block']:.1f} bytes of RSS per block in the struct-of-arrays layout "
            f"({record['columns']} columns, an LRU's two links among them: {record['array_bytes_per_block']} bytes of arrays a block; "
            "the rest is the id table, the ids and the arrays' spare room)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
