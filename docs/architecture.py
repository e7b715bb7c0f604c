"""Draws docs/architecture.png, the README's picture of how kvbroker's parts fit.

    python docs/architecture.py            # writes docs/architecture.png
    python docs/architecture.py OUT.png    # writes elsewhere (tests/test_readme.py does)

The picture is made from this file only (matplotlib, a dev dependency), so it changes with
the code in review, not in an image editor.
"""

from __future__ import annotations

import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

# (x, y, width, height, title, lines, colour): the boxes, in data units of a 16 x 9 canvas.
BOXES = [
    (0.3, 6.8, 3.6, 1.9, "vLLM", ["or any engine: scheduler,", "KV cache, CPU offload tier"], "#dbe9f6"),
    (1.0, 3.9, 2.9, 2.0, "events_from_vllm/", ["vLLM \u2192 kvbroker: the", "vllm-bridge, hooks;", "clients/ for any engine"], "#dbe9f6"),
    (
        0.3,
        0.9,
        3.6,
        2.3,
        "decisions_to_vllm/",
        ["kvbroker \u2192 vLLM: the", "CachePolicy in its CPU", "tier; shadows, what-if"],
        "#dbe9f6",
    ),
    (5.4, 5.5, 4.2, 3.0, "broker/service", ["gRPC on uvloop: decode,", "validate, tenants, limits,", "health, metrics"], "#fde9c9"),
    (
        5.4,
        1.3,
        4.2,
        3.0,
        "broker/model",
        ["residency across tiers,", "the policy (policies/),", "directives: pure, deterministic"],
        "#fde9c9",
    ),
    (11.2, 5.5, 4.4, 3.0, "broker/journal", ["every accepted batch,", "in apply order: a file", "or Redis streams"], "#e3f1dc"),
    (
        11.2,
        0.5,
        4.4,
        3.5,
        "kvbroker replay",
        ["journals or real traces", "through N policies and", "the same core: tables,", "JSON, plots, --verify"],
        "#e3f1dc",
    ),
]

# (start, end, label, label position, dashed): the arrows, by their end points.
ARROWS = [
    ((2.6, 6.8), (2.6, 5.9), "KV events, intent", (2.75, 6.35), False),
    ((0.65, 6.8), (0.65, 3.2), "evict(n)", (1.05, 3.35), False),
    ((3.9, 5.5), (5.4, 6.6), "IntentBatch", (4.55, 6.35), False),
    ((5.4, 6.0), (3.9, 4.9), "DirectiveBatch", (4.7, 4.95), False),
    ((7.0, 5.5), (7.0, 4.3), "apply", (6.65, 4.85), False),
    ((8.2, 4.3), (8.2, 5.5), "directives", (8.85, 4.85), False),
    ((3.9, 2.1), (5.4, 2.6), "embedded core", (4.65, 1.7), False),
    ((3.9, 0.75), (11.2, 0.75), "its own journal: --verify, the same traffic through other policies", (7.55, 0.8), False),
    ((9.6, 7.0), (11.2, 7.0), "batches", (10.4, 7.15), False),
    ((13.4, 5.5), (13.4, 4.0), "read", (13.75, 4.7), False),
    ((9.6, 2.8), (11.2, 2.8), "same core", (10.4, 2.95), True),
]


def draw(out: pathlib.Path) -> None:
    fig, ax = plt.subplots(figsize=(16, 9), dpi=80)
    ax.set_xlim(0, 16)
    ax.set_ylim(0, 9)
    ax.axis("off")
    for x, y, w, h, title, lines, colour in BOXES:
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05,rounding_size=0.15", fc=colour, ec="#333333", lw=1.5))
        ax.text(x + w / 2, y + h - 0.45, title, ha="center", va="center", fontsize=15, weight="bold")
        for i, line in enumerate(lines):
            ax.text(x + w / 2, y + h - 1.0 - 0.42 * i, line, ha="center", va="center", fontsize=12)
    for start, end, label, (lx, ly), dashed in ARROWS:
        style = "--" if dashed else "-"
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=18, lw=1.6, color="#333333", linestyle=style))
        ax.text(lx, ly, label, ha="center", va="bottom", fontsize=11, color="#1f4e79", style="italic")
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    draw(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else pathlib.Path(__file__).with_name("architecture.png"))
