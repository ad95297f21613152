"""A sweep's folder (grid or adaptive): ``sweep.dir``, else ``multirun/<date>_<time>``."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Sequence
from pathlib import Path

from hpc_ddp.config.given import text, typed
from hpc_ddp.errors import UserError


def sweep_dir_for(overrides: Sequence[str], cwd: Path) -> Path:
    if (value := typed(overrides, "run_dir")) is not None:
        raise UserError("run_dir", value, "is set per point in a sweep.",
                        f"use sweep.dir={value} for the sweep's folder.")
    if folder := text(overrides, "sweep.dir"):
        return Path(folder).absolute()
    stamp = _dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    return (cwd / "multirun" / stamp).absolute()
