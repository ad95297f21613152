"""One rank joining its job: environment -> logging -> NCCL -> device -> rendezvous -> group.

``joined`` is the context every per-rank program runs in (training, the doctor, the
benchmarks): on entry the process group exists and the rank is recorded in the run dir; on
every exit path a failure is recorded for ``follow`` and the group is destroyed.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import sys
import time
import traceback
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

from hpc_ddp.config import secrets
from hpc_ddp.config.schema import Config
from hpc_ddp.errors import UserError
from hpc_ddp.owned import Untrusted
from hpc_ddp.rank.contract import (
    COLD_NOTE,
    CONTAINER_ENV,
    PROGRAM_CONFIG_ENV,
    STORE_KEY_ENV,
    WARM_NOTE_ENV,
)
from hpc_ddp.rank.join import checkin, envcheck, nccl, netif, owner, ranklog, rendezvous, tracebacks
from hpc_ddp.rank.join.device import DeviceError, gpu_allocated, select, slurm_gpus
from hpc_ddp.rank.join.distenv import DistEnv, detect
from hpc_ddp.rank.services import rng, stacks
from hpc_ddp.rundir import RunDir, read_json, write_json, write_text

log = logging.getLogger(__name__)


class RunRefused(RuntimeError):
    """Rank 0 refused to start the run (another live job writes its run dir)."""


class RunStopped(SystemExit):
    """The run stopped before its end without being requeued; the message says how to go on.

    ``requested``: the stop someone asked for (Ctrl-C, a cancel, a signal by hand), logged as
    a stop, not as a failure; otherwise (no requeue left) it is recorded as the run's error.
    """

    def __init__(self, message: str, requested: bool = False) -> None:
        super().__init__(1)
        self.message = message
        self.requested = requested

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Rank:
    env: DistEnv
    host: str
    device: Any
    env_changes: list[nccl.EnvChange]
    # The rendezvous store (lives in rank 0's process); used to tell who is still alive.
    store: Any = None
    # The GPU this rank was given (device.select), as recorded in ranks/rank<N>.json.
    gpu: dict[str, Any] | None = None
    # Where the store listens (rank 0's address and port): MASTER_ADDR/MASTER_PORT for code
    # that reads the torchrun variables.
    endpoint: rendezvous.Endpoint | None = None
    # This rank's software fingerprint (envcheck.Fingerprint.summary), with "mixed": the
    # differences between nodes that cluster.allow_mixed_env=true let through.
    environment: dict[str, Any] | None = None

    def torchrun_env(self) -> dict[str, str]:
        """The variables torchrun gives its workers, for this rank (a function entry's
        process gets them; a script's process gets them as its environment)."""
        env = self.env
        values = {"RANK": env.rank, "LOCAL_RANK": env.local_rank,
                  "WORLD_SIZE": env.world_size, "LOCAL_WORLD_SIZE": env.local_world_size,
                  "GROUP_RANK": env.node_rank, "NODE_RANK": env.node_rank,
                  "ROLE_RANK": env.rank, "ROLE_WORLD_SIZE": env.world_size,
                  # Every start of the training after the first, requeues and restarts in
                  # place (a script that resumes when it is > 0 resumes after both).
                  "TORCHELASTIC_RESTART_COUNT": env.restart + env.generation,
                  "TORCHELASTIC_RUN_ID": env.job_id}
        if self.endpoint is not None:
            values.update(MASTER_ADDR=self.endpoint.addr, MASTER_PORT=self.endpoint.port)
        return {k: str(v) for k, v in values.items()}


@contextmanager
def joined(cfg: Config, run_dir: RunDir, environ: MutableMapping[str, str],
           group: bool = True) -> Iterator[Rank]:
    """Set this process up as one rank of the job; yields once the process group exists.

    ``group`` false: stop at the store (a supervisor: its child, or a script, makes the
    process group, and this process never touches the GPU); such a process imports no torch
    (one interpreter a rank imports it, not two: the store's client is plain Python, the
    software fingerprint read from files, the GPU chosen by the child).
    """
    env = detect(environ, cfg.cluster.tasks_per_node)
    host = socket.gethostname()
    try:
        ranklog.setup(run_dir.rank_log(env.rank), env.rank, host, echo=env.is_master,
                      marks=secrets.marks_of(cfg), env=env, environ=environ)
        if group:  # the training process (not a supervisor): its stacks on request
            # How this process started (rank/warm/): forked warm, or cold and why.
            log.info("start: %s", environ.get(WARM_NOTE_ENV) or COLD_NOTE)
            stacks.enable(run_dir.logs / f"rank{env.rank}.stacks", stacks.stack_signal(
                cfg.cluster.signal))
    except (UserError, Untrusted) as exc:
        _refuse(run_dir, env, environ, exc)
    run_dir.rank_error(env.rank).unlink(missing_ok=True)
    try:
        changes = nccl.apply(cfg.nccl, environ)
        if nccl.flight_recorder_on(environ) and not any(
                name in environ for name in nccl.FLIGHT_RECORDER_FILE):
            # Its dumps with the run's logs, named in the failure report.
            environ[nccl.FLIGHT_RECORDER_FILE[0]] = str(run_dir.logs /
                                                        nccl.FLIGHT_RECORDER_PREFIX)
        if cfg.trainer.deterministic:
            # cuBLAS is deterministic only with a fixed workspace, read when its first handle
            # is made: before any CUDA work (https://docs.nvidia.com/cuda/cublas/#results-reproducibility).
            environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        device, gpu = choose_device(cfg, env, environ) if group else (None, gpu_record(environ))
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        if group:
            _prepare_torch(cfg, environ)
        software = envcheck.fingerprint(load=group)
        store, endpoint = rendezvous.connect(
            env, run_dir.rendezvous, host, cfg.trainer.rendezvous_timeout_s,
            cfg.trainer.collective_timeout_s,
            # "node": Slurm's name of it (a supervisor that asks Slurm whether the node of
            # a silent rank is still the job's: supervise/generations.py).
            {"host": host, "node": environ.get("SLURMD_NODENAME") or host, **gpu,
             envcheck.RECORD_KEY: software.digest},
            agent_store=_agent_store(environ), master_interface=cfg.cluster.master_interface,
            store_key=environ.pop(STORE_KEY_ENV, None), plain=not group)
        claim_run_dir(run_dir, env, host, environ, store)
        # The same software on every node, or stop here: before any training step.
        mixed = envcheck.check(store, env, software, checkin.placements(
            store, env.world_size) if env.is_master else None, cfg.cluster.allow_mixed_env,
            cfg.trainer.rendezvous_timeout_s)
        if backend == "gloo" and env.world_size > 1:
            _choose_gloo_interface(env, endpoint.addr, host, environ)
        if group:
            import torch.distributed as dist  # deferred: torch

            dist.init_process_group(backend, store=store, rank=env.rank,
                                    world_size=env.world_size,
                                    timeout=timedelta(seconds=cfg.trainer.collective_timeout_s),
                                    device_id=device if backend == "nccl" else None)
        _record_rank(run_dir, env, host, gpu, environ, changes, software, group)
        yield Rank(env, host, device, changes, store, gpu, endpoint,
                   {**software.summary(), "mixed": mixed})
    except BaseException as exc:
        _record_failure(run_dir, env, host, exc)
        raise
    finally:
        if group:
            import torch.distributed as dist  # deferred: torch

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        _record_usage(run_dir, env)


def _record_usage(run_dir: RunDir, env: DistEnv) -> None:
    """This rank's CPU time, its own and its children's (a script under its supervisor), kept
    per attempt (a resume is a new job, a requeue a new start of it): what a local run's cost
    counts, every attempt's (hpc_ddp/watch/runcost.py, docs/observability.md)."""
    me, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                          resource.RUSAGE_CHILDREN))
    cpu = me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime
    path = run_dir.rank_usage(env.rank)
    try:
        found = read_json(path)
        attempts = found.get("attempts", {}) if isinstance(found, dict) else {}
        attempts[f"{env.job_id}.{env.restart}"] = {"cpu_s": round(cpu, 3), "time": time.time()}
        write_json(path, {"attempts": attempts})
    except OSError:
        pass


def threads_for(cfg: Config, environ: MutableMapping[str, str]) -> int:
    """Intra-op threads: trainer.threads, else the CPUs Slurm gave the task, else the config's."""
    if cfg.trainer.threads:
        return cfg.trainer.threads
    slurm = environ.get("SLURM_CPUS_PER_TASK", "")
    return int(slurm) if slurm.isdigit() and int(slurm) > 0 else cfg.cluster.cpus_per_task


def gpu_record(environ: MutableMapping[str, str]) -> dict[str, Any]:
    """A supervisor's record of its task's GPUs: what Slurm or the launcher gave it; the GPU
    is chosen, and recorded, by the training process under it (choose_device)."""
    allocated = slurm_gpus(environ) or (
        f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']}" if gpu_allocated(environ)
        else None)
    return {"cuda_visible_devices": environ.get("CUDA_VISIBLE_DEVICES"),
            "slurm_allocation": allocated, "compute": "its training process's"}


def choose_device(cfg: Config, env: DistEnv, environ: MutableMapping[str, str],
                   use: bool = True) -> tuple[Any, dict[str, Any]]:
    """The torch device and the record of the GPU this rank was given (rank -> node -> GPU).
    ``use`` false: choose and record, but leave CUDA alone (no context is made here)."""
    import torch  # deferred: torch

    allocated = slurm_gpus(environ) or (
        f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']}" if gpu_allocated(environ)
        else None)
    record: dict[str, Any] = {"cuda_visible_devices": environ.get("CUDA_VISIBLE_DEVICES"),
                              "slurm_allocation": allocated, "compute": "cpu"}
    has_cuda = torch.cuda.is_available()
    wanted = cfg.trainer.device
    if wanted == "cuda" or (wanted == "auto" and (allocated or (
            has_cuda and env.source in ("single", "torchrun")))):
        if not has_cuda:
            hidden = environ.get("CUDA_VISIBLE_DEVICES") == ""
            why = ("CUDA_VISIBLE_DEVICES is empty, which hides every GPU: the launcher gave "
                   "this task none. Ask for GPUs (cluster.gpus_per_node=N)" if hidden else
                   "a CPU-only torch build or a driver that does not match. Fix the "
                   "environment on that node")
            raise DeviceError(  # the error file and the log name the rank and the host
                (f"Slurm allocated a GPU ({allocated})" if slurm_gpus(environ) else
                 f"this task was given a GPU ({allocated})" if allocated else
                 "trainer.device=cuda was asked for")
                + f" but torch {torch.__version__} sees no CUDA device (torch.version.cuda="
                f"{torch.version.cuda}): {why}, or choose trainer.device=cpu explicitly.")
        choice = select(environ, env.local_rank, env.local_world_size, torch.cuda.device_count())
        assert choice is not None  # has_cuda: at least one device
        device = torch.device("cuda", choice.index)
        record.update(choice.as_dict(), compute="cuda")
        if not use:
            return device, record
        torch.cuda.set_device(choice.index)
        props = torch.cuda.get_device_properties(device)
        record.update(choice.as_dict(), compute="cuda", name=props.name,
                      uuid=str(getattr(props, "uuid", "")),
                      pci_bus_id=getattr(props, "pci_bus_id", None))
        return device, record
    if allocated:
        # CPU compute chosen on GPUs Slurm allocated: record what the rank would use, and
        # let the summary flag two ranks on one GPU instead of failing the run.
        try:
            choice = select(environ, env.local_rank, env.local_world_size)
            record.update(choice.as_dict() if choice else {})
        except DeviceError as exc:
            record["problem"] = str(exc)
    return torch.device("cpu"), record


def _prepare_torch(cfg: Config, environ: MutableMapping[str, str]) -> None:
    import torch  # deferred: torch

    torch.set_num_threads(threads_for(cfg, environ))
    rng.deterministic_kernels(cfg.trainer.deterministic)


def _refuse(run_dir: RunDir, env: DistEnv, environ: MutableMapping[str, str],
            exc: UserError | Untrusted) -> NoReturn:
    """A rank log or stacks file planted as a link or someone else's (owned.open_append)
    stops this rank before the rendezvous. Rank 0 publishes why where the others look for its
    address (a requeue that no submission checked first: inputs/run_dir.check_run_files), so
    they stop within seconds with its reason, not after trainer.rendezvous_timeout_s."""
    error = exc if isinstance(exc, UserError) else UserError("run_dir", str(run_dir.root),
                                                               str(exc), "")
    if env.is_master and _agent_store(environ) is None:
        try:
            rendezvous.publish_refusal(rendezvous.endpoint_file(run_dir.rendezvous, env),
                                       error.message)
        except OSError:  # the others then wait for rank 0 as before
            pass
    raise error from None


def _agent_store(environ: MutableMapping[str, str]) -> str | None:
    """Whose store the ranks join, if not one of their own (rendezvous.connect)."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None

    return "supervisor" if PROGRAM_CONFIG_ENV in environ else "torchrun"


def claim_run_dir(run_dir: RunDir, env: DistEnv, host: str,
                   environ: MutableMapping[str, str], store: Any) -> None:
    """Rank 0 claims the run dir for this job (rank/join/owner.py) and tells the others through the
    store, so a second job on the same run dir stops at start, every rank with rank 0's reason
    (one squeue call by rank 0, one store read per rank)."""
    key = "hpc_ddp/run_dir_refused"
    if env.is_master:
        try:
            owner.claim(run_dir.root, owner.me(environ, host), host, environ)
        except UserError as exc:
            store.set(key, exc.message)
            raise
        store.set(key, "")
        return
    refused = bytes(store.get(key)).decode()
    if refused:
        raise RunRefused(refused)


def _choose_gloo_interface(env: DistEnv, master: str, host: str,
                           environ: MutableMapping[str, str]) -> None:
    """Gloo binds to the address its hostname resolves to, which on many nodes is not the
    interface that reaches the other nodes (or is 127.0.1.1): set GLOO_SOCKET_IFNAME to the
    one towards rank 0's published address (read when the process group is made), unless the
    user set it. https://pytorch.org/docs/stable/distributed.html#common-environment-variables
    """
    if "GLOO_SOCKET_IFNAME" in environ:
        return
    iface = netif.gloo_interface(master, host, env.nodes)
    if iface:
        environ["GLOO_SOCKET_IFNAME"] = iface
        log.info("env: GLOO_SOCKET_IFNAME=%s (the interface towards %s)", iface, master)
    else:
        log.warning("env: no interface towards %s other than loopback; Gloo chooses its own",
                    master)


def _record_rank(run_dir: RunDir, env: DistEnv, host: str, gpu: dict[str, Any],
                 environ: MutableMapping[str, str], changes: list[nccl.EnvChange],
                 software: envcheck.Fingerprint, group: bool = True) -> None:
    """ranks/rank<N>.json: where this rank runs and with what (a supervisor's, without
    torch: no intra-op threads; its training process writes the file again)."""
    threads = None
    if group:
        import torch  # deferred: torch

        threads = torch.get_num_threads()
    write_json(run_dir.ranks / f"rank{env.rank}.json", {
        "rank": env.rank, "local_rank": env.local_rank, "node_rank": env.node_rank,
        "world_size": env.world_size, "local_world_size": env.local_world_size,
        "source": env.source, "job_id": env.job_id, "restart": env.restart,
        "generation": env.generation, "host": host,
        "addresses": netif.addresses(), "device": gpu, "pid": os.getpid(),
        "torch": software.versions.get("torch"), "env": nccl.recorded_env(environ),
        # The cores this process may run on, and torch's intra-op threads (cpus_per_task).
        "cpus": sorted(os.sched_getaffinity(0)), "threads": threads,
        # Where it ran: the container runtime (launch/container.py sets it inside) and
        # Python's prefix (an activated venv or conda env shows here).
        "container": environ.get(CONTAINER_ENV), "python": sys.executable,
        "env_overrides": [{"name": c.name, "old": None if c.old is None else
                           nccl.mask(c.name, c.old), "new": nccl.mask(c.name, c.new)}
                          for c in changes],
    })


def record_error(run_dir: RunDir, rank: int, host: str, message: str,
                 exc: BaseException | None, at: float | None = None) -> None:
    """Log this rank's failure (the message, and the program's traceback once) and write its
    error file: the message, the program's traceback (the failure report shows it), then the
    whole chain with hpc_ddp's frames (for a bug of ours); every part with the run's secrets
    masked (ranklog.masked). A supervisor's (its training process's report in the chain:
    tracebacks.ChildFailed) holds the process's frames and its time. The file's time is when
    the rank failed (``at``): the report's first to fail reads it."""
    child = tracebacks.child_failed(exc)
    # A failure diagnosed as another rank's (outcome.fail: no mark of its own, a cause):
    # its frames are where it noticed, not where it went wrong.
    peer = (child is None and exc is not None and exc.__cause__ is not None
            and tracebacks.LOCAL_MARK not in message)
    if child is not None:
        program, at = child.trace, at or child.at
    else:
        program = ranklog.masked(tracebacks.program_traceback(exc)) if exc is not None and (
            not peer) else ""
    shown = ranklog.masked(message.replace(f"{tracebacks.LOCAL_MARK} ", "")
                           .replace(tracebacks.LOCAL_MARK, "").strip())
    about = f"rank {rank} on {host}: "
    shown = shown.removeprefix(about)
    if child is None:  # a supervisor's child logged its own lines already
        log.error("rank %d on %s failed: %s%s", rank, host, shown,
                  f"\n{program}" if program else "")
    blocks = [about + shown, *([program] if program else [])]
    if child is not None and child.full:
        blocks.append(f"{tracebacks.FULL_TRACEBACK_CHILD}\n{child.full}")
    elif exc is not None:
        text = ranklog.masked("".join(traceback.format_exception(exc)))
        head = tracebacks.FULL_TRACEBACK_PEER if peer else tracebacks.FULL_TRACEBACK
        blocks.append(f"{head}\n{text}")
    try:  # replaced, not written in place: a link planted at the name is not followed
        write_text(run_dir.rank_error(rank), "\n\n".join(blocks))
        if at is not None:
            os.utime(run_dir.rank_error(rank), (at, at))
    except OSError:
        pass


def _record_failure(run_dir: RunDir, env: DistEnv, host: str, exc: BaseException) -> None:
    if isinstance(exc, KeyboardInterrupt | SystemExit) and not isinstance(exc, RunStopped):
        return
    if isinstance(exc, RunStopped) and exc.requested:  # events.jsonl holds the stop
        log.warning("rank %d on %s %s", env.rank, host, exc)
        return
    record_error(run_dir, env.rank, host, str(exc), exc)
    try:
        setattr(exc, tracebacks.RECORDED, True)
    except AttributeError:  # an exception type without a __dict__: printed once more
        pass
