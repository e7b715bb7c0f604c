"""PNG plots of replay records: hit rate against cache size per policy, the latency CDF,
and bytes moved. matplotlib is imported here only, when --plot asks for it."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any


def _top_capacity(rec: dict[str, Any]) -> tuple[str, float]:
    name = next(iter(rec["capacity_bytes"]))
    tokens = rec.get("capacity_tokens")
    if tokens:
        return "cache size (tokens)", float(tokens[name])
    return "cache size (GiB)", rec["capacity_bytes"][name] / 2**30


def write_plots(records: list[dict[str, Any]], directory: str, title: str = "") -> list[str]:
    """Write hit_rate.png, latency_cdf.png and bytes_moved.png; returns their paths."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'kvbroker[plot]'") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    metric = "prefix_hit_rate" if any(r["prompt_blocks"] for r in records) else "hit_rate"

    by_policy: dict[str, list[tuple[float, float]]] = defaultdict(list)
    label = "cache size"
    for rec in records:
        label, x = _top_capacity(rec)
        by_policy[rec["policy"]].append((x, rec[metric]))
    fig, ax = plt.subplots(figsize=(8, 5))
    for policy, points in sorted(by_policy.items()):
        points.sort()
        style = "--" if policy == "belady" else "-"
        ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=policy)
    ax.set_xlabel(label)
    ax.set_ylabel(metric.replace("_", " "))
    ax.set_title(title or f"{metric.replace('_', ' ')} by cache size")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    paths.append(_save(fig, directory, "hit_rate.png"))

    largest = max((_top_capacity(r)[1] for r in records), default=0)
    fig, ax = plt.subplots(figsize=(8, 5))
    for rec in sorted(records, key=lambda r: r["policy"]):
        if _top_capacity(rec)[1] != largest or not rec.get("latency_hist"):
            continue
        hist = sorted((int(k), v) for k, v in rec["latency_hist"].items())
        total = sum(v for _, v in hist)
        xs, ys, seen = [], [], 0
        for value, count in hist:
            seen += count
            xs.append(max(value, 1))
            ys.append(seen / total)
        ax.step(xs, ys, where="post", label=rec["policy"])
    ax.set_xscale("log")
    ax.set_xlabel("simulated access latency (µs, log; 0 shown at 1)")
    ax.set_ylabel("fraction of accesses")
    ax.set_title("latency CDF at the largest cache size")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    paths.append(_save(fig, directory, "latency_cdf.png"))

    fig, ax = plt.subplots(figsize=(8, 5))
    biggest = [r for r in records if _top_capacity(r)[1] == largest]
    names = [r["policy"] for r in biggest]
    ax.barh(names, [r["bytes_up"] / 2**30 for r in biggest], label="up (reloads, prefetches)")
    ax.barh(names, [r["bytes_down"] / 2**30 for r in biggest], left=[r["bytes_up"] / 2**30 for r in biggest], label="down (demotions)")
    ax.set_xlabel("GiB moved")
    ax.set_title("bytes moved at the largest cache size")
    ax.legend()
    paths.append(_save(fig, directory, "bytes_moved.png"))
    return paths


def _save(fig: Any, directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
