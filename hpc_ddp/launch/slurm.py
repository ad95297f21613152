"""Submit the job to Slurm through submitit's Slurm executor.

``executor_parameters`` is a pure mapping from the config to submitit's parameters; the
sbatch script is rendered once by ``render`` and the same text is what ``dry_run`` prints
(tests compare it with the file submitit actually submitted).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import shlex
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from hpc_ddp.config.compose import to_yaml
from hpc_ddp.config.schema import ClusterConfig, Config
from hpc_ddp.config.secrets import shell_lines
from hpc_ddp.config.validate import SLURM_NAMED, check_sbatch_extra
from hpc_ddp.errors import UserError
from hpc_ddp.rank.task import TrainingTask
from hpc_ddp.rundir import RunDir

# Slurm names and hostlists: letters, digits and the punctuation Slurm uses in them. Anything
# else (spaces, quotes, ;, $, backticks, newlines) is refused rather than passed to a shell.
_SLURM_WORD = re.compile(r"^[A-Za-z0-9_.,:\[\]\-+%@=|&!*()]+$")
# Environment variable submitit reads (in the tasks) to know which signal means "requeue".
_SIGNAL_ENV = "SUBMITIT_PREEMPT_SIGNAL"
_NO_CLIENT_FIX = ("use cluster=local to run on this machine, or submit from a login node of "
                  "the Slurm cluster.")
_NO_CONTROLLER_FIX = ("submit from a login node of the cluster, or point SLURM_CONF at its "
                      "slurm.conf (export SLURM_CONF=/path/to/slurm.conf), or use cluster=local.")


def check_shell_safety(cfg: Config) -> None:
    """Refuse values that would not reach sbatch as plain data (named in the message)."""
    c = cfg.cluster
    for name in SLURM_NAMED:
        value = getattr(c, name)
        if value is not None and not _SLURM_WORD.match(value):
            raise UserError(f"cluster.{name}", value,
                            "holds characters Slurm names never contain (space, quote, ;, $, "
                            "backtick or newline).", "pass the plain Slurm name.")
    check_sbatch_extra(c)
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
        # ${oc.env:NAME} (a secret's reference, config/secrets.py) as the shell's ${NAME}.
        "setup": [f"export {_SIGNAL_ENV}={shlex.quote(_bare_signal(c.signal))}",
                  *shell_lines(c.setup)],
        "srun_args": srun_args(c),
        "additional_parameters": {
            # --signal=SIG@T: SIG reaches every step T seconds before the limit
            # (https://slurm.schedmd.com/sbatch.html#OPT_signal).
            "signal": f"{_bare_signal(c.signal)}@{c.signal_delay_s}",
            # Requeueable even where the cluster's JobRequeue=0: the job requeues itself on
            # the signal and Slurm requeues it after a node failure.
            "requeue": True,
            **sbatch_extra_flags(c.sbatch_extra),
        },
    }
    for name in SLURM_NAMED:
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


def srun_args(c: ClusterConfig) -> list[str]:
    """The srun options of the job's step: the user's, and --cpus-per-task, which srun no
    longer takes from the job since Slurm 22.05 (23.11 reads SRUN_CPUS_PER_TASK instead):
    without it every rank gets one CPU of the cpus_per_task the job asked for.
    https://slurm.schedmd.com/srun.html#OPT_cpus-per-task"""
    given = list(c.srun_args)
    if c.cpus_per_task and not any(a == "-c" or a.startswith(("-c", "--cpus-per-task"))
                                   for a in given):
        given.append(f"--cpus-per-task={c.cpus_per_task}")
    return given


def sbatch_extra_flags(extra: Mapping[str, str]) -> dict[str, Any]:
    """``cluster.sbatch_extra`` as submitit's additional_parameters: ``true`` writes a bare
    flag (``hold: true`` -> ``--hold``; ``--hold=True`` is refused by sbatch, since flag
    options take no value) and ``false`` leaves the option out."""
    flags: dict[str, Any] = {}
    for key, value in extra.items():
        text = str(value)
        if text.lower() == "false":
            continue
        flags[key] = True if text.lower() == "true" else text
    return flags


def _bare_signal(signal: str) -> str:
    return signal[3:] if signal.startswith("SIG") else signal


@functools.cache
def _executor_class() -> Any:
    import submitit

    class Executor(submitit.SlurmExecutor):  # type: ignore[misc]
        """submitit's Slurm executor without its "srun on PATH" test at construction: a dry
        run needs no Slurm, and ``submit`` checks for sbatch itself (srun runs on the nodes,
        not where the job is submitted). The script and the submission are submitit's own."""

        @classmethod
        def affinity(cls) -> int:
            return 2

    return Executor


def make_executor(cfg: Config, run: RunDir) -> Any:
    """submitit's SlurmExecutor for ``cfg``; builds on a machine without Slurm too."""
    executor = _executor_class()(folder=str(run.submitit / "%j"),
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
    check_shell_safety(cfg)
    existed = run.root.exists()
    try:
        return render(cfg, run)
    finally:
        if not existed:  # submitit's executor creates its job folder; a dry run leaves none
            shutil.rmtree(run.root, ignore_errors=True)


def check_client(environ: Mapping[str, str]) -> None:
    """Refuse a Slurm submission where no ``sbatch`` is on PATH, in one line with the fix."""
    if not shutil.which("sbatch", path=environ.get("PATH", os.defpath)):
        raise _no_client("sbatch")


def _no_client(tool: str) -> UserError:
    return UserError("cluster.kind", "slurm", f"no Slurm here: {tool} is not on PATH.",
                     _NO_CLIENT_FIX)


def refusal(cfg: Config, exc: BaseException,
            environ: Mapping[str, str] | None = None) -> UserError | None:
    """The one-line UserError for a submission that sbatch refused or could not make
    (None: ``exc`` is not about the submission, let it through).

    When no controller answers ``scontrol ping`` that is the reason, whatever sbatch said;
    otherwise the message carries sbatch's own key line, not its whole stderr."""
    from submitit.core.utils import FailedJobError

    from hpc_ddp.launch.resolve import slurm_available

    environ = os.environ if environ is None else environ
    if isinstance(exc, FileNotFoundError) and "sbatch" in str(exc.filename or exc):
        return _no_client("sbatch")
    if isinstance(exc, RuntimeError) and 'detect "srun"' in str(exc):
        # submitit builds a plain SlurmExecutor (which wants srun here) for job arrays.
        return _no_client("srun")
    if not isinstance(exc, FailedJobError):
        return None
    said = sbatch_key_line(str(exc))
    if not slurm_available(environ):
        return UserError("cluster.kind", "slurm",
                         f"no Slurm controller answers (scontrol ping); sbatch said: "
                         f"{said.rstrip('.')}.",
                         _NO_CONTROLLER_FIX)
    if "temporarily unavailable" in said.lower():  # EAGAIN: slurmctld takes no more jobs now
        fix = ("the controller holds as many jobs as it takes (MaxJobCount in `scontrol show "
               "config`; finished jobs count for MinJobAge seconds) or is too busy: wait and "
               "submit again, or send fewer points at a time.")
    else:
        fix = ("check partition, account, nodes and GPUs against `sinfo` (and "
               "cluster.sbatch_extra, if set); `dry_run=true` prints the script.")
    return UserError("cluster", cfg.cluster.partition or "(default partition)",
                     f"sbatch refused the job: {said.rstrip('.')}.", fix)


def sbatch_key_line(stderr: str, limit: int = 300) -> str:
    """The line of sbatch's stderr that says why (``Batch job submission failed: ...`` or a
    fatal error), else its first error line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for marks in (("submission failed", "fatal"), ("error",)):
        for line in lines:
            if any(mark in line.lower() for mark in marks):
                return line[:limit]
    return (lines[0] if lines else "(no message)")[:limit]


@contextlib.contextmanager
def sbatch_errors(cfg: Config, environ: Mapping[str, str] | None = None) -> Iterator[None]:
    """Submissions inside turn sbatch's refusals into one-line UserErrors. submitit echoes
    sbatch's stderr itself; that echo is kept back on a refusal (the message has its key
    line) and passed on otherwise."""
    echoed = io.StringIO()
    refused = False
    try:
        with contextlib.redirect_stderr(echoed):
            yield
    except Exception as exc:
        error = refusal(cfg, exc, environ)
        if error is None:
            raise
        refused = True
        raise error from None
    finally:
        if not refused:
            sys.stderr.write(echoed.getvalue())


def submit(cfg: Config, run: RunDir, task: Callable[[], Any] | None = None,
           environ: Mapping[str, str] | None = None) -> Any:
    """Submit ``task`` (default: training) on every rank; returns submitit's SlurmJob."""
    environ = os.environ if environ is None else environ
    check_shell_safety(cfg)
    check_client(environ)
    executor = make_executor(cfg, run)
    with sbatch_errors(cfg, environ):
        return executor.submit(task or TrainingTask(to_yaml(cfg), str(run.root)))


def describe(cfg: Config) -> str:
    tasks = cfg.cluster.tasks_per_node or 1
    gpus = f", {cfg.cluster.gpus_per_node} GPUs/node" if cfg.cluster.gpus_per_node else ""
    return f"{cfg.nodes} node(s) x {tasks} task(s){gpus} = {cfg.nodes * tasks} ranks"
