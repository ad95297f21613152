"""The PNG of a scaling report: efficiency against nodes, and where a step goes at each.

Left: efficiency (samples/s against linear scaling from the smallest node count) by nodes,
with 1.0 (linear) and the verdict's "scales well" threshold as lines. Right: each node
count's step split into data wait, compute, exposed gradient sync, optimizer and the rest,
in ms per step, then each fix that ran at the largest. matplotlib is optional: without it
the report still prints its table and writes its JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_ddp.bench.plot import NO_MATPLOTLIB, pyplot, save
from hpc_ddp.bench.plot_train import COLOURS
from hpc_ddp.bench.scaling_report import NAMES, SCALES_WELL
from hpc_ddp.trainer.loop_timing import PHASES


def plot(result: dict[str, Any], path: Path) -> str:
    """Write the plot to ``path``; returns the line to print (where it is, or why not)."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    rows = result["rows"]
    fixes = [r for r in result["fix_rows"] if not r.get("skipped")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    nodes = [r["nodes"] for r in rows]
    eff = [r["efficiency"] or 0.0 for r in rows]
    left.plot(nodes, eff, marker="o", color="#3182bd", label="efficiency")
    for n, e, r in zip(nodes, eff, rows, strict=True):
        left.annotate(f"{100 * e:.0f}%\n{r['samples_per_s']:.0f}/s", (n, e),
                      textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    left.axhline(1.0, color="grey", linewidth=0.8, label="linear")
    left.axhline(SCALES_WELL, color="grey", linestyle="--", linewidth=0.8,
                 label=f"scales well ({100 * SCALES_WELL:.0f}%)")
    left.set_xticks(nodes)
    left.set_xlabel("nodes")
    left.set_ylabel(f"efficiency (vs {nodes[0]} node(s) x nodes)")
    left.set_ylim(0, max(1.15, max(eff) * 1.2))
    left.legend(fontsize=8, loc="best")
    left.set_title(f"verdict: {result['verdict']['cause']}", fontsize=9)
    names = [f"{r['nodes']} node(s)" for r in rows] + \
        [f"{rows[-1]['nodes']} nodes + {f['fix']}" for f in fixes]
    splits = [r["step_ms"] for r in (*rows, *fixes)]
    start = [0.0] * len(names)
    for phase in PHASES:
        values = [s[phase] for s in splits]
        right.barh(names, values, left=start, color=COLOURS[phase], label=NAMES[phase])
        start = [a + b for a, b in zip(start, values, strict=True)]
    right.invert_yaxis()
    right.set_xlabel("ms per step")
    right.set_title("where a step goes (mean over ranks, median over windows)", fontsize=9)
    right.legend(fontsize=8, loc="best")
    fig.suptitle(f"scaling report: {result['model']} on {result['device']} "
                 f"({result['backend']}), batch {result['batch_size']} per rank, "
                 f"{result['tasks_per_node']} rank(s) per node", fontsize=10)
    return save(plt, fig, path)
