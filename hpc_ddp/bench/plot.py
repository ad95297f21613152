"""The PNG of a comm benchmark: busbw by message size per collective, raw TCP as a line.

matplotlib is optional: without it the benchmark still prints its table and writes its JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# What a benchmark prints instead of its picture without matplotlib.
NO_MATPLOTLIB = "plot: skipped (matplotlib is not installed: pip install matplotlib)"


def pyplot() -> Any | None:
    """matplotlib.pyplot drawing into files, or None where matplotlib is not installed."""
    try:
        import matplotlib  # optional: matplotlib

        matplotlib.use("Agg")  # files only: compute nodes and CI have no display
        import matplotlib.pyplot as plt  # optional: matplotlib
    except ImportError:
        return None
    return plt


def save(plt: Any, fig: Any, path: Path) -> str:
    """Write ``fig`` to ``path`` (its folder made), close it; the line to print."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot: {path}"


def plot(result: dict[str, Any], path: Path) -> str:
    """Write the plot to ``path``; returns the line to print (where it is, or why not)."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op in sorted({r["op"] for r in result["rows"]}):
        rows = sorted((r for r in result["rows"] if r["op"] == op), key=lambda r: r["bytes"])
        ax.plot([r["bytes"] for r in rows], [r["busbw_gbps"] for r in rows], marker="o",
                label=f"{op} busbw")
    raw = result.get("tcp")
    if raw and raw["gbps"]:
        ax.axhline(raw["gbps"], color="grey", linestyle="--",
                   label=f"raw TCP {raw['from_host']}->{raw['to_host']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{result['backend']}, {result['world_size']} ranks on "
                 f"{len(set(result['hosts']))} host(s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return save(plt, fig, path)
