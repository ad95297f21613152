"""A Context's trial (docs/sweeps.md#adaptive-sweeps): a user's own loop, run as a trial of
an adaptive sweep, reports its evaluations to the study and is pruned by its pruner exactly as
the built-in trainer is (rank/services/pruning.py does the work; this is the part a loop
calls). Outside an adaptive sweep a report is free: no study, no collective."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hpc_ddp.rank.join.distenv import DistEnv
from hpc_ddp.rank.services import pruning
from hpc_ddp.rundir import RunDir


class TrialReports:
    """Mixed into rank/context/context.py's Context: needs its ``device``, ``env`` and
    ``run``."""

    device: Any
    env: DistEnv
    run: RunDir
    _trial: pruning.Trial | pruning.NoTrial | None = None

    def report(self, values: Mapping[str, float], step: int) -> bool:
        """Report an evaluation (``{"eval/loss": 0.41}``; the sweep's objective,
        ``sweep.objective``, among them) at ``step``; True once the study's pruner stopped
        this trial: save if you like and return. A collective: every rank calls it at the
        same steps (rank 0's values are the ones reported). Outside an adaptive sweep it
        returns False at once."""
        if self._trial is None:
            self._trial = pruning.from_environ(os.environ, self.env.is_master, self.run.root)
        if self._trial.pruned_at is not None:
            return True
        means = {}
        for name, value in values.items():
            try:
                means[name.removeprefix("eval/")] = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"ctx.report: {name}={value!r} is not a number. Fix: report "
                                "numbers, e.g. {\"eval/loss\": loss.item()}") from None
        return self._trial.after_eval(step, means, self.device)
