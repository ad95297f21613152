"""Schema of ``cluster.container`` (the ``container`` group) and the node environment keys.

``container=pyxis|apptainer|podman`` runs every task of the job inside a container
(hpc_ddp/launch/container.py renders the command lines); ``cluster.venv`` and
``cluster.conda_env`` activate an environment on every node before the task
(hpc_ddp/launch/nodeenv.py). Everything here is checked before anything is submitted.
Sources: pyxis' srun options (https://github.com/NVIDIA/pyxis/wiki/Usage), ``apptainer exec``
(https://apptainer.org/docs/user/main/cli/apptainer_exec.html) and ``podman run``
(https://docs.podman.io/en/latest/markdown/podman-run.1.html).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from hpc_ddp.errors import UserError

CONTAINER_KINDS = ("none", "pyxis", "apptainer", "podman")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A podman pattern (--env 'NCCL_*'): a prefix and a star.
_ENV_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\*$")


@dataclass
class ContainerConfig:
    # none | pyxis | apptainer | podman (conf/container/<kind>.yaml): the runtime every task
    # of the job runs in. Slurm's own commands (requeue, squeue) stay outside it.
    kind: str = "none"
    # The image. pyxis: an enroot URI (nvcr.io#nvidia/pytorch:24.05-py3) or a .sqsh file;
    # apptainer: a .sif file, a sandbox folder or docker://...; podman: an image name, or with
    # rootfs=true a root file system folder. It must hold Python, torch and hpc_ddp.
    image: str | None = None
    # podman: `image` is a root file system folder (podman run --rootfs): no image store.
    rootfs: bool = False
    # Bind mounts besides the automatic ones: "SRC", "SRC:DST" or "SRC:DST:ro" (absolute).
    mounts: list[str] = field(default_factory=list)
    # Mount, each at its own path: the run dir (read-write), the working directory (your
    # code, read-write), config_dir and $HPC_DDP_CONF (read-only), a script's folder.
    auto_mounts: bool = True
    # Mount data.root read-only (when set).
    mount_data: bool = True
    # Variables set inside: {NAME: value} (+cluster.container.env.NAME=value on the command
    # line). Slurm's, submitit's, hpc_ddp's, NCCL's, CUDA's and torch's pass in always.
    env: dict[str, str] = field(default_factory=dict)
    # More of the job's variables passed in by name (podman also takes NAME_* patterns;
    # apptainer and pyxis pass the whole environment unless told otherwise).
    pass_env: list[str] = field(default_factory=list)
    # GPUs inside: null (auto: when the job asks for GPUs and trainer.device is not cpu).
    gpus: bool | None = None
    # The flags that give the container the GPUs; null: the runtime's default (apptainer
    # --nv, podman --device nvidia.com/gpu=all (CDI), pyxis none: enroot's hook does it).
    gpu_flags: list[str] | None = None
    # Working directory inside; null: the folder the run was submitted from (resolved then).
    workdir: str | None = None
    # The runtime's executable (a full path, a site's wrapper); null: apptainer / podman.
    runtime: str | None = None
    # More options: for `apptainer exec`, `podman run`, or srun (pyxis' --container-*).
    options: list[str] = field(default_factory=list)
    # pyxis: --container-name, so later steps of the same job reuse the unpacked image; null:
    # hpc_ddp-<hash of the image>; "" for none (unpacked again for every step).
    name: str | None = None


def parse_mount(spec: str) -> tuple[str, str, bool]:
    """``SRC[:DST[:ro|rw]]`` -> (source, destination, read_only); ValueError when malformed."""
    parts = spec.split(":")
    if len(parts) > 3 or not all(parts[:2]):
        raise ValueError(spec)
    src, dst = parts[0], parts[1] if len(parts) > 1 else parts[0]
    mode = parts[2] if len(parts) == 3 else "rw"
    if mode not in ("ro", "rw") or not (src.startswith("/") and dst.startswith("/")):
        raise ValueError(spec)
    return src, dst, mode == "ro"


def env_name_ok(name: str, pattern: bool = False) -> bool:
    """A variable name (``pattern``: or a podman NAME_* pattern)."""
    return bool(_ENV_NAME.match(name) or (pattern and _ENV_PATTERN.match(name)))


def validate_container(cluster: Any) -> None:
    """cluster.container, cluster.venv / conda_env / allow_mixed_env: one line per problem."""
    c: ContainerConfig = cluster.container
    if cluster.venv is not None and cluster.conda_env is not None:
        raise UserError("cluster.venv", cluster.venv, f"and cluster.conda_env="
                        f"{cluster.conda_env} are both set; a task runs in one environment.",
                        "keep one of them.")
    for key, value in (("cluster.venv", cluster.venv), ("cluster.conda_env", cluster.conda_env)):
        if value is not None and (not value.strip() or any(ch in value for ch in "\n\r'")):
            raise UserError(key, value, "is empty or holds a newline or a quote.",
                            "give the environment's folder (or a conda env's name).")
    if cluster.venv is not None and not cluster.venv.startswith("/"):
        raise UserError("cluster.venv", cluster.venv, "is not an absolute path; the nodes "
                        "start in the submit folder, which may not be where it is.",
                        f"give the full path, e.g. cluster.venv=$PWD/{cluster.venv}.")
    if c.kind not in CONTAINER_KINDS:
        raise UserError("cluster.container.kind", c.kind, "is not a container runtime hpc_ddp "
                        "knows.", f"use container=one of {', '.join(CONTAINER_KINDS)} (or a "
                        "site's wrapper with cluster.container.runtime).")
    if c.kind == "none":
        return
    if not c.image:
        example = {"pyxis": "'nvcr.io#nvidia/pytorch:24.05-py3' (quoted: Hydra reads # "
                            "as a comment)",
                   "apptainer": "/shared/images/train.sif",
                   "podman": "localhost/train:latest"}[c.kind]
        raise UserError("cluster.container.image", c.image, f"container={c.kind} needs an "
                        "image (with Python, torch and hpc_ddp in it).",
                        f"set cluster.container.image={example}.")
    if c.rootfs and c.kind != "podman":
        raise UserError("cluster.container.rootfs", True, f"is podman's --rootfs; "
                        f"container={c.kind} takes a folder as its image itself.",
                        "drop cluster.container.rootfs.")
    if c.rootfs and not c.image.startswith("/"):
        raise UserError("cluster.container.image", c.image, "with rootfs=true is a root file "
                        "system folder, and this is not an absolute path.",
                        "give the folder's full path.")
    for spec in c.mounts:
        try:
            src, dst, _ = parse_mount(spec)
        except ValueError:
            raise UserError("cluster.container.mounts", spec, "is not SRC, SRC:DST or "
                            "SRC:DST:ro with absolute paths.", "e.g. "
                            "cluster.container.mounts=[/scratch/data:/data:ro].") from None
        if c.kind == "pyxis" and ("," in src + dst or "+" in src + dst):
            raise UserError("cluster.container.mounts", spec, "holds a ',' or '+', which "
                            "pyxis' --container-mounts uses as separators.",
                            "mount a folder whose path has neither.")
    for name, value in c.env.items():
        if not env_name_ok(name) or "\n" in str(value):
            raise UserError(f"cluster.container.env.{name}", value, "is not a variable name "
                            "with a one-line value.", "e.g. "
                            "+cluster.container.env.OMP_NUM_THREADS=8.")
    for name in c.pass_env:
        if not env_name_ok(name, pattern=c.kind == "podman"):
            raise UserError("cluster.container.pass_env", name, "is not a variable name"
                            + (" or a NAME_* pattern." if c.kind == "podman" else "."),
                            "e.g. cluster.container.pass_env=[WANDB_API_KEY].")
    for key, value in (("workdir", c.workdir), ("runtime", c.runtime)):
        if value is not None and not value.strip():
            raise UserError(f"cluster.container.{key}", "", "is empty.",
                            f"give a path, or cluster.container.{key}=null.")
    if c.workdir is not None and not c.workdir.startswith("/"):
        raise UserError("cluster.container.workdir", c.workdir, "is not an absolute path.",
                        "give the folder inside the container, e.g. /workspace.")
    if c.name is not None and c.name and not re.match(r"^[A-Za-z0-9_.-]+$", c.name):
        raise UserError("cluster.container.name", c.name, "holds characters pyxis names do "
                        "not take.", "letters, digits and _ . - only.")
