#!/usr/bin/env python3
"""The kv_deadline_scheduler table: the original simulator's figures beside kvbroker's.

For each trace, HBM size and policy: decode-critical misses per decode-critical access as
the original's simulator reported them (``kvmi simulate``; tests/data/kvds/README.md), as
kvbroker's kvds compatibility replay gives them (broker/replay/kvds_compat.py: the seed's
labels, merge rules and cost model around kvbroker's ports), and as kvbroker's own replay
gives them (``--format kvds-events`` on KVDS_TIERS_TOML with the HBM size changed: our
importer and cost model), with the prefetches that replay made and the bytes it moved up.

    python bench/kvds_compare.py                               # the bundled deadline_pressure trace
    python bench/kvds_compare.py --trace rag_mixed_priority.jsonl --trace long_context_extreme.jsonl --hbm 128
    python bench/kvds_compare.py --trace other.jsonl --hbm 128,256 --policies deadline_aware,deadline_edf
    python bench/kvds_compare.py --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from broker.config import parse_config  # noqa: E402
from broker.replay.kvds_compat import MIB, replay_compat  # noqa: E402
from broker.replay.replay import replay  # noqa: E402
from broker.replay.traces import TraceOptions, read_trace  # noqa: E402
from broker.replay.traces.kvds import KVDS_TIERS_TOML  # noqa: E402

TRACE = ROOT / "tests" / "data" / "kvds" / "deadline_pressure.jsonl"
# The original's figures on its deadline_pressure trace (misses of 96 decode-critical
# reads; kvmi simulate --hbm-mb H --dram-mb 4096), by our name of the ported policy.
ORIGINAL = {
    "deadline_pressure": {
        128: {"lru": 96, "hotcold": 96, "predictive_hotness": 96, "intent_aware": 6, "deadline_aware": 6},
        512: {"lru": 96, "hotcold": 96, "predictive_hotness": 0, "intent_aware": 0, "deadline_aware": 0},
    },
    # The held-out traces of the same generator (same flags, profiles rag_mixed_priority and
    # long_context_extreme; not in the repository): DeadlineAware's figures from issue 22.
    "rag_mixed_priority": {128: {"deadline_aware": 8}},
    "long_context_extreme": {128: {"deadline_aware": 6}},
}
POLICIES = ["lru", "hotcold", "predictive_hotness", "intent_aware", "deadline_aware", "priority_lru", "deadline_edf"]


def kvbroker_replay(batches: list[Any], policy: str, hbm_mib: int) -> dict[str, Any]:
    toml = KVDS_TIERS_TOML.replace('capacity = "128MiB"', f'capacity = "{hbm_mib}MiB"')
    return replay(lambda: ((1, b) for b in batches), parse_config(toml).core, policy).metrics


def rows(trace: Path, hbm: list[int], policies: list[str]) -> list[dict[str, Any]]:
    batches = list(read_trace(str(trace), "kvds-events", TraceOptions()))
    original = ORIGINAL.get(trace.stem, {})
    out = []
    for size in hbm:
        for policy in policies:
            compat = replay_compat(str(trace), policy, size * MIB)
            ours = kvbroker_replay(batches, policy, size)
            out.append(
                {
                    "trace": trace.stem,
                    "hbm_mib": size,
                    "policy": policy,
                    "original_dc_misses": original.get(size, {}).get(policy),
                    "dc_accesses": compat.dc_accesses,
                    "compat_dc_misses": compat.dc_misses,
                    "compat_prefetches": compat.prefetches,
                    "replay_dc_misses": ours["dc_misses"],
                    "replay_dc_accesses": ours["dc_accesses"],
                    "replay_prefetches": ours["prefetches"],
                    "replay_bytes_up_mib": ours["bytes_up"] / MIB,
                }
            )
    return out


def table(records: list[dict[str, Any]]) -> str:
    head = ["trace", "HBM", "policy", "original", "compat", "kvbroker replay", "prefetches", "MiB up"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        n = r["dc_accesses"]
        orig = "-" if r["original_dc_misses"] is None else f"{r['original_dc_misses']}/{n}"
        lines.append(
            f"| {r['trace']} | {r['hbm_mib']} MiB | {r['policy']} | {orig} | {r['compat_dc_misses']}/{n} | "
            f"{r['replay_dc_misses']}/{r['replay_dc_accesses']} ({r['replay_dc_misses'] / max(r['replay_dc_accesses'], 1):.3f}) | "
            f"{r['replay_prefetches']} | {r['replay_bytes_up_mib']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--trace",
        type=Path,
        action="append",
        help="a kvds-events trace, repeatable (default: the bundled deadline_pressure); "
        "the original's figures are shown for a file named after its profile",
    )
    ap.add_argument("--hbm", default="128,512", help="HBM sizes in MiB, comma-separated")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    hbm = [int(x) for x in args.hbm.split(",")]
    records = [r for trace in args.trace or [TRACE] for r in rows(trace, hbm, args.policies.split(","))]
    print(json.dumps(records, indent=2) if args.json else table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
