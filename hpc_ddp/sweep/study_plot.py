"""The picture of an adaptive sweep: ``<sweep dir>/study.png`` (and ``status DIR --plot F``).

Left: the optimisation history, each trial's value by its number with the best so far as a
line (pruned trials at the last value they reported, hollow). Then one panel a parameter:
the objective against it, log x for a parameter drawn on a log scale or that spans decades
(a learning rate). Written by each worker when it leaves, so the folder holds the latest;
matplotlib is one of hpc_ddp's own dependencies.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from hpc_ddp.sweep import study as studies
from hpc_ddp.sweep.plot import spans_decades

PICTURE = "study.png"


def points(trials: list[Any]) -> list[tuple[int, float, bool, dict[str, Any]]]:
    """(number, value, pruned, params) of each trial with a value: a finished trial's, or a
    pruned trial's last reported one (pure)."""
    found = []
    for trial in trials:
        if trial.state.name == "COMPLETE" and trial.values:
            found.append((trial.number, float(trial.values[0]), False, dict(trial.params)))
        elif trial.state.name == "PRUNED" and trial.intermediate_values:
            last = max(trial.intermediate_values)
            found.append((trial.number, float(trial.intermediate_values[last]), True,
                          dict(trial.params)))
    return [p for p in found if math.isfinite(p[1])]


def write(folder: Path, out: Path | None = None) -> Path | None:
    """Draw the study in ``folder`` to ``out`` (default: its study.png); None when no trial
    has a value yet, or matplotlib is missing."""
    manifest = studies.read_study(folder)
    if manifest is None:
        return None
    spec = studies.StudySpec.from_json(manifest["spec"])
    space = studies.space_of(spec, manifest["overrides"])
    study = studies.open_study(spec, manifest["storage"], manifest["study_name"], space,
                               create=False)
    found = points(study.trials)
    if not found:
        return None
    import matplotlib  # deferred: matplotlib

    matplotlib.use("Agg")  # files only: compute nodes have no display
    import matplotlib.pyplot as plt  # deferred: matplotlib

    names = list(space.params)
    fig, axes = plt.subplots(1, 1 + len(names), figsize=(4.5 * (1 + len(names)), 3.6),
                             squeeze=False)
    history = axes[0][0]
    minimize = spec.direction[0] == "minimize"
    best, line = None, []
    for number, value, _, _ in sorted(found):
        best = value if best is None else (min if minimize else max)(best, value)
        line.append((number, best))
    for pruned in (False, True):
        xs = [(n, v) for n, v, p, _ in found if p == pruned]
        if xs:
            history.scatter(*zip(*xs, strict=True), marker="o",
                            facecolors="none" if pruned else None,
                            edgecolors="C1" if pruned else None,
                            label="pruned (last report)" if pruned else "complete")
    history.step(*zip(*line, strict=True), where="post", color="C2", label="best so far")
    history.set_xlabel("trial")
    history.set_ylabel(spec.objective[0])
    history.set_title(f"study {manifest['study_name']}")
    history.legend(fontsize="small")
    for axis, name in zip(axes[0][1:], names, strict=True):
        drawn = [(p[name], v, pruned) for _, v, pruned, p in found if name in p]
        numeric = all(isinstance(x, int | float) and not isinstance(x, bool) for x, _, _ in drawn)
        labels = [x if numeric else str(x) for x, _, _ in drawn]
        axis.scatter(labels, [v for _, v, _ in drawn],
                     c=["C1" if pruned else "C0" for _, _, pruned in drawn])
        if numeric and (getattr(space.params[name], "log", False)
                        or spans_decades([float(x) for x, _, _ in drawn])):
            axis.set_xscale("log")
        axis.set_xlabel(name)
        axis.set_ylabel(spec.objective[0])
    target = out or folder / PICTURE
    fig.tight_layout()
    # Its own temp name: workers leaving together each draw, and the last rename wins.
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:  # in place at once: a worker drawing while another reads it never shows half
        fig.savefig(partial, dpi=100, format="png")
        partial.replace(target)
    finally:
        plt.close(fig)
    return target
