"""Submit the job to Slurm through submitit's Slurm executor.

``executor_parameters`` is a pure mapping from the config to submitit's parameters; the
sbatch script is rendered once by ``render`` and the same text is what ``dry_run`` prints
(tests compare it with the file submitit actually submitted).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from typing import Any

from hpc_ddp.config.compose import to_yaml
from hpc_ddp.config.schema import ClusterConfig, Config
from hpc_ddp.errors import UserError
from hpc_ddp.rundir import RunDir
from hpc_ddp.task import TrainingTask

# Slurm names and hostlists: letters, digits and the punctuation Slurm uses in them. Anything
# else (spaces, quotes, ;, $, backticks, newlines) is refused rather than passed to a shell.
_SLURM_WORD = re.compile(r"^[A-Za-z0-9_.,:\[\]\-+%@=|&!*()]+$")
_NAMED = ("partition", "account", "qos", "constraint", "exclude", "nodelist")
# Environment variable submitit reads (in the tasks) to know which signal means "requeue".
_SIGNAL_ENV = "SUBMITIT_PREEMPT_SIGNAL"


def check_shell_safety(cfg: Config) -> None:
    """Refuse values that would not reach sbatch as plain data (named in the message)."""
    c = cfg.cluster
    for name in _NAMED:
        value = getattr(c, name)
        if value is not None and not _SLURM_WORD.match(value):
            raise UserError(f"cluster.{name}", value,
                            "holds characters Slurm names never contain (space, quote, ;, $, "
                            "backtick or newline).", "pass the plain Slurm name.")
    for key, value in c.sbatch_extra.items():
        if not re.match(r"^[a-z][a-z0-9-]*$", key):
            raise UserError(f"cluster.sbatch_extra.{key}", value, "is not an sbatch option name.",
                            "use the long option without dashes, e.g. mail-type.")
        if "\n" in str(value) or "\r" in str(value):
            raise UserError(f"cluster.sbatch_extra.{key}", value, "contains a newline.",
                            "give a single-line value.")
    for arg in c.srun_args:
        if "\n" in arg:
            raise UserError("cluster.srun_args", arg, "contains a newline.", "one line each.")
    if cfg.run_dir and any(ch in cfg.run_dir for ch in "\n\r\t"):
        raise UserError("run_dir", cfg.run_dir, "contains a newline or tab.", "rename the folder.")


def executor_parameters(cfg: Config) -> dict[str, Any]:
    """submitit SlurmExecutor parameters for ``cfg`` (pure)."""
    c: ClusterConfig = cfg.cluster
    params: dict[str, Any] = {
        "nodes": cfg.nodes,
        "ntasks_per_node": c.tasks_per_node,
        "cpus_per_task": c.cpus_per_task,
        "time": c.time_min,
        "job_name": c.job_name,
        "signal_delay_s": c.signal_delay_s,
        # The requeue signal (USR2 by default, see ClusterConfig.signal) for submitit in the
        # tasks, then the user's own setup lines (module load, conda activate ...).
        "setup": [f"export {_SIGNAL_ENV}={shlex.quote(_bare_signal(c.signal))}", *c.setup],
        "srun_args": list(c.srun_args),
        "additional_parameters": {
            # --signal=SIG@T: SIG reaches every step T seconds before the limit
            # (https://slurm.schedmd.com/sbatch.html#OPT_signal).
            "signal": f"{_bare_signal(c.signal)}@{c.signal_delay_s}",
            # Requeueable even where the cluster's JobRequeue=0: the job requeues itself on
            # the signal and Slurm requeues it after a node failure.
            "requeue": True,
            **{k: str(v) for k, v in c.sbatch_extra.items()},
        },
    }
    for name in _NAMED:
        if getattr(c, name):
            params[name] = getattr(c, name)
    if c.exclusive:
        params["exclusive"] = True
    if c.mem_gb:
        params["mem"] = f"{int(c.mem_gb * 1024)}M"
    if c.gpus_per_node:
        # One task per GPU: per_node shows every task all GPUs of its node (the task picks by
        # local rank), per_task gives each task its own (https://slurm.schedmd.com/sbatch.html#OPT_gpus-per-task).
        if c.gpu_binding == "per_task":
            params["gpus_per_task"] = 1
        else:
            params["gpus_per_node"] = c.gpus_per_node
    return params


def _bare_signal(signal: str) -> str:
    return signal[3:] if signal.startswith("SIG") else signal


def make_executor(cfg: Config, run: RunDir) -> Any:
    import submitit

    executor = submitit.SlurmExecutor(folder=str(run.submitit / "%j"),
                                      max_num_timeout=cfg.cluster.max_restarts,
                                      python=shlex.quote(cfg.cluster.python)
                                      if cfg.cluster.python else None)
    executor.update_parameters(**executor_parameters(cfg))
    return executor


def render(cfg: Config, run: RunDir) -> str:
    """The exact sbatch script ``submit`` would hand to sbatch."""
    executor = make_executor(cfg, run)
    return str(executor._make_submission_file_text(executor._submitit_command_str, "dry-run"))


def dry_run(cfg: Config, run: RunDir) -> str:
    """The script, with nothing submitted and no folder left behind."""
    import shutil

    check_shell_safety(cfg)
    existed = run.root.exists()
    try:
        return render(cfg, run)
    finally:
        if not existed:  # submitit's executor creates its job folder; a dry run leaves none
            shutil.rmtree(run.root, ignore_errors=True)


def submit(cfg: Config, run: RunDir, task: Callable[[], Any] | None = None) -> Any:
    """Submit ``task`` (default: training) on every rank; returns submitit's SlurmJob."""
    check_shell_safety(cfg)
    executor = make_executor(cfg, run)
    try:
        return executor.submit(task or TrainingTask(to_yaml(cfg), str(run.root)))
    except Exception as exc:  # submitit raises FailedJobError with sbatch's stderr inside
        from submitit.core.utils import FailedJobError

        if isinstance(exc, FailedJobError):
            reason = " ".join(str(exc).split())[-400:]
            raise UserError("cluster", cfg.cluster.partition or "(default partition)",
                            f"sbatch refused the job: {reason}",
                            "check partition, account, nodes and GPUs against `sinfo`.") from None
        raise


def describe(cfg: Config) -> str:
    tasks = cfg.cluster.tasks_per_node or 1
    gpus = f", {cfg.cluster.gpus_per_node} GPUs/node" if cfg.cluster.gpus_per_node else ""
    return f"{cfg.nodes} node(s) x {tasks} task(s){gpus} = {cfg.nodes * tasks} ranks"

