"""Turn a composed config into a concrete plan: which target, how many tasks, which run dir.

Pure functions of the config and an environment mapping, plus the checks that need the file
system; all run before anything is submitted, and an existing run dir is never touched by a
submission that fails them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.config.given import flag, text
from hpc_ddp.config.schema import ClusterConfig, Config, ContainerConfig
from hpc_ddp.errors import UserError
from hpc_ddp.inputs.command_line import absolute_script
from hpc_ddp.rank.join.device import visible_devices
from hpc_ddp.rundir import default_root
from hpc_ddp.slurm.controller import slurm_available

OVERRIDES_FILE = "overrides.yaml"


@dataclass(frozen=True)
class Layout:
    """Ranks per node and GPUs per node of a run, and why (the submit command says it)."""

    tasks_per_node: int
    gpus_per_node: int
    why: str


def local_layout(tasks: int | None, gpus: int | None, device: str, nodes: int,
                 seen: int) -> Layout:
    """A local run's ranks and GPUs (pure): what the config says wins; left unset, one rank
    per GPU torch can use here (``seen``: torch.cuda.device_count(), which honours
    CUDA_VISIBLE_DEVICES and counts MIG instances), else 2 CPU ranks with gloo."""
    if gpus is not None:
        if gpus > 0:
            return Layout(tasks or gpus, gpus, f"cluster.gpus_per_node={gpus}")
        return Layout(tasks or 2, 0, "cluster.gpus_per_node=0")
    if device == "cpu":
        return Layout(tasks or 2, 0, "trainer.device=cpu")
    per_node = seen // nodes
    if device == "cuda" and per_node < (tasks or 1):
        raise UserError("trainer.device", "cuda", f"torch finds {seen} CUDA device(s) on this "
                        f"machine, and the run needs {(tasks or 1) * nodes}.",
                        "use trainer.device=auto (CPU ranks where there is no GPU), fewer "
                        "ranks, or a machine with GPUs (cluster=slurm).")
    if tasks is None:
        if per_node:
            return Layout(per_node, per_node, f"one rank per GPU torch can use here ({seen})")
        return Layout(2, 0, "torch can use no GPU here" if not seen else
                      f"{seen} GPU(s) cannot be split over {nodes} simulated nodes")
    if per_node >= tasks:
        return Layout(tasks, tasks, f"cluster.tasks_per_node={tasks}, a GPU for each")
    return Layout(tasks, 0, f"cluster.tasks_per_node={tasks} and torch can use {seen} GPU(s)")


# Local ranks per CPU of this machine at most: each is a process with its own interpreter and
# torch, and a run of many more would only thrash the machine (a shared login node, often).
LOCAL_RANKS_PER_CPU = 4


def check_local_ranks(nodes: int, tasks_per_node: int, cpus: int) -> None:
    """A local run starts nodes x tasks_per_node processes on this machine: at most
    LOCAL_RANKS_PER_CPU per CPU it has (``cpus``)."""
    most = LOCAL_RANKS_PER_CPU * cpus
    if nodes * tasks_per_node > most:
        key, value = ("nodes", nodes) if nodes > 1 else ("cluster.tasks_per_node",
                                                         tasks_per_node)
        raise UserError(key, value, f"a local run would start {nodes * tasks_per_node} "
                        f"processes on this machine, which has {cpus} CPU(s): at most {most} "
                        "ranks run here.", "ask for fewer nodes or tasks, or submit to a "
                        "cluster (cluster=slurm).")


def resolve(cfg: Config, environ: Mapping[str, str], cwd: Path,
            device_count: Callable[[], int] | None = None) -> Config:
    """Fill what the config leaves to be derived: cluster.kind, tasks_per_node,
    gpus_per_node, wait, run_dir (``device_count``: torch's, asked only for a local run
    whose GPUs are left to be derived)."""
    return resolve_with_layout(cfg, environ, cwd, device_count)[0]


def resolve_with_layout(cfg: Config, environ: Mapping[str, str], cwd: Path,
                        device_count: Callable[[], int] | None = None
                        ) -> tuple[Config, Layout]:
    """:func:`resolve`, and why the run gets the ranks and devices it gets."""
    # deferred (start-up): launch.step
    from hpc_ddp.launch import step

    cluster = cfg.cluster
    kind = cluster.kind
    alloc = step.allocation(environ)
    if kind == "auto":
        kind = "slurm" if slurm_available(environ) else "local"
        if kind == "slurm" and alloc is not None:
            kind = "step"  # inside an allocation: a step of it, not a job queued behind it
    if kind == "step" and alloc is None:
        raise step.no_allocation_error()
    container = _container_for(cluster, kind, cwd)
    if kind == "local":
        derive = cluster.gpus_per_node is None and cfg.trainer.device != "cpu"
        seen = (device_count or cuda_device_count)() if derive else 0
        layout = local_layout(cluster.tasks_per_node, cluster.gpus_per_node,
                              cfg.trainer.device, cfg.nodes, seen)
        check_local_ranks(cfg.nodes, layout.tasks_per_node, os.cpu_count() or 1)
    else:
        gpus = cluster.gpus_per_node
        if gpus is None and kind == "step" and alloc is not None:
            gpus = alloc.gpus_per_node  # a step uses the GPUs its allocation has
        gpus = gpus or 0
        tasks = cluster.tasks_per_node or gpus or 1
        layout = Layout(tasks, gpus, f"cluster.gpus_per_node={gpus}" if gpus else "CPU job")
    cluster = dataclasses.replace(cluster, kind=kind, tasks_per_node=layout.tasks_per_node,
                                  gpus_per_node=layout.gpus_per_node, container=container)
    run_dir = cfg.run_dir or str(default_root(cwd / "outputs"))
    if cfg.detach and kind == "slurm":
        raise UserError("detach", "true", "is for local runs and steps; a Slurm job runs "
                        "without this command already.", "leave detach out (wait=false is "
                        "the default on Slurm).")
    if cfg.detach and cfg.wait:
        raise UserError("detach", "true", "and wait=true contradict each other.",
                        "give one of them; follow a detached run with python -m hpc_ddp.logs "
                        "RUN_DIR --follow.")
    wait = cfg.wait if cfg.wait is not None else kind in ("local", "step") and not cfg.detach
    return dataclasses.replace(cfg, cluster=cluster, run_dir=str(Path(run_dir).absolute()),
                               wait=wait, script=absolute_script(cfg.script, cwd)), layout


def _container_for(cluster: ClusterConfig, kind: str, cwd: Path) -> ContainerConfig:
    """A container (and an environment to activate on the nodes) is for Slurm tasks; its
    working directory defaults to the folder the run is submitted from (mounted there)."""
    wanted = [key for key, on in (("cluster.container.kind", cluster.container.kind != "none"),
                                  ("cluster.venv", cluster.venv is not None),
                                  ("cluster.conda_env", cluster.conda_env is not None)) if on]
    if kind == "local" and wanted:
        value = {"cluster.container.kind": cluster.container.kind,
                 "cluster.venv": cluster.venv, "cluster.conda_env": cluster.conda_env}[wanted[0]]
        raise UserError(wanted[0], value, "applies to the tasks of a Slurm job (every node "
                        "starts them in it), and this run is local.",
                        "use cluster=slurm (or step), or drop it and run this command inside "
                        "the container or environment itself.")
    if cluster.container.kind != "none" and cluster.container.workdir is None:
        return dataclasses.replace(cluster.container, workdir=str(cwd.absolute()))
    return cluster.container


def merge_resume_overrides(overrides: Sequence[str]) -> list[str]:
    """With resume=true, the run's saved overrides come first and the new ones win."""
    if not flag(overrides, "resume"):  # as the typed config reads it (resume=on, =yes too)
        return list(overrides)
    run_dir = text(overrides, "run_dir") or ""
    if not run_dir:
        raise UserError("resume", "true", "needs the run to continue.",
                        "pass run_dir=<the run's folder> as well.")
    return saved_overrides(Path(run_dir), run_dir) + list(overrides)


def saved_overrides(root: Path, shown: str) -> list[str]:
    """The run's overrides.yaml, read once it passed the ownership checks
    (inputs/run_dir.read_saved) and with its YAML aliases counted (config/yaml_guard.py)."""
    # deferred (start-up): config.yaml_guard, inputs.run_dir
    from hpc_ddp.config import yaml_guard
    from hpc_ddp.inputs.run_dir import read_saved

    text = read_saved(root, OVERRIDES_FILE, shown)
    if text is None:
        raise UserError("run_dir", shown, "holds no run to resume (no readable overrides.yaml).",
                        "check the path, or drop resume=true to start a new run there.")
    previous = yaml_guard.load(text, str(root / OVERRIDES_FILE)) or []
    if not isinstance(previous, list) or not all(isinstance(o, str) for o in previous):
        raise UserError("run_dir", shown, "holds an overrides.yaml that is not a list of "
                        "overrides.", "use a run dir hpc_ddp made.")
    for item in previous:
        yaml_guard.check_nesting(item, str(root / OVERRIDES_FILE))
    return previous


# Where a GPU driver shows itself without loading anything: NVIDIA's (the device files and
# the driver's /proc entry) and ROCm's (HIP builds of torch answer torch.cuda too).
GPU_DRIVER_PATHS = ("/dev/nvidia0", "/proc/driver/nvidia/gpus", "/dev/kfd")


@functools.cache
def cuda_device_count() -> int:
    """The CUDA devices torch can use from this process (0 without CUDA); asked once. On a
    machine with no GPU driver at all the answer is 0 without importing torch (a second of
    start-up saved for every command that plans a local run there: --cfg, dry runs)."""
    if not any(os.path.exists(p) for p in GPU_DRIVER_PATHS):
        return 0
    # deferred: torch
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_local_gpus(cfg: Config, environ: Mapping[str, str],
                     device_count: Callable[[], int] = cuda_device_count) -> None:
    """A local run's GPUs: submitit shows the ranks only the cluster.gpus_per_node it hands
    out (CUDA_VISIBLE_DEVICES is empty with 0), only what this shell was given exists, and
    only what torch can use here trains (``device_count`` is asked only then)."""
    if cfg.cluster.kind != "local":
        return
    wanted = (cfg.cluster.gpus_per_node or 0) * cfg.nodes
    if cfg.trainer.device == "cuda" and not wanted:
        raise UserError("trainer.device", "cuda", "the local ranks get no GPU: with "
                        "cluster.gpus_per_node=0 submitit sets their CUDA_VISIBLE_DEVICES=''.",
                        "set cluster.gpus_per_node=<GPUs to use> (one per task).")
    given = visible_devices(environ)
    if wanted and given is not None and len(given) < wanted:
        raise UserError("cluster.gpus_per_node", cfg.cluster.gpus_per_node,
                        f"this shell is given {len(given)} GPU(s) "
                        f"(CUDA_VISIBLE_DEVICES={','.join(given) or ''}) and the run needs "
                        f"{wanted}.", f"use cluster.gpus_per_node={len(given) // cfg.nodes} "
                        "or fewer, or run where more GPUs are visible.")
    if wanted and cfg.trainer.device != "cpu" and (found := device_count()) < wanted:
        raise UserError("cluster.gpus_per_node", cfg.cluster.gpus_per_node,
                        f"the run needs {wanted} GPU(s) and torch finds {found} CUDA device(s) "
                        "on this machine.", "use cluster.gpus_per_node=0 (CPU ranks with gloo)"
                        + (f" or {found // cfg.nodes} or fewer" if found // cfg.nodes else "")
                        + ", or run on a machine with GPUs (cluster=slurm).")


