"""``logger``: the experiment trackers a run logs to beside TensorBoard (always on), and the
package each one needs (docs/observability.md#experiment-trackers)."""

from __future__ import annotations

import importlib.util
from typing import Any

from hpc_ddp.errors import UserError

# Trackers beside TensorBoard (rank/services/trackers.py), and the package each one needs.
TRACKERS = {"tensorboard": None, "wandb": "wandb", "mlflow": "mlflow"}


def trackers_of(logger: Any) -> list[str]:
    """``logger`` ("wandb", "tensorboard,mlflow", ["wandb", "mlflow"]) as the trackers to
    open beside TensorBoard (always on); UserError for a name that is none."""
    names = logger if isinstance(logger, list | tuple) else str(logger or "").split(",")
    found = [str(n).strip().lower() for n in names if str(n).strip()]
    for name in found:
        if name not in TRACKERS:
            raise UserError("logger", logger, f"{name!r} is not a tracker.",
                            "use tensorboard (always on), wandb or mlflow; several as "
                            "logger=[wandb,mlflow].")
    return [n for n in dict.fromkeys(found) if n != "tensorboard"]


def validate_logger(logger: Any) -> None:
    """Each tracker asked for is installed here (the nodes share this environment, or
    build theirs from the same pins: pip install hpc_ddp[wandb])."""
    for name in trackers_of(logger):
        module = TRACKERS[name]
        if module is not None and importlib.util.find_spec(module) is None:
            raise UserError("logger", name, f"needs the {module} package, which is not "
                            "installed here.", f"pip install 'hpc_ddp[{name}]' (on the nodes "
                            "too), or leave logger out (TensorBoard).")
