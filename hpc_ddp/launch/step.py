"""Run the job as a step of the Slurm allocation this shell is in (``salloc``, ``sbatch``,
``srun --pty bash``): srun with the run's nodes and tasks, no new job, no queue wait.

``cluster=auto`` chooses this inside an allocation (a nested ``sbatch`` would queue a second
job behind the one the user already waits in); ``cluster=step`` asks for it. The submitting
command follows the step like a local run: Ctrl-C stops it with a checkpoint (srun forwards
SIGTERM to every task), and a stop is not requeued — an interactive allocation cannot be
requeued, and a batch script that runs ``submit`` would start a new run when requeued;
``jobs/train.sbatch`` is the requeueing form. Every task runs ``python -m
hpc_ddp.rank.main.step``, which unpickles the same task a submitit job runs.

The pure parts (``allocation``, ``check``, ``command``) are table-tested; the step itself is
proven on the test cluster (tests/cluster/test_layouts.py).
"""

from __future__ import annotations

import os
import pickle
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp import hostlist
from hpc_ddp.config.schema import Config
from hpc_ddp.config.secrets import shell_lines
from hpc_ddp.config.supervision import warm
from hpc_ddp.errors import UserError
from hpc_ddp.launch.target import counted
from hpc_ddp.procs import pid_alive, start_time
from hpc_ddp.rank.contract import STEP_OF_ENV, TASK_ENV, WARM_ENV
from hpc_ddp.rundir import RunDir, read_json

# The batch script runs as a step of this name (or number) in some versions: not a step
# whose resources a new step must share.
_NOT_STEPS = ("batch", "extern", "4294967291", "4294967292")


@dataclass(frozen=True)
class Allocation:
    """The Slurm allocation a shell is in, as its environment describes it."""

    job_id: str
    nodes: tuple[str, ...]
    # CPUs allocated on each node, in node order (SLURM_JOB_CPUS_PER_NODE).
    cpus: tuple[int, ...]
    # GPUs per node when the allocation says (salloc/sbatch --gpus-per-node); None: unknown.
    gpus_per_node: int | None
    # This shell is itself a step's task (srun --pty bash): a new step must share its
    # resources (--overlap), or it waits for them forever.
    in_step: bool


def allocation(environ: Mapping[str, str]) -> Allocation | None:
    """The allocation of ``environ`` (None outside one). Variables:
    https://slurm.schedmd.com/salloc.html#SECTION_OUTPUT-ENVIRONMENT-VARIABLES"""
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not job or not nodelist:
        return None
    try:
        nodes = tuple(hostlist.expand(nodelist))
        spec = environ.get("SLURM_JOB_CPUS_PER_NODE", "")
        cpus = tuple(hostlist.tasks_per_node(spec)) if spec else ()
    except ValueError:
        return None
    if len(cpus) == 1 and len(nodes) > 1:
        cpus = cpus * len(nodes)
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    gpus = environ.get("SLURM_GPUS_PER_NODE", "").rpartition(":")[2]
    return Allocation(job, nodes, cpus, int(gpus) if gpus.isdigit() else None,
                      in_step=step is not None and step not in _NOT_STEPS)


def no_allocation_error() -> UserError:
    return UserError("cluster.kind", "step", "runs the job as a step of the Slurm allocation "
                     "this shell is in, and it is in none (no SLURM_JOB_ID).",
                     "run it inside `salloc -N<nodes>` (or an sbatch script), or use "
                     "cluster=slurm to submit a job.")


def check(cfg: Config, alloc: Allocation) -> None:
    """What the step asks for fits the allocation (else one line and the fix; srun would wait
    or fail with "more processors requested than permitted")."""
    c = cfg.cluster
    have = len(alloc.nodes)
    if cfg.nodes > have:
        raise UserError("nodes", cfg.nodes, f"this shell is in Slurm allocation "
                        f"{alloc.job_id} of {have} node(s), and a step of it cannot span more.",
                        f"use nodes={have} or fewer, or cluster=slurm to submit a new job of "
                        f"{cfg.nodes} nodes.")
    need = (c.tasks_per_node or 1) * c.cpus_per_task
    if alloc.cpus and sum(n >= need for n in alloc.cpus) < cfg.nodes:
        raise UserError("cluster.tasks_per_node", c.tasks_per_node,
                        f"{c.tasks_per_node} task(s) x cluster.cpus_per_task={c.cpus_per_task} "
                        f"need {need} CPUs on each of {cfg.nodes} node(s), and allocation "
                        f"{alloc.job_id} has {max(alloc.cpus)} at most on a node.",
                        "ask for fewer tasks or CPUs per task, or allocate more "
                        "(salloc --ntasks-per-node=T --cpus-per-task=C).")
    gpus = c.gpus_per_node or 0
    if gpus and alloc.gpus_per_node is not None and gpus > alloc.gpus_per_node:
        raise UserError("cluster.gpus_per_node", gpus, f"allocation {alloc.job_id} has "
                        f"{alloc.gpus_per_node} GPU(s) per node.",
                        f"use cluster.gpus_per_node={alloc.gpus_per_node} or fewer.")


def command(cfg: Config, alloc: Allocation, python: str,
            run_root: Path | None = None) -> list[str]:
    """The srun command line of the step (pure). Slurm options a step takes from the run's
    config; partition, account, time and the like belong to the allocation. ``python``: the
    default interpreter; a container or an environment to activate (launch/container.py,
    mounting ``run_root``) comes between srun's options and it."""
    from hpc_ddp.launch import container  # deferred (start-up): launch.container

    c = cfg.cluster
    tasks = c.tasks_per_node or 1
    argv = ["srun", f"--nodes={cfg.nodes}", f"--ntasks={cfg.nodes * tasks}",
            f"--ntasks-per-node={tasks}", f"--cpus-per-task={c.cpus_per_task}",
            # One failed task ends the step (the others would wait in a collective).
            "--kill-on-bad-exit=1", f"--job-name={c.job_name}",
            # The stop signal ahead of the allocation's end, to every task of the step
            # (https://slurm.schedmd.com/srun.html#OPT_signal): checkpoint, then stop.
            f"--signal={c.signal.removeprefix('SIG')}@{c.signal_delay_s}"]
    if c.gpus_per_node:
        argv.append("--gpus-per-task=1" if c.gpu_binding == "per_task"
                    else f"--gpus-per-node={c.gpus_per_node}")
    if c.mem_gb:
        argv.append(f"--mem={int(c.mem_gb * 1024)}M")
    if c.nodelist:
        argv.append(f"--nodelist={c.nodelist}")
    if c.exclude:
        argv.append(f"--exclude={c.exclude}")
    if alloc.in_step:
        # This shell's own step holds CPUs of its node; without --overlap (Slurm 20.11+) the
        # new step waits for them (https://slurm.schedmd.com/srun.html#OPT_overlap).
        argv.append("--overlap")
    task = container.command(cfg, run_root, python)
    return [*argv, *c.srun_args, *container.srun_words(task), task.python, "-u", "-m",
            "hpc_ddp.rank.main.step"]


def step_environment(environ: Mapping[str, str], alloc: Allocation,
                     task_file: Path) -> dict[str, str]:
    """srun's environment (which every task inherits): this shell's, without the CPU binding
    of the shell's own step (srun would bind every task to that step's cores), plus the task
    to run and the allocation it belongs to."""
    env = {k: v for k, v in environ.items() if not k.startswith("SLURM_CPU_BIND")}
    env.update({TASK_ENV: str(task_file), STEP_OF_ENV: alloc.job_id})
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def current(environ: Mapping[str, str] | None = None) -> Allocation:
    found = allocation(os.environ if environ is None else environ)
    if found is None:
        raise no_allocation_error()
    return found


def submit(cfg: Config, run: RunDir, task: Callable[[], Any] | None = None) -> StepHandle:
    """Start the step (srun in its own session: the terminal's Ctrl-C reaches this process,
    which stops the step properly); returns its handle at once."""
    # deferred: hostlist; start-up: config.compose
    from hpc_ddp.config.compose import to_yaml
    from hpc_ddp.rank.main.task import training_task

    alloc = current()
    check(cfg, alloc)
    run.submitit.mkdir(parents=True, exist_ok=True)
    task_file = run.submitit / f"step-{uuid.uuid4().hex[:12]}.pkl"
    with open(task_file, "wb") as handle:
        pickle.dump(task or training_task(to_yaml(cfg), str(run.root)), handle)
    from hpc_ddp.launch import container  # deferred (start-up): launch.container

    argv = command(cfg, alloc, sys.executable, run.root)
    # The lines an sbatch script runs before its srun: the user's, then the container's
    # environment and Slurm's relay for the ranks inside it (for as long as srun runs).
    # ${oc.env:NAME} (a secret's reference, config/secrets.py) as the shell's ${NAME}.
    lines = [*shell_lines(cfg.cluster.setup), *container.setup_lines(cfg, run.root)]
    if lines:
        argv = ["bash", "-c", "set -e\n" + "\n".join(lines) + '\nexec "$@"',
                "hpc_ddp-step", *argv]
    output = open(task_file.with_suffix(".out"), "ab")  # noqa: SIM115 (srun's, closed below)
    try:
        env = {**step_environment(os.environ, alloc, task_file), WARM_ENV: warm(cfg)}
        proc = subprocess.Popen(argv, env=env,
                                stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                                start_new_session=True, cwd=Path.cwd())
    except OSError as exc:
        raise UserError("cluster.kind", "step", f"srun could not start ({exc}).",
                        "check that Slurm's client tools are on PATH.") from None
    finally:
        output.close()
    return StepHandle(proc, alloc.job_id, task_file.with_suffix(".out"))


class StepHandle:
    """The running step as the API sees a local job: a process of this machine (srun)."""

    def __init__(self, proc: subprocess.Popen[bytes], job_id: str, output: Path) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.started = start_time(proc.pid)
        self.job_id = job_id
        self.output = output
        self.submitted = time.time()

    def done(self) -> bool:
        return self.proc.poll() is not None

    def cancel(self, check: bool = False, grace_s: float = 0.0) -> None:
        stop(RunDir(self.output.parent.parent), self.pid, self.started, grace_s,
             self.submitted)


def stop(run: RunDir, pid: int, started: int | None, grace_s: float, since: float,
         environ: Mapping[str, str] | None = None) -> None:
    """Stop a step properly: SIGTERM to its tasks only (``scancel --signal=TERM JOB.STEP``),
    which agree on a step, checkpoint and exit; srun itself would answer a SIGTERM by killing
    them ("forcing job termination"). Whatever still runs after ``grace_s`` is ended by
    ending srun. The step's id is what rank 0 recorded (once it joined)."""
    from hpc_ddp.launch.local import stop as end_process  # deferred: hostlist

    record = _rank0_record(run, since)
    step = str(record.get("job_id", "")) if record else ""
    if grace_s > 0 and "." in step and pid_alive(pid, started):
        try:
            subprocess.run(["scancel", "--signal=TERM", step], capture_output=True, timeout=30,
                           check=False, env=dict(os.environ if environ is None else environ))
        except (OSError, subprocess.TimeoutExpired):
            pass
        else:
            deadline = time.monotonic() + grace_s
            while pid_alive(pid, started) and time.monotonic() < deadline:
                time.sleep(0.2)
    end_process(pid, started, 0.0 if "." in step else grace_s)


def _rank0_record(run: RunDir, since: float) -> dict[str, Any] | None:
    """Rank 0's record of this step (not one an earlier step of the run dir left)."""

    path = run.ranks / "rank0.json"
    try:
        if path.stat().st_mtime < since:
            return None
    except OSError:
        return None
    found = read_json(path)
    return found if isinstance(found, dict) else None


def describe(cfg: Config) -> str:
    c = cfg.cluster
    alloc = allocation(os.environ)
    where = f"allocation {alloc.job_id} ({len(alloc.nodes)} nodes)" if alloc else "allocation"
    on = "a GPU each with NCCL" if c.gpus_per_node and cfg.trainer.device != "cpu" else (
        "CPU with gloo")
    tasks = c.tasks_per_node or 1
    return (f"{counted(cfg.nodes * tasks, 'rank')} on {counted(cfg.nodes, 'node')} x "
            f"{counted(tasks, 'task')}, on {on}, as a step of this shell's Slurm "
            f"{where}: no new job, no queue wait")


def dry_run(cfg: Config, run: RunDir) -> str:
    alloc = current()
    check(cfg, alloc)
    argv = command(cfg, alloc, sys.executable, run.root)
    return (f"would run {describe(cfg)}, into {run.root}:\n  {shlex.join(argv)}\n"
            "nothing was started.")
