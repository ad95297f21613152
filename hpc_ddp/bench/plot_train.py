"""The PNG of a training benchmark: throughput against the baseline, and where a step goes.

Left: samples/s of every contender relative to the hand-written loop (1.0 = as fast), grouped
by model and world size, with the targets as lines. Right: each contender's step split into
data wait, forward+backward, communication wait, optimizer and the rest, in ms per step,
one panel row per model. matplotlib is optional: without it the benchmark still prints its
table and writes its JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_ddp.bench.plot import NO_MATPLOTLIB, pyplot
from hpc_ddp.trainer.loop_timing import PHASES

LABELS = {"data": "data wait", "compute": "forward+backward", "comm": "communication wait",
          "optimizer": "optimizer", "other": "other"}
COLOURS = {"data": "#9ecae1", "compute": "#3182bd", "comm": "#fd8d3c", "optimizer": "#74c476",
           "other": "#bdbdbd"}


def plot(result: dict[str, Any], path: Path) -> str:
    """Write the plot to ``path``; returns the line to print (where it is, or why not)."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    rows = result["rows"]
    groups = list(dict.fromkeys((r["model"], r["world_size"]) for r in rows))
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 2.6 * len(groups) + 1),
                             squeeze=False)
    for i, (model, world) in enumerate(groups):
        mine = [r for r in rows if (r["model"], r["world_size"]) == (model, world)]
        names = [r["setting"] for r in mine]
        left, right = axes[i]
        bars = left.barh(names, [r["ratio"] for r in mine], color="#3182bd",
                         xerr=[[r["ratio"] - r["ratio_p25"] for r in mine],
                               [r["ratio_p75"] - r["ratio"] for r in mine]])
        for bar, r in zip(bars, mine, strict=True):  # right of the bar and its spread
            left.text(max(bar.get_width(), r["ratio_p75"]), bar.get_y() + bar.get_height() / 2,
                      f"  {r['ratio']:.2f}x  {r['samples_per_s']:.0f}/s", va="center",
                      fontsize=8)
        for goal, style in ((1.0, "-"), (1.3, "--")):
            left.axvline(goal, color="grey", linestyle=style, linewidth=0.8)
        left.set_title(f"{model}, {world} ranks: samples/s vs the hand-written loop",
                       fontsize=9)
        left.invert_yaxis()
        left.set_xlim(0, max(1.6, max(r["ratio_p75"] for r in mine) * 1.35))
        start = [0.0] * len(mine)
        for phase in PHASES:
            values = [r["step_ms"][phase] for r in mine]
            right.barh(names, values, left=start, color=COLOURS[phase],
                       label=LABELS[phase] if i == 0 else None)
            start = [a + b for a, b in zip(start, values, strict=True)]
        right.invert_yaxis()
        right.set_title(f"{model}, {world} ranks: ms per step", fontsize=9)
    fig.legend(loc="lower center", ncol=len(PHASES), fontsize=8, frameon=False)
    fig.suptitle(f"hpc_ddp trainer vs a hand-written DDP loop: {result['device']}, "
                 f"batch {result['batch_size']} per rank, {result['threads_per_rank']} "
                 "threads per rank", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=(0, 0.04, 1, 1))  # room for the legend below
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot: {path}"
