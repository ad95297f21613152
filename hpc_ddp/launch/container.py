"""The command line each task of the job runs: container, environment activation, Python.

Pure functions of the config (and the folder mounted as the run dir), used by the sbatch
script (launch/slurm.py), a step of an allocation (launch/step.py) and their dry runs:

==========  ===================================================================
pyxis       srun --container-image=IMG --container-mounts=SRC:DST[:ro],...
            --container-workdir=DIR --container-name=NAME ... python -m ...
apptainer   srun ... apptainer exec [--nv] --bind SRC:DST[:ro] --pwd DIR IMG python -m ...
podman      srun ... podman run --rm --network=host --pid=host --ipc=host --uts=host
            --volume SRC:DST[:ro] --env NAME --workdir DIR IMG python -m ...
==========  ===================================================================

hpc_ddp's own entry runs inside the container; Slurm's commands (requeue, squeue) do not
(the image need not have them): the batch script, outside, runs them for the ranks
(slurm/relay.py). The host namespaces keep what a task outside would have: the node's
network (rank 0's address, NCCL's interfaces), its hostname (the rendezvous names hosts),
its PID space (a rank's recorded pid is signalled by its peers on the node) and /dev/shm
(NCCL's and the data loaders' shared memory).
"""

from __future__ import annotations

import hashlib
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.config.container_schema import ContainerConfig, parse_mount
from hpc_ddp.config.schema import Config
from hpc_ddp.config.secrets import REFERENCE, shell_lines
from hpc_ddp.launch import nodeenv
from hpc_ddp.rank.contract import CONTAINER_ENV

# Passed into every container: what Slurm, submitit, hpc_ddp, NCCL, CUDA and torch read.
# (Apptainer and pyxis pass the whole job environment themselves; podman takes patterns.)
PASSED_ENV = ("SLURM*", "SUBMITIT_*", "HPC_DDP_*", "NCCL_*", "TORCH_*", "GLOO_*", "CUDA_*",
              "NVIDIA_*", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "PYTHONUNBUFFERED",
              "PYTHONFAULTHANDLER")
_DEFAULT_RUNTIME = {"apptainer": "apptainer", "podman": "podman"}
# GPUs: apptainer binds the driver with --nv; podman uses the NVIDIA Container Toolkit's CDI
# spec (https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/latest/cdi-support.html);
# pyxis/enroot expose the GPUs Slurm allocated through enroot's nvidia hook.
_GPU_FLAGS = {"apptainer": ["--nv"], "podman": ["--device", "nvidia.com/gpu=all"], "pyxis": []}


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool


@dataclass(frozen=True)
class TaskCommand:
    """How a task starts: srun options (pyxis), the argv before Python, the Python."""

    srun_args: list[str]
    prefix: list[str]
    python: str

    def argv(self) -> list[str]:
        return [*self.prefix, self.python]


def enabled(cfg: Config) -> bool:
    return cfg.cluster.container.kind != "none"


def node_python(cfg: Config, default: str) -> str:
    """The interpreter each task starts: cluster.python; else the image's or the activated
    environment's ``python``; else ``default`` (the one running submit)."""
    c = cfg.cluster
    if c.python:
        return c.python
    return "python" if enabled(cfg) or nodeenv.wanted(c) else default


def mounts(cfg: Config, run_root: Path | None) -> list[Mount]:
    """The automatic mounts (each at its own path) and the user's, without repeats: a folder
    inside one already mounted with the same or more rights is left out."""
    k = cfg.cluster.container
    wanted: list[Mount] = []
    if k.auto_mounts:
        if run_root is not None:
            wanted.append(Mount(str(run_root), str(run_root), False))
        if k.workdir is not None:
            wanted.append(Mount(k.workdir, k.workdir, False))
        for folder in (cfg.config_dir, _conf_env()):
            if folder:
                wanted.append(Mount(folder, folder, True))
        if cfg.script and not cfg.script.startswith("-m"):
            parent = str(Path(cfg.script).parent)
            wanted.append(Mount(parent, parent, True))
    if k.mount_data and cfg.data.root and cfg.data.root.startswith("/"):
        wanted.append(Mount(cfg.data.root, cfg.data.root, True))
    user = [Mount(*parse_mount(spec)) for spec in k.mounts]
    kept: list[Mount] = []
    for m in sorted(wanted, key=lambda m: (len(m.source), m.read_only)):
        if not any(_inside(m.source, o.source) and (m.read_only or not o.read_only)
                   for o in kept):
            kept.append(m)
    return kept + user


def unmounted(cfg: Config, run_root: Path | None) -> list[str]:
    """The script's absolute path arguments (``--checkpoint /x/y.pt``, ``--out=/x``) under no
    mount of its container: written there, they are lost with the container when the step
    ends (pure; empty without a container or a script)."""
    if cfg.cluster.container.kind == "none" or not cfg.script:
        return []
    found = mounts(cfg, run_root)
    paths = [a.split("=", 1)[1] if a.startswith("--") and "=" in a else a
             for a in cfg.script_args]
    return [p for p in paths if p.startswith("/")
            and not any(_inside(p, m.target) for m in found)]


def _conf_env() -> str | None:
    from hpc_ddp.config.folders import CONF_ENV  # deferred (start-up): config.folders

    return os.environ.get(CONF_ENV) or None


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def gpus(cfg: Config) -> bool:
    k = cfg.cluster.container
    if k.gpus is not None:
        return k.gpus
    return bool(cfg.cluster.gpus_per_node) and cfg.trainer.device != "cpu"


def container_name(k: ContainerConfig) -> str | None:
    """pyxis' --container-name: unpacked once per node and job, reused by its later steps
    (https://github.com/NVIDIA/pyxis/wiki/Usage). Named after the image, so that a step
    with another image does not reuse this one."""
    if k.name is not None:
        return k.name or None
    return "hpc_ddp-" + hashlib.sha256(str(k.image).encode()).hexdigest()[:10]


def exports(cfg: Config) -> dict[str, str]:
    """The variables to set for the task (outside the container, where pyxis reads them;
    apptainer and podman get them as --env as well). A secret's value is a reference
    (${oc.env:NAME}, config/secrets.py): set from the job's environment by the batch
    script's shell, never on a command line."""
    if not enabled(cfg):
        return {}
    return {**{k: str(v) for k, v in cfg.cluster.container.env.items()},
            CONTAINER_ENV: cfg.cluster.container.kind}


def _by_reference(value: str) -> bool:
    return bool(REFERENCE.search(value))


def command(cfg: Config, run_root: Path | None, default_python: str) -> TaskCommand:
    """The task's srun options, argv prefix and Python (pure; ``run_root``: the folder mounted
    as the run dir, the sweep folder for a sweep, None to leave it out)."""
    c = cfg.cluster
    k = c.container
    errors = run_root / "logs" if run_root is not None else None
    activation = nodeenv.wrapper(c, errors)
    python = node_python(cfg, default_python)
    if k.kind == "none":
        return TaskCommand([], activation, python)
    assert k.image is not None
    found = mounts(cfg, run_root)
    flags = list(k.gpu_flags) if k.gpu_flags is not None else (
        _GPU_FLAGS[k.kind] if gpus(cfg) else [])
    if k.kind == "pyxis":
        srun = [f"--container-image={k.image}"]
        if found:
            srun.append("--container-mounts=" + ",".join(
                f"{m.source}:{m.target}" + (":ro" if m.read_only else "") for m in found))
        if k.workdir:
            srun.append(f"--container-workdir={k.workdir}")
        name = container_name(k)
        if name:
            srun.append(f"--container-name={name}")
        names = [*k.pass_env, *exports(cfg)]
        srun += [f"--container-env={','.join(dict.fromkeys(names))}", *flags, *k.options]
        return TaskCommand(srun, activation, python)
    runtime = k.runtime or _DEFAULT_RUNTIME[k.kind]
    # A secret's value never goes on the command line (ps shows it): podman takes it from
    # the environment by name; apptainer from APPTAINERENV_NAME (setup_lines).
    env_flags = []
    for name, value in exports(cfg).items():
        if not _by_reference(value):
            env_flags += ["--env", f"{name}={value}"]
        elif k.kind == "podman":
            env_flags += ["--env", name]
    if k.kind == "podman":
        env_flags = [w for name in k.pass_env for w in ("--env", name)] + env_flags
    if k.kind == "apptainer":
        argv = [runtime, "exec", *flags]
        for m in found:
            argv += ["--bind", f"{m.source}:{m.target}" + (":ro" if m.read_only else "")]
        if k.workdir:
            argv += ["--pwd", k.workdir]
        argv += [*env_flags, *k.options, k.image]
        return TaskCommand([], [*argv, *activation], python)
    argv = [runtime, "run", "--rm", "--network=host", "--pid=host", "--ipc=host", "--uts=host",
            *flags]
    for pattern in PASSED_ENV:
        argv += ["--env", pattern]
    argv += env_flags
    for m in found:
        argv += ["--volume", f"{m.source}:{m.target}" + (":ro" if m.read_only else "")]
    if k.workdir:
        argv += ["--workdir", k.workdir]
    argv += [*k.options, *(["--rootfs", k.image] if k.rootfs else [k.image])]
    return TaskCommand([], [*argv, *activation], python)


def shown(cmd: TaskCommand) -> str:
    """The task's command line as a shell would run it (for messages and dry runs)."""
    return shlex.join(cmd.argv())


def setup_lines(cfg: Config, run_root: Path | None) -> list[str]:
    """Batch-script lines before srun, outside the container: the NAME=value environment,
    and Slurm's relay for the ranks inside (slurm/relay.py)."""
    from hpc_ddp.slurm import relay as slurm_relay  # deferred (start-up): slurm.relay

    lines = []
    for name, value in exports(cfg).items():
        if _by_reference(value):  # a secret: the shell reads it from the job's environment
            lines.append(f'export {name}="{shell_lines([value])[0]}"')
            if cfg.cluster.container.kind == "apptainer":
                lines.append(f'export APPTAINERENV_{name}="${{{name}}}"')
        else:
            lines.append(f"export {name}={shlex.quote(value)}")
    if enabled(cfg):
        root = run_root if run_root is not None else Path("/run_dir")  # a sweep's grouping key
        lines += ["# Slurm's commands for the ranks inside the container, run out here "
                  "(hpc_ddp/slurm/relay.py)", *slurm_relay.start_lines(
                      root / "submitit" / "relay")]
    return lines


def srun_words(cmd: TaskCommand) -> list[str]:
    """What follows srun's own options: pyxis' options, then the runtime and the activation
    wrapper, which are the first words of srun's command (submitit puts Python after them).
    Kept with the srun arguments, they are part of the job's parameters: a sweep groups its
    points by those, so points with another image get their own job array."""
    return [*cmd.srun_args, *cmd.prefix]
