"""Rank 0's outputs while training: TensorBoard scalars and the progress file."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import write_json

# progress.json is polled by `follow` about twice a second: rewriting it more often than once
# a second only costs rank 0 time (an atomic replace, ~0.5 ms).
PROGRESS_EVERY_S = 1.0


class MetricsWriter:
    """TensorBoard + progress.json on rank 0; on other ranks every call does nothing."""

    def __init__(self, tb_dir: Path, progress: Path, enabled: bool,
                 resumed_from: int | None, total_steps: int | None,
                 trackers: Any = None) -> None:
        """``resumed_from``: the checkpoint step this attempt resumed from (see scalars);
        ``trackers``: W&B / MLflow runs the scalars go to as well (services/trackers.py)."""
        self.enabled = enabled
        self.trackers = trackers
        self.progress = progress
        self.total_steps = total_steps
        self._tb_dir, self._resumed_from = tb_dir, resumed_from
        self._tb: Any = None
        self._progress_at = -float("inf")

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter  # deferred: torch

            # After a resume, TensorBoard drops the earlier attempt's events logged after the
            # checkpoint (from the step after it, or this first logged step if the loop
            # numbers its steps from there), so no step appears twice.
            purge = None
            if self._resumed_from is not None:
                purge = min(step, self._resumed_from + 1)
            self._tb = SummaryWriter(str(self._tb_dir), purge_step=purge)
        for tag, value in values.items():
            self._tb.add_scalar(tag, value, step)
        if self.trackers is not None:
            self.trackers.log(step, values)

    def write_progress(self, step: int, epoch: int | None, values: Mapping[str, float],
                       force: bool = True) -> None:
        """progress.json; ``force`` false: only if the last write is PROGRESS_EVERY_S old
        (a loop may call it at every log step)."""
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._progress_at < PROGRESS_EVERY_S:
            return
        self._progress_at = now
        write_json(self.progress, {"step": step, "total_steps": self.total_steps,
                                   "epoch": epoch, "time": time.time(), **values})

    def close(self, finished: bool = True) -> list[str]:
        """Flush and close; the trackers' lines that say where their runs are (``finished``:
        the run has ended, not stopped to be requeued or resumed)."""
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        trackers, self.trackers = self.trackers, None
        return trackers.close(finished) if trackers is not None else []


def write_hparams(tb_dir: Path, hparams: dict[str, Any], metrics: dict[str, float]) -> None:
    """A sweep point's swept values and final metrics, so TensorBoard's HPARAMS tab compares
    the points of a sweep dir in one view."""
    from torch.utils.tensorboard import SummaryWriter  # deferred: torch

    writer = SummaryWriter(str(tb_dir))
    try:
        writer.add_hparams(hparams, metrics, run_name=".")
    finally:
        writer.close()


def hparam_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The numbers of a run's summary that compare sweep points: the built-in trainer's eval
    and loss figures, and the numbers a user's program returned."""
    found: dict[str, float] = {}

    def number(value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)

    for key in ("eval_accuracy", "eval_loss", "final_train_loss"):
        if number(summary.get(key)):
            found[f"hparam/{key}"] = float(summary[key])
    for key, value in (summary.get("eval_metrics") or {}).items():
        if number(value) and f"hparam/eval_{key}" not in found:
            found[f"hparam/eval_{key}"] = float(value)
    for key, value in (summary.get("result") or {}).items():
        if number(value):
            found.setdefault(f"hparam/{key}", float(value))
    return found
