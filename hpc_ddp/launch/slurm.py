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
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.config.compose import to_yaml
from hpc_ddp.config.sbatch_extra import check_sbatch_extra
from hpc_ddp.config.schema import ClusterConfig, Config
from hpc_ddp.config.secrets import shell_lines
from hpc_ddp.config.supervision import supervised, warm
from hpc_ddp.config.validate import SLURM_NAMED
from hpc_ddp.errors import UserError
from hpc_ddp.launch import container
from hpc_ddp.launch.target import counted
from hpc_ddp.rank.contract import JOB_END_ENV, WARM_ENV
from hpc_ddp.rank.main import submitted
from hpc_ddp.rank.main.task import training_task
from hpc_ddp.rank.services import early_signals
from hpc_ddp.rundir import RunDir
from hpc_ddp.slurm.refusal import no_client, refusal, sbatch_key_line

__all__ = ["check_client", "describe", "dry_run", "executor_parameters", "refusal", "render",
           "sbatch_key_line", "submit"]

# Slurm names and hostlists: letters, digits and the punctuation Slurm uses in them. Anything
# else (spaces, quotes, ;, $, backticks, newlines) is refused rather than passed to a shell.
_SLURM_WORD = re.compile(r"^[A-Za-z0-9_.,:\[\]\-+%@=|&!*()]+$")
# Environment variable submitit reads (in the tasks) to know which signal means "requeue";
# every task holds that signal from its start (rank/services/early_signals.py).
_SIGNAL_ENV = early_signals.SIGNAL_ENV


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


def executor_parameters(cfg: Config, run_root: Path | None = None,
                        points: Sequence[str] = ()) -> dict[str, Any]:
    """submitit SlurmExecutor parameters for ``cfg`` (pure; ``run_root``: the folder the
    container mounts as the run dir, launch/container.py; ``points``: a sweep's job array's
    run dirs under it, in task order)."""
    c: ClusterConfig = cfg.cluster
    task = container.command(cfg, run_root, sys.executable)
    params: dict[str, Any] = {
        "nodes": cfg.nodes,
        "ntasks_per_node": c.tasks_per_node,
        "cpus_per_task": c.cpus_per_task,
        "time": c.time_min,
        "job_name": c.job_name,
        "signal_delay_s": c.signal_delay_s,
        # The requeue signal (USR2 by default, see ClusterConfig.signal) for submitit in the
        # tasks, then the user's own setup lines (module load, conda activate ...).
        # ${oc.env:NAME} (a secret's reference, config/secrets.py) as the shell's ${NAME};
        # then the container and the environment activation, if any (launch/container.py).
        # Whether the ranks start warm (rank/warm/: one import of torch a node).
        "setup": [f"export {_SIGNAL_ENV}={shlex.quote(_bare_signal(c.signal))}",
                  f"export {WARM_ENV}={warm(cfg)}",
                  # When the job ends, for the ranks to tell a warning that never reached
                  # their step (rank/services/lost_signal.py).
                  f"export {JOB_END_ENV}=$(( $(date +%s) + {c.time_min * 60} ))",
                  *shell_lines(c.setup), *container.setup_lines(cfg, run_root)],
        "srun_args": [*srun_args(c), *container.srun_words(task)],
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
    if driven(cfg):
        # The job survives a lost node and its step runs again on the nodes left, a spare
        # among them (slurm/driver.py, docs/fault-tolerance.md#a-node-lost).
        params["nodes"] = cfg.nodes + c.spare_nodes
        params["additional_parameters"]["no_kill"] = True
        params["setup"].append(driver_line(cfg, task.argv(), run_root, points))
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


def driven(cfg: Config) -> bool:
    """The step runs under hpc_ddp's node-loss driver: supervised ranks (they leave a lost
    node to it) outside a container (the driver runs in the batch script, on the host)."""
    return supervised(cfg) and cfg.cluster.container.kind == "none"


def driver_line(cfg: Config, python: list[str], run_root: Path | None,
                points: Sequence[str] = ()) -> str:
    """The batch script's ``srun`` as a shell function that runs the driver, which runs the
    real srun (a subprocess: the function is the shell's own). Where the driver cannot
    start on the batch host (an environment that does not activate there), the real srun
    runs as before, and each task says what is wrong with its node. In a sweep's array
    (``points``) each task's driver acts on its own point's events.jsonl, as its ranks do."""
    c = cfg.cluster
    tasks = c.tasks_per_node or 1  # derived before submission (launch/resolve.py)
    argv = [*python, "-m", "hpc_ddp.slurm.driver", f"--nodes={cfg.nodes}",
            f"--tasks-per-node={tasks}", f"--budget={c.restarts_in_place}",
            *([f"--min-nodes={c.min_nodes}"] if c.min_nodes is not None else []),
            *([f"--run-dir={run_root}"] if run_root is not None else []),
            *([f"--points={','.join(points)}"] if points else [])]
    probe = shlex.join([*python, "-c", "import hpc_ddp.slurm.driver"])
    plain = f"--nodes={cfg.nodes} --ntasks={cfg.nodes * tasks}"  # not the spares
    return (f"srun() {{ if {probe} >/dev/null 2>&1; then {shlex.join(argv)} -- \"$@\"; "
            f"else command srun {plain} \"$@\"; fi; }}")


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
    import submitit  # deferred: submitit

    class Executor(submitit.SlurmExecutor):  # type: ignore[misc]
        """submitit's Slurm executor without its "srun on PATH" test at construction: a dry
        run needs no Slurm, and ``submit`` checks for sbatch itself (srun runs on the nodes,
        not where the job is submitted). The script and the submission are submitit's own."""

        @classmethod
        def affinity(cls) -> int:
            return 2

    return Executor


def make_executor(cfg: Config, run: RunDir, points: Sequence[str] = ()) -> Any:
    """submitit's SlurmExecutor for ``cfg``; builds on a machine without Slurm too.
    ``points``: a sweep's job array (``run`` its folder): its tasks' run dirs in order."""
    python = container.node_python(cfg, sys.executable)
    # Each task loads its pickle only once it passed the ownership checks (rank/main/submitted.py).
    executor = _executor_class()(folder=str(run.submitit / "%j"),
                                 max_num_timeout=cfg.cluster.max_restarts,
                                 python=f"{shlex.quote(python)} -m {submitted.MODULE}")
    executor.update_parameters(**executor_parameters(cfg, run.root, points))
    return executor


def render(cfg: Config, run: RunDir) -> str:
    """The exact sbatch script ``submit`` would hand to sbatch."""
    return submission_text(make_executor(cfg, run), "dry-run")


def submission_text(executor: Any, uid: str) -> str:
    """The sbatch script ``executor`` would submit. submitit has no public call for it, so this
    is the one place that uses its private ``_make_submission_file_text`` (and
    ``_submitit_command_str``), as of submitit 1.5.4, the version pyproject.toml pins: a dry
    run must show exactly what would be submitted, which a script of our own could not
    promise. tests/cluster/test_slurm_submit.py checks the text against what sbatch received."""
    return str(executor._make_submission_file_text(executor._submitit_command_str, uid))


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
        raise no_client("sbatch")


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
    """Submit ``task`` (default: training) on every rank; returns submitit's SlurmJob.
    A job that could never start is refused first (one sinfo call, slurm_fit)."""
    from hpc_ddp.slurm import fit as slurm_fit  # deferred (start-up): slurm.fit

    environ = os.environ if environ is None else environ
    check_shell_safety(cfg)
    check_client(environ)
    slurm_fit.check([cfg], environ)
    executor = make_executor(cfg, run)
    with sbatch_errors(cfg, environ):
        return executor.submit(task or training_task(to_yaml(cfg), str(run.root)))


def describe(cfg: Config) -> str:
    tasks = cfg.cluster.tasks_per_node or 1
    gpus = f", {cfg.cluster.gpus_per_node} GPUs/node" if cfg.cluster.gpus_per_node else ""
    return (f"{counted(cfg.nodes, 'node')} x {counted(tasks, 'task')}{gpus} = "
            f"{counted(cfg.nodes * tasks, 'rank')}")
