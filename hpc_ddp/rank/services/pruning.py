"""A trial of an adaptive sweep, pruned from its own evaluations: the built-in trainer's, or
what a user's loop reports (``ctx.report``, rank/context/trial.py).

The Optuna sweeper plugin could not prune: the trial never reached the training code. Here
the sweep's worker (sweep/worker.py) names the trial in the ranks' environment; after each
evaluation rank 0 reports the objective to it (``trial.report``) and asks the study's pruner
(``trial.should_prune``), one storage read and write an evaluation, whatever the world size.
Its answer reaches every rank in one tiny collective, so all of them stop after the same
evaluation; the trainer then ends as a finished run does (the last checkpoint written, the
summary), and rank 0 notes where it was pruned for the worker, which tells the study PRUNED.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.rank.contract import PRUNED_FILE, TRIAL_ENV
from hpc_ddp.rundir import write_json

log = logging.getLogger(__name__)


class Trial:
    """This run's trial, on every rank (rank 0 alone talks to the study)."""

    def __init__(self, given: Mapping[str, Any], is_master: bool, run_root: Path) -> None:
        self.metric = str(given.get("objective", "eval/loss")).removeprefix("eval/")
        self.number = int(given["trial"])
        self.is_master = is_master
        self.run_root = run_root
        self.pruned_at: int | None = None
        self._trial: Any = None
        if is_master:
            self._trial = _open(given)

    def after_eval(self, step: int, means: Mapping[str, float], device: Any) -> bool:
        """Report, ask, agree (a collective: every rank calls it after each evaluation);
        whether the run stops here."""
        prune = 0
        if self.is_master and self._trial is not None and self.metric in means:
            try:
                self._trial.report(float(means[self.metric]), step)
                prune = int(self._trial.should_prune())
            except Exception as exc:  # the study unreachable: train on, say so once
                log.warning("trial %d: cannot report to the study (%s); it trains on "
                            "unpruned", self.number, exc)
                self._trial = None
        if _agreed(prune, device):
            self.pruned_at = step
            if self.is_master:
                log.warning("trial %d pruned at step %d (%s %.6g): the study's pruner "
                            "stopped it", self.number, step, self.metric,
                            means.get(self.metric, float("nan")))
                write_json(self.run_root / PRUNED_FILE, {"step": step, "time": time.time(),
                                                         self.metric: means.get(self.metric)})
        return self.pruned_at is not None


def _agreed(flag: int, device: Any) -> bool:
    # deferred: torch
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return bool(flag)
    tensor = torch.tensor([flag], dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def _open(given: Mapping[str, Any]) -> Any:
    """The running trial, through the study's storage and its pruner (sweep/study.py)."""
    from hpc_ddp.sweep import study as studies  # deferred (start-up): sweep.study

    return studies.running_trial(Path(given["folder"]), int(given["trial"]))


class NoTrial:
    """A run outside an adaptive sweep: never pruned, no collective."""

    pruned_at: int | None = None

    def after_eval(self, step: int, means: Mapping[str, float], device: Any) -> bool:
        return False


def from_environ(environ: Mapping[str, str], is_master: bool,
                 run_root: Path) -> Trial | NoTrial:
    """The trial this run is (TRIAL_ENV), or NoTrial outside an adaptive sweep."""
    text = environ.get(TRIAL_ENV)
    if not text:
        return NoTrial()
    try:
        return Trial(json.loads(text), is_master, run_root)
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("%s is not a trial (%s): the run trains unpruned", TRIAL_ENV, exc)
        return NoTrial()
