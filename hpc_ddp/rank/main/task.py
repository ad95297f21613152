"""What runs on every rank: join the job (rank/join/joined.py), run the program, act on how
it ended.

The program is the built-in trainer, a user's function entry (entry.py) or a user's script
under a supervisor (rank/supervise/script.py). Used by both paths: submitit pickles a
:class:`RankProgram` of :func:`training_task` (``python -m hpc_ddp.submit``), and
``python -m hpc_ddp.train`` (srun inside ``jobs/*.sbatch``) calls :func:`run` directly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

from hpc_ddp import events
from hpc_ddp.config.compose import from_yaml
from hpc_ddp.config.schema import Config
from hpc_ddp.errors import UserError
from hpc_ddp.rank.contract import DRIVEN_ENV, EARLY_STOP_ENV, RESUME_CAUSE_ENV
from hpc_ddp.rank.join.distenv import DistEnv, detect
from hpc_ddp.rank.join.joined import Rank, joined
from hpc_ddp.rank.join.ranklog import masked
from hpc_ddp.rank.join.tracebacks import RECORDED
from hpc_ddp.rank.services import checkpoint, lost_signal, stopping
from hpc_ddp.rank.services.stopping import StopRequest, StopTraining
from hpc_ddp.rank.supervise.outcome import after_failure, after_stop, write_summary
from hpc_ddp.rundir import RunDir, parse_umask

log = logging.getLogger(__name__)


class RankProgram:
    """A picklable callable for submitit: runs ``program(cfg, run_dir, os.environ, options)``
    on every task. ``program`` must be a module-level function (pickled by reference)."""

    def __init__(self, program: Callable[..., Any], config_yaml: str, run_dir: str,
                 options: Any = None) -> None:
        self.program = program
        self.config_yaml = config_yaml
        self.run_dir = run_dir
        self.options = options

    def __call__(self) -> Any:
        try:
            return self.program(from_yaml(self.config_yaml), RunDir(Path(self.run_dir)),
                                os.environ, self.options)
        except Exception as exc:
            raise without_secrets(exc) from None


class RankFailed(RuntimeError):
    """What submitit records (in its result pickle) of a rank's failure: the message with the
    run's secrets masked, none of the chain (the rank's error file keeps the traceback)."""


def without_secrets(exc: Exception) -> Exception:
    """``exc`` as submitit may keep it: its message masked (ranklog.masked), its chain left
    out; marked as recorded when the rank recorded it (submitted.py prints nothing more)."""
    clean = RankFailed(masked(f"{type(exc).__name__}: {exc}"))
    if getattr(exc, RECORDED, False):
        setattr(clean, RECORDED, True)
    return clean


def training_task(config_yaml: str, run_dir: str) -> RankProgram:
    """What submitit (or a step) runs on every task of a training job: :func:`run`."""
    return RankProgram(_run_program, config_yaml, run_dir)


def _run_program(cfg: Config, run_dir: RunDir, environ: MutableMapping[str, str],
                 options: Any = None) -> dict[str, Any] | None:
    return run(cfg, run_dir, environ)


def signals_first(cfg: Config, environ: Mapping[str, str]) -> StopRequest:
    """This rank's stop request, installed before anything slow: Slurm may send the requeue
    signal seconds after the start (a short time limit) while torch is still importing, and
    until then submitit's handler would take it ("timed-out and not checkpointable") and end
    the job. A supervised child starts with the stop its supervisor was signalled for before
    the child ran (EARLY_STOP_ENV)."""
    stop = StopRequest()
    stop.install(cfg.cluster.signal)
    stop.code = max(stop.code, int(environ.get(EARLY_STOP_ENV) or stopping.NONE))
    return stop


def run(cfg: Config, run_dir: RunDir, environ: MutableMapping[str, str]) -> dict[str, Any] | None:
    """Run this rank's program: the built-in trainer, a function entry (``cfg.entry``) or a
    script under its supervisor (``cfg.script``). Returns the summary on rank 0, None
    elsewhere; raises on failure.

    A stop signal ends in a checkpoint and a requeue (or a clear exit); a failure of another
    rank ends in a message naming it and, on Slurm, a requeue while restarts remain.
    """
    stop = signals_first(cfg, environ)
    os.umask(parse_umask(cfg.cluster.umask))  # every file this rank makes (rundir.py)
    env = detect(environ, cfg.cluster.tasks_per_node)
    # Slurm's warning ahead of the time limit, again if it was sent before this step began.
    lost_signal.watch(environ, env.rank, cfg.cluster.signal, cfg.cluster.signal_delay_s,
                      lambda: stop.code != stopping.NONE)
    # Refuse a run dir that holds another run before anything joins (nothing is touched).
    # A start in place after a failure (its supervisor's generation > 0, or the driver's step
    # started again after a node was lost) resumes, and says why.
    if env.generation:
        cause: str | None = environ.get(RESUME_CAUSE_ENV) or "restart in place"
    elif environ.get(DRIVEN_ENV, "0") not in ("", "0"):
        cause = "restart in place on the nodes left after a node was lost"
    else:
        cause = resume_cause(cfg, run_dir, env, environ.get("SLURM_JOB_ID"))
    if cfg.script is not None:
        # deferred (start-up): rank.supervise.script
        from hpc_ddp.rank.supervise.script import supervise

        return supervise(cfg, run_dir, environ, cause, stop)
    # deferred (start-up): rank.supervise.program
    from hpc_ddp.rank.supervise import program as supervised

    if supervised.wanted(cfg, environ):
        return supervised.supervise(cfg, run_dir, environ, stop)
    with joined(cfg, run_dir, environ) as rank:
        try:
            from hpc_ddp.data.stage_run import stage_data  # deferred: concurrent, tarfile

            # data.stage: every node's copy first; the program reads it (stage_run.py).
            cfg, staged = stage_data(cfg, rank, run_dir, environ)
            if cfg.entry is not None:
                from hpc_ddp.rank.main.entry import call  # deferred (start-up): rank.main.entry

                return call(cfg, rank, run_dir, cause, stop, environ, staged)
            return _train(cfg, rank, run_dir, cause, stop, staged)
        except StopTraining as stopped:
            after_stop(stopped.code, stopped.step, stop, cfg, rank, run_dir, environ)
        except Exception as exc:
            after_failure(exc, cfg, rank, run_dir, environ)
    return None


def _train(cfg: Config, rank: Rank, run_dir: RunDir, cause: str | None,
           stop: StopRequest, staged: dict[str, Any] | None = None) -> dict[str, Any] | None:
    from hpc_ddp.trainer.loop import Trainer  # deferred: torch

    trainer = Trainer(cfg, rank.env, run_dir, rank.device, stop, joined=rank)
    if cause is not None:
        trainer.resume_if_possible(cause)
    summary = trainer.train()
    if not rank.env.is_master:
        return None
    if staged is not None:
        summary["data_stage"] = staged
    summary = write_summary(rank, run_dir, summary)
    log.info("done: step %d, eval %s; summary in %s", summary["global_step"],
             " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                      for k, v in summary["eval_metrics"].items()) or "none", run_dir.summary)
    return summary


def resume_cause(cfg: Config, run_dir: RunDir, env: DistEnv,
                 job: str | None = None) -> str | None:
    """Why this start continues from a checkpoint (None: a fresh run); ``job``: this Slurm
    job's id (an earlier job of the same run dir numbered its attempts the same way)."""
    if env.restart > 0:
        if not env.is_master:  # rank 0's cause goes into the checkpoint and the summary
            return "requeue"
        why = events.last_reason(events.read(run_dir.root), env.restart - 1, job)
        return f"requeue after {why}" if why else "requeue by Slurm (preemption or node failure)"
    if cfg.resume:
        return "resume"
    if checkpoint.latest_path(run_dir.checkpoints) is not None:
        raise UserError("run_dir", str(run_dir.root), "already holds checkpoints of a run.",
                        "pass resume=true to continue it, or choose another run_dir.")
    return None
