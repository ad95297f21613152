"""Which device a task computes on, as a pure function of its environment.

Under Slurm, ``--gpus-per-node`` shows every task of a node all its GPUs (pick by local rank),
while ``--gpus-per-task=1`` shows each task only its own (always index 0): using the local
rank there is the classic "invalid device ordinal" bug (TESTCLUSTER.md, "Fake GPUs").
"""

from __future__ import annotations

from collections.abc import Mapping


class DeviceError(RuntimeError):
    """The task cannot be given a device of its own; the message says why and what to do."""


def visible_devices(environ: Mapping[str, str]) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list (None: unset, all devices visible; []: none)."""
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [d for d in raw.split(",") if d.strip() and d.strip() != "NoDevFiles"]


def slurm_gpus(environ: Mapping[str, str]) -> str | None:
    """What Slurm allocated to this task/job, for messages (None: no GPU from Slurm)."""
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE"):
        if environ.get(name):
            return f"{name}={environ[name]}"
    return None


def select_index(environ: Mapping[str, str], local_rank: int, local_world_size: int,
                 device_count: int) -> int:
    """The CUDA device index this task must use among the ``device_count`` it sees."""
    if device_count < 1:
        raise DeviceError("no CUDA device is visible to this task")
    if device_count == 1:
        return 0  # per-task binding (or one task per node): our one device
    if local_world_size > device_count:
        raise DeviceError(
            f"{local_world_size} tasks on this node share {device_count} visible GPUs: two "
            "ranks would land on one GPU. Ask for one GPU per task "
            f"(cluster.gpus_per_node={local_world_size}) or fewer tasks per node."
        )
    return local_rank
