"""Run the job on this machine through submitit's local executor.

submitit's local executor supports a single node; ``nodes`` > 1 is simulated by running all
the nodes' ranks here (node rank = rank // tasks_per_node), which exercises the same
multi-node code paths with gloo on loopback.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.config.compose import to_yaml
from hpc_ddp.config.schema import Config
from hpc_ddp.config.supervision import warm
from hpc_ddp.launch.target import counted
from hpc_ddp.procs import pid_alive, start_time
from hpc_ddp.rank.contract import LAUNCH_ID_ENV, WARM_ENV, WARM_KEEP_ENV
from hpc_ddp.rank.join.device import visible_devices
from hpc_ddp.rank.main import submitted
from hpc_ddp.rank.main.task import training_task
from hpc_ddp.rundir import RunDir


def executor_parameters(cfg: Config, environ: Mapping[str, str]) -> dict[str, Any]:
    """submitit LocalExecutor parameters for ``cfg`` launched from ``environ`` (pure)."""
    tasks = cfg.nodes * (cfg.cluster.tasks_per_node or 1)
    params: dict[str, Any] = {"tasks_per_node": tasks, "timeout_min": cfg.cluster.time_min,
                              "signal_delay_s": cfg.cluster.signal_delay_s}
    gpus = (cfg.cluster.gpus_per_node or 0) * cfg.nodes
    if gpus:
        params["gpus_per_node"] = gpus
        # submitit sets the ranks' CUDA_VISIBLE_DEVICES to 0..N-1 of the whole machine; where
        # this shell was given other GPUs (a shared box, an salloc), hand on those instead.
        given = visible_devices(environ)
        if given is not None:
            if all(d.isdigit() for d in given):
                params["visible_gpus"] = tuple(int(d) for d in given)
            else:  # UUIDs / MIG ids: submitit takes only indices, so set the variable itself
                chosen = shlex.quote(",".join(given[:gpus]))
                params["setup"] = [f"export CUDA_VISIBLE_DEVICES={chosen}"]
    return params


def submit(cfg: Config, run: RunDir, task: Callable[[], Any] | None = None) -> Any:
    """Start ``task`` (default: training) on every rank; returns submitit's LocalJob."""
    import submitit  # deferred: submitit

    # Each task loads its pickle only once it passed the ownership checks (rank/main/submitted.py).
    executor = submitit.LocalExecutor(
        folder=str(run.submitit), python=f"{shlex.quote(sys.executable)} -m {submitted.MODULE}")
    executor.update_parameters(**executor_parameters(cfg, os.environ))

    ranks_env = {**outside_slurm(os.environ), LAUNCH_ID_ENV: uuid.uuid4().hex[:12],
                 WARM_ENV: warm(cfg), WARM_KEEP_ENV: f"{cfg.cluster.warm_keep_s:g}"}
    session = _own_session(run.logs / "launcher.log") if cfg.detach else \
        contextlib.nullcontext()
    with _terminal_interrupt_ignored(), _environ(ranks_env), session:
        return LocalJobHandle(executor.submit(task or training_task(to_yaml(cfg),
                                                                    str(run.root))))


@contextlib.contextmanager
def _own_session(log: Path) -> Iterator[None]:
    """detach=true: submitit's controller, and so every rank under it, starts in a session
    of its own with no terminal (stdin /dev/null, its output into ``log``): a logout's SIGHUP
    and a closed terminal never reach it (https://man7.org/linux/man-pages/man2/setsid.2.html).
    submitit starts the controller with a plain ``subprocess.Popen`` (local.start_controller);
    its module sees this Popen meanwhile. The command is single-threaded here."""
    import submitit.local.local as submitit_local  # deferred: submitit

    real = submitit_local.subprocess
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:

        class _Detached:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            @staticmethod
            def Popen(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 (subprocess's name)
                kwargs.update(start_new_session=True, stdin=real.DEVNULL, stdout=out,
                              stderr=real.STDOUT)
                return real.Popen(*args, **kwargs)

        setattr(submitit_local, "subprocess", _Detached())  # noqa: B010 (a module's name)
        try:
            yield
        finally:
            setattr(submitit_local, "subprocess", real)  # noqa: B010


def outside_slurm(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment local ranks start with: this shell's, less Slurm's description of a job
    and step. Started from an salloc shell or an `srun --pty bash` on a compute node, the ranks
    would otherwise read SLURM_PROCID=0 and SLURM_NTASKS and each believe it is "rank 0 of 1",
    or requeue the allocation around them. SLURM_CONF (where the controller is) stays."""
    return {k: v for k, v in environ.items()
            if not (k.startswith(("SLURM_", "SLURMD_")) and k != "SLURM_CONF")}


@contextlib.contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """os.environ is ``values`` meanwhile (submitit's local executor hands os.environ on)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class LocalJobHandle:
    """submitit's LocalJob, whose cancel() works on a controller that ignores SIGINT."""

    def __init__(self, job: Any) -> None:
        self._job = job
        self.pid = int(job.job_id)  # submitit's local job id is the controller's pid
        self.started = start_time(self.pid)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._job, name)

    def cancel(self, check: bool = False, grace_s: float = 0.0) -> None:
        stop(self.pid, self.started, grace_s)


@contextlib.contextmanager
def _terminal_interrupt_ignored() -> Iterator[None]:
    """Start the job with SIGINT ignored, which its processes inherit (and Python keeps).

    Ctrl-C goes to the terminal's whole process group: submitit's controller would answer it
    by killing the ranks a second later, with no checkpoint. Ignored there, Ctrl-C reaches
    only this process, which asks the ranks to stop properly (stop()).
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be changed from the main thread
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def stop(pid: int, started: int | None, grace_s: float) -> None:
    """Stop a local job: SIGTERM to its controller, which forwards it to every rank (they
    agree on a step, checkpoint and exit); whatever still runs after ``grace_s`` is killed."""
    import psutil  # deferred: psutil

    if not pid_alive(pid, started):
        return
    try:
        controller = psutil.Process(pid)
        # Not a process in a session of its own: a kept warm process (rank/warm/kept.py) that
        # a task of this job started outlives the job for the next run, and serves others.
        session = os.getsid(pid)
        procs = [controller, *(p for p in controller.children(recursive=True)
                               if _in_session(p, session))]
        # With a setup line the pid is the shell's (submitit runs `bash -c "setup && ..."`),
        # which would not pass SIGTERM on: the submitit controller under it gets it too.
        for proc in [controller, *(p for p in controller.children() if _is_controller(p))]:
            proc.terminate()
    except (psutil.NoSuchProcess, ProcessLookupError):
        return
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=10)


def _in_session(proc: Any, session: int) -> bool:
    try:
        return os.getsid(proc.pid) == session
    except OSError:  # gone already
        return False


def _is_controller(proc: Any) -> bool:
    import psutil  # deferred: psutil

    try:
        return "submitit.local._local" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def describe(cfg: Config) -> str:
    tasks = cfg.cluster.tasks_per_node or 1
    gpus = cfg.cluster.gpus_per_node or 0
    on = "on a GPU each with NCCL" if gpus and cfg.trainer.device != "cpu" else (
        "on CPU with gloo")
    if cfg.nodes > 1:
        return (f"{cfg.nodes * tasks} ranks on this machine {on}, simulating {cfg.nodes} "
                f"nodes x {counted(tasks, 'task')} (submitit's local executor runs one node)")
    return f"{counted(tasks, 'rank')} on this machine {on}"


def dry_run(cfg: Config, run: RunDir) -> str:
    params = ", ".join(f"{k}={v}" for k, v in executor_parameters(cfg, os.environ).items())
    return (f"would run {describe(cfg)} with submitit.LocalExecutor({params}) into {run.root}; "
            "nothing was started.")
