#!/usr/bin/env python3
"""RSS per tracked block of the broker's core at 100k and 1M blocks.

Each block count runs in a fresh process: the core is built with the policy, N blocks are
allocated through the broker's own path (apply_batch), and the RSS added is divided by N
(broker/bench/memory.py has the method). The issue's target: at most 300 bytes per block at
1M blocks.

    python bench/memory.py                           # 100k and 1M, deadline_edf
    python bench/memory.py --blocks 100000 --policy lru --json
    python bench/memory.py --blocks 1000000 --breakdown     # where the bytes are, by owner and type
    kvbroker bench --memory                          # the same, after the throughput bench
"""

from __future__ import annotations

import sys

from broker.bench.memory import main

if __name__ == "__main__":
    sys.exit(main())
