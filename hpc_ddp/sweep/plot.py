"""The picture of a sweep (or of runs side by side): ``python -m hpc_ddp.status DIR --plot F``.

Left: every run's training loss, on a log scale when the values span decades (one point
that diverges would otherwise flatten every other curve into the floor). Middle: eval
accuracy (eval loss where no run reports accuracy). Right, for a sweep: the final metric
against the swept hyperparameter, which shows a sweep better than its curves: one marker
per point, log x for a hyperparameter that spans decades (a learning rate), one line per
combination of the other swept keys.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.errors import UserError
from hpc_ddp.rundir import RunDir, read_json

# max/min of the positive values above which an axis is drawn on a log scale.
DECADES_RATIO = 100.0


def spans_decades(values: Sequence[float]) -> bool:
    """True when all values are positive and finite and the largest is DECADES_RATIO times the
    smallest or more."""
    finite = [v for v in values if isinstance(v, int | float) and math.isfinite(v)]
    if not finite or min(finite) <= 0:
        return False
    return max(finite) / min(finite) >= DECADES_RATIO


def final_metric(summaries: Sequence[dict[str, Any]]) -> tuple[str, list[float | None]]:
    """("eval accuracy", values) where any run reports accuracy, else ("eval loss", ...)."""
    key = "eval_accuracy" if any(isinstance(s.get("eval_accuracy"), int | float)
                                 for s in summaries) else "eval_loss"
    values = [s.get(key) if isinstance(s.get(key), int | float) else None for s in summaries]
    return key.replace("_", " "), values


def sweep_axis(params: Sequence[dict[str, Any]]) -> tuple[str, list[str]] | None:
    """(the hyperparameter for the x axis, the other swept keys) of a sweep; None when the runs
    have no swept values. Numeric keys first (a line over them reads best), in sweep order."""
    keys: list[str] = []
    for p in params:
        keys += [k for k in p if k not in keys]
    varying = [k for k in keys if len({repr(p.get(k)) for p in params}) > 1] or keys
    if not varying:
        return None
    numeric = [k for k in varying if all(isinstance(p.get(k), int | float) and not
                                         isinstance(p.get(k), bool) for p in params)]
    x = (numeric or varying)[0]
    return x, [k for k in varying if k != x]


def plot_runs(runs: Sequence[tuple[str, Path]], out: Path) -> None:
    """Draw ``runs`` (label, run dir) into ``out`` (.png, .pdf, .svg); UserError if it cannot
    be written."""
    import matplotlib.pyplot as plt  # deferred: matplotlib

    fig = figure(runs)
    try:
        fig.savefig(out, dpi=100)
    except OSError as exc:
        raise UserError("--plot", str(out), f"cannot be written ({exc.strerror or exc}).",
                        "choose a file in a folder you can write.") from None
    finally:
        plt.close(fig)


def figure(runs: Sequence[tuple[str, Path]]) -> Any:
    """The matplotlib figure of ``runs`` (see the module's docstring)."""
    import matplotlib  # deferred: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: matplotlib, the typed schemas

    from hpc_ddp.api import JOB_FILE, Run

    curves: list[tuple[str, dict[str, list[tuple[int, float]]]]] = []
    summaries, params = [], []
    for label, run_dir in runs:
        job = read_json(run_dir / JOB_FILE) or {"kind": "local", "job_id": "?"}
        curves.append((label, Run(run_dir, job).scalars() if (run_dir / "tb").is_dir() else {}))
        summaries.append(read_json(run_dir / "summary.json") or {})
        hparams = read_json(RunDir(run_dir).hparams)
        params.append(hparams if isinstance(hparams, dict) else {})
    axis = sweep_axis(params) if len(runs) > 1 else None
    fig, axes = plt.subplots(1, 3 if axis else 2, figsize=(16 if axis else 11, 4))
    loss_ax, eval_ax = axes[0], axes[1]
    eval_tag = "eval/accuracy" if any(c.get("eval/accuracy") for _, c in curves) else "eval/loss"
    for ax, tag in ((loss_ax, "train/loss"), (eval_ax, eval_tag)):
        drawn: list[float] = []
        for label, scalars in curves:
            if scalars.get(tag):
                steps, values = zip(*scalars[tag], strict=True)
                ax.plot(steps, values, marker="o", markersize=3, label=label)
                drawn += values
        if spans_decades(drawn):
            ax.set_yscale("log")
            tag += " (log scale)"
        ax.set_title(tag)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    loss_ax.legend(fontsize=7)
    if axis:
        _metric_panel(axes[2], axis, params, summaries)
    fig.tight_layout()
    return fig


def _metric_panel(ax: Any, axis: tuple[str, list[str]], params: list[dict[str, Any]],
                  summaries: list[dict[str, Any]]) -> None:
    x_key, others = axis
    name, values = final_metric(summaries)
    numeric = all(isinstance(p.get(x_key), int | float) for p in params)
    order = sorted({repr(p.get(x_key)) for p in params}) if not numeric else []
    groups: dict[str, list[tuple[Any, float]]] = {}
    for p, value in zip(params, values, strict=True):
        if value is None:
            continue
        group = ", ".join(f"{k}={p.get(k)}" for k in others) or "points"
        x = p.get(x_key) if numeric else order.index(repr(p.get(x_key)))
        groups.setdefault(group, []).append((x, value))
    for group, found in groups.items():
        found.sort()
        ax.plot([x for x, _ in found], [y for _, y in found], marker="o", label=group)
    if numeric and spans_decades([float(p[x_key]) for p in params]):
        ax.set_xscale("log")
    if spans_decades([v for v in values if v is not None]):
        ax.set_yscale("log")
    if not numeric:
        ax.set_xticks(range(len(order)), [o.strip("'") for o in order])
    ax.set_title(f"final {name} by {x_key}")
    ax.set_xlabel(x_key)
    ax.grid(alpha=0.3)
    if len(groups) > 1 or others:
        ax.legend(fontsize=7)
