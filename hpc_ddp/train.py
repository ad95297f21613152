"""The per-task entry: ``srun python -m hpc_ddp.train [key=value ...]`` (see jobs/train.sbatch).

Every task composes the same config from the same overrides (``--config-dir DIR`` or
$HPC_DDP_CONFIG_DIR for your config folder; after ``--``, a script's arguments), derives its
rank from Slurm (or torchrun), and runs the same code a ``python -m hpc_ddp.submit`` job runs:
the built-in trainer, your ``entry=`` function or your ``script=``. Without
run_dir, the run goes to outputs/job-<SLURM_JOB_ID> under the submission folder, the same for
every task; a requeued job finds its checkpoints there and resumes.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hpc_ddp.config.schema import Config
from hpc_ddp.errors import USAGE_EXIT_CODE, UserError
from hpc_ddp.inputs.resume_check import check_resumable
from hpc_ddp.inputs.run_dir import (
    check_inputs,
    check_owned_folder,
    check_writable,
    write_run_config,
)
from hpc_ddp.inputs.run_dir import check_run_dir as check_run_dir_as_submit_does
from hpc_ddp.rank.services import early_signals
from hpc_ddp.rundir import RunDir, created_with, default_root, read_json, write_json


def check_run_dir(cfg: Config, root: Path, restart: int, rank: int = 0) -> None:
    """Submit's run-dir checks, as far as they hold on every rank of a started job.

    Every rank checks (the run dir may be mounted differently on each node): it must be a
    folder this rank can write, and a first start with resume=true must find a run there.
    submit's "new or empty" rule is left out: a requeued start finds its own run, and the
    other ranks may already see rank 0's config.yaml; a fresh start in a folder holding
    checkpoints is refused by task.resume_cause. Of the ranks' files, this task checks
    ``rank``'s (inputs/run_dir.check_run_files: nothing per other rank).
    """
    checked = dataclasses.replace(cfg, run_dir=cfg.run_dir or str(root),
                                  resume=cfg.resume and restart == 0)
    assert checked.run_dir is not None
    if checked.resume or (root.exists() and not root.is_dir()):
        run = check_run_dir_as_submit_does(checked, (rank,))  # a file; no run; not writable
        check_resumable(checked, run)  # a network or optimizer the checkpoint cannot take
    else:
        if root.is_dir():  # someone else's, or one they can write: nothing is loaded from it
            check_owned_folder(root, "run_dir", checked.run_dir, (rank,))
        check_writable(root, checked.run_dir)


def record_job(run_dir: RunDir, job: str) -> None:
    """job.json as a submission writes it, for a job started by sbatch: the run is then one
    of ``status``, ``logs`` and ``Run.from_dir`` like any other (a requeue, the same job,
    is recorded once; a later sbatch on the same run dir joins its history)."""
    path = run_dir.root / "job.json"
    found = read_json(path)
    history = found.get("history", []) if isinstance(found, dict) else []
    if any(str(h.get("job_id")) == job for h in history):
        return
    record = {"kind": "slurm", "job_id": job, "submitted": time.time(), "started_by": "sbatch"}
    run_dir.root.mkdir(parents=True, exist_ok=True)
    write_json(path, {**record, "history": [*history, record]})


def main(argv: Sequence[str] | None = None) -> int:
    # Slurm's requeue signal or SIGTERM may come while this task composes its config:
    # recorded, and acted on by the rank's stop request (rank/services/early_signals.py).
    early_signals.hold(os.environ)
    # deferred: hostlist; start-up: config.compose, config.secrets, inputs.command_line,
    # rank.join.device, rank.join.distenv, config.supervision, rank.warm.client
    from hpc_ddp.config import secrets
    from hpc_ddp.config.compose import compose
    from hpc_ddp.config.supervision import supervised, warm
    from hpc_ddp.inputs.command_line import (
        absolute_script,
        split_script_args,
        take_config_dir,
        with_script_args,
    )
    from hpc_ddp.rank.contract import WARM_ENV  # deferred (start-up): rank.contract
    from hpc_ddp.rank.join.device import DeviceError
    from hpc_ddp.rank.join.distenv import LaunchError, detect, in_slurm_step
    from hpc_ddp.rank.main.task import resume_cause, run
    from hpc_ddp.rank.warm.client import release, start_early

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args[:args.index("--") if "--" in args else None]):
        print(__doc__)
        return 0
    try:
        args, script_args = split_script_args(args)
        args = take_config_dir(args)
        cfg = compose(args)
        cfg = dataclasses.replace(cfg, script=absolute_script(cfg.script, Path.cwd()))
        cfg = with_script_args(cfg, script_args)
        if in_slurm_step(os.environ):
            # Warm starts as the launchers set them (rank/warm/): a supervisor (this process)
            # joins while its node's warm process imports torch for its training process.
            os.environ[WARM_ENV] = warm(cfg)
            if supervised(cfg):
                start_early(os.environ)
        if secrets.literals_in([*args, "--", *cfg.script_args], secrets.marks_of(cfg)):
            # On this task's command line every user of the node reads it (ps): refused.
            raise UserError("command line", secrets.MASK, "holds a secret, which every user "
                            "of the job's nodes can read on each task's command line (ps).",
                            "export it in your shell before sbatch and pass it by reference, "
                            "e.g. model.api_token='${oc.env:MY_TOKEN}' (docs/security.md).")
        # A secret the config files give: kept out of config.yaml, in this task's
        # environment instead, where the rank reads its reference (config/secrets.py).
        cfg, hidden = secrets.extract(cfg)
        os.environ.update(hidden)
        env = detect(os.environ, cfg.cluster.tasks_per_node)
        job = os.environ.get("SLURM_JOB_ID")
        root = Path(cfg.run_dir) if cfg.run_dir else default_root(Path.cwd() / "outputs",
                                                                   job_id=job or "local")
        run_dir = RunDir(root.absolute())
        check_run_dir(cfg, run_dir.root, env.restart, env.rank)
        check_inputs(cfg)
        if env.is_master and job:  # status, logs and Run.from_dir know it as submit's
            record_job(run_dir, job)
        if env.is_master and resume_cause(cfg, run_dir, env) is None:
            # A fresh run: record its config and overrides (submit resume=true can go on
            # from them). A resumed or requeued run keeps what it was started with.
            with created_with(cfg.cluster.umask):
                write_run_config(run_dir, cfg, secrets.scrub_overrides(
                    args, secrets.marks_of(cfg)))
        summary = run(cfg, run_dir, os.environ)
    except (UserError, LaunchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except DeviceError as exc:  # this node's environment, not the command: one line, exit 1
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        from hpc_ddp.rank.main.submitted import recorded  # deferred (start-up): submitted

        if recorded(exc):  # in the rank's log and error file, with the program's traceback
            return 1
        raise
    finally:
        release()  # the node's warm process, if this task started it
    if summary is not None:
        from hpc_ddp.rank.supervise.outcome import summary_line  # deferred: hostlist

        said = summary_line(summary)
        print(f"hpc_ddp: done, {said + ', ' if said else ''}run dir {run_dir.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
