#!/usr/bin/env python3
"""Per-policy instructions per operation at 10k and 1M resident blocks (valgrind).

``bench/policy_ops.py`` times the same operation mix; its 1M/10k time ratio also measures
the machine's caches: at 10k blocks a policy's structures fit in cache, at 1M every touched
block is a cache miss, and how much that costs differs from one machine (and day) to the
next. Instructions do not: this counts them with ``valgrind --tool=callgrind``, which gives
the same count for the same binary and input whatever else the machine does. Each (policy,
size) runs twice, with two operation counts and the same fill, and the difference over the
extra operations is the cost of one operation, fill and start-up excluded. A ratio near 1
means no operation walks the resident blocks; the time ratio is then cache misses.

    python bench/policy_instructions.py --policies lru,deadline_edf   # about 6 min a policy
    python bench/policy_instructions.py --sizes 10000,100000 --json
    python bench/policy_instructions.py --quick --policies lru     # 1k and 3k blocks: the output, not the figure

Prints the issue 24 target line per policy (at most 1.5x from 10k to 1M); exits 1 when a
policy grows more than 3x (no operation may walk the resident blocks).

Needs valgrind (Debian: ``apt-get install valgrind``). Slow: every instruction of a
million-block fill is simulated, twice.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

from broker.bench.targets import INSTRUCTION_RATIO, instruction_lines, render
from policies import registry

HERE = os.path.dirname(os.path.abspath(__file__))
REFS = re.compile(r"I\s+refs:\s+([\d,]+)")
# policy_ops.run(policy, resident, ops), in a fresh interpreter (stdout and stderr go to the parent).
CHILD = "import sys; sys.path.insert(0, {here!r}); from policy_ops import run; run({policy!r}, {resident}, {ops})"


def instructions(policy: str, resident: int, ops: int) -> int:
    """Instructions of one whole run (start-up, fill and ``ops`` operations)."""
    code = CHILD.format(here=HERE, policy=policy, resident=resident, ops=ops)
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
    )
    found = REFS.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{policy} at {resident:,} blocks: valgrind failed: {done.stderr.strip()[-1000:]}")
    return int(found.group(1).replace(",", ""))


def per_op(policy: str, resident: int, low: int, high: int) -> float:
    return (instructions(policy, resident, high) - instructions(policy, resident, low)) / (high - low)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,1000000")
    parser.add_argument("--ops", default="20000,120000", help="the two operation counts whose difference is measured")
    parser.add_argument("--policies", default="")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="sizes 1000,3000 and ops 200,400: checks the output, not the figure")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.ops = "1000,3000", "200,400"
    if shutil.which("valgrind") is None:
        print("policy_instructions: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    low, high = (int(n) for n in args.ops.split(","))
    if not 0 < low < high:
        print(f"policy_instructions: --ops: need two counts, the first smaller, got {args.ops!r}", file=sys.stderr)
        return 2
    names = [p for p in args.policies.split(",") if p] or registry.names()
    failed = []
    rows = []
    for name in names:
        row = [per_op(name, n, low, high) for n in sizes]
        ratio = row[-1] / row[0]
        if ratio > 3.0:
            failed.append(name)
        rows.append({"policy": name, "sizes": sizes, "instructions_per_op": [round(x) for x in row], "ratio": round(ratio, 3)})
        if args.json:
            print(json.dumps(rows[-1]), flush=True)
        else:
            cells = "  ".join(f"{n:>9,}: {x:>8,.0f} instructions/op" for n, x in zip(sizes, row, strict=True))
            verdict = "ok" if ratio <= INSTRUCTION_RATIO else ("over 1.5x" if ratio <= 3.0 else "OVER 3x")
            print(f"{name:<20} {cells}  ratio {ratio:4.2f} {verdict}", flush=True)
    if not args.json:
        print()
        print(render("instructions per operation, largest size over smallest", instruction_lines(rows, names), quick=args.quick))
    if failed:
        print(f"instructions per operation grew more than 3x for: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
