"""PNG plots of replay records: what the table says, drawn.

``charts(records)`` computes each chart's data from the records, the same fields the table
prints (hit rate by cache size, prefix hit rate by cache size, the latency CDF and the bytes
moved at the largest size), and leaves out a chart with nothing to show (no prompt blocks
hit, no latency, no bytes moved); ``write_plots`` only draws them. matplotlib is imported
here only, when --plot asks for it.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from typing import Any

from broker.extras import install_hint


@dataclasses.dataclass
class Chart:
    """One PNG: its file, titles, and per series label the points drawn, in order."""

    name: str
    title: str
    xlabel: str
    ylabel: str
    kind: str  # "lines" (x, y), "cdf" (x, fraction) steps, "bars" (label -> (up, down))
    series: dict[str, list[tuple[float, float]]]


def _top_capacity(rec: dict[str, Any]) -> tuple[str, float]:
    name = next(iter(rec["capacity_bytes"]))
    tokens = rec.get("capacity_tokens")
    if tokens:
        return "cache size (tokens)", float(tokens[name])
    return "cache size (GiB)", rec["capacity_bytes"][name] / 2**30


def _swept(records: list[dict[str, Any]]) -> set[str]:
    """The policies whose parameters vary between records (--param)."""
    seen: dict[str, set[str]] = defaultdict(set)
    for rec in records:
        seen[rec["policy"]].add(str(rec.get("params")))
    return {policy for policy, params in seen.items() if len(params) > 1}


def _label(rec: dict[str, Any], swept: set[str]) -> str:
    """The series a record belongs to: its policy, its parameters when a sweep varies them,
    and whether the intent was stripped (as the table's policy column)."""
    label = rec["policy"]
    if rec["policy"] in swept and rec.get("params"):
        label += "(" + ", ".join(f"{k}={v}" for k, v in rec["params"].items()) + ")"
    return label + (" -intent" if rec.get("intent") == "stripped" else "")


def charts(records: list[dict[str, Any]], title: str = "") -> list[Chart]:
    """The charts worth drawing, with their data taken from the records' table fields."""
    if any(r.get("source") == "fleet" for r in records):
        records = [r for r in records if r.get("source") == "fleet"]  # a fleet: its total rows
    if not records:
        return []
    swept = _swept(records)
    xlabel = _top_capacity(records[0])[0]
    out = []
    for field, name, what, show in (
        ("hit_rate", "hit_rate.png", "hit rate", any(r["accesses"] for r in records)),
        ("prefix_hit_rate", "prefix_hit_rate.png", "prefix hit rate", any(r["prompt_blocks"] and r["prefix_hits"] for r in records)),
    ):
        if not show:
            continue
        series: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for rec in records:
            series[_label(rec, swept)].append((_top_capacity(rec)[1], float(rec[field])))
        heading = f"{what} by cache size" + (f" ({title})" if title else "")
        out.append(Chart(name, heading, xlabel, what, "lines", {k: sorted(v) for k, v in sorted(series.items())}))

    largest = max(_top_capacity(r)[1] for r in records)
    biggest = sorted((r for r in records if _top_capacity(r)[1] == largest), key=lambda r: _label(r, swept))
    cdf: dict[str, list[tuple[float, float]]] = {}
    for rec in biggest:
        hist = sorted((int(k), v) for k, v in (rec.get("latency_hist") or {}).items())
        total = sum(v for _, v in hist)
        if not total:
            continue
        points, seen = [], 0
        for value, count in hist:
            seen += count
            points.append((float(max(value, 1)), seen / total))
        cdf[_label(rec, swept)] = points
    if cdf:
        out.append(
            Chart(
                "latency_cdf.png",
                "latency CDF at the largest cache size",
                "simulated access latency (µs, log; 0 shown at 1)",
                "fraction of accesses",
                "cdf",
                cdf,
            )
        )
    if any(r["bytes_up"] or r["bytes_down"] for r in biggest):
        moved = {_label(r, swept): [(r["bytes_up"] / 2**30, r["bytes_down"] / 2**30)] for r in biggest}
        out.append(Chart("bytes_moved.png", "bytes moved at the largest cache size", "GiB moved", "", "bars", moved))
    return out


def write_plots(records: list[dict[str, Any]], directory: str, title: str = "") -> list[str]:
    """Write the charts of ``charts(records)`` as PNGs into ``directory``; returns their paths."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError(f"--plot needs matplotlib: {install_hint('plot')}") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not os.path.isdir(directory):
        os.mkdir(directory)  # DIR itself only: its parent was checked to exist (cli.checks)
    paths = []
    for chart in charts(records, title):
        fig, ax = plt.subplots(figsize=(8, 5))
        if chart.kind == "lines":
            for label, points in chart.series.items():
                style = "--" if label.startswith("belady") else "-"
                ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=label)
        elif chart.kind == "cdf":
            for label, points in chart.series.items():
                ax.step([p[0] for p in points], [p[1] for p in points], where="post", label=label)
            ax.set_xscale("log")
        else:
            names = list(chart.series)
            up = [chart.series[n][0][0] for n in names]
            down = [chart.series[n][0][1] for n in names]
            ax.barh(names, up, label="up (reloads, prefetches)")
            ax.barh(names, down, left=up, label="down (demotions)")
        ax.set_xlabel(chart.xlabel)
        if chart.ylabel:
            ax.set_ylabel(chart.ylabel)
        ax.set_title(chart.title)
        if chart.kind != "bars":
            ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        paths.append(_save(fig, directory, chart.name))
    return paths


def _save(fig: Any, directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
