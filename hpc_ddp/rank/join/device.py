"""Which GPU a task uses, as a pure function of its environment.

How Slurm hands out GPUs decides the index a task must ask for (seen on the test cluster's
fake GPUs, docs/testcluster.md "What a job sees"):
- ``--gpus-per-node=N``: every task of a node sees all N GPUs (CUDA_VISIBLE_DEVICES=0,1,..);
  the task picks by local rank.
- ``--gpus-per-task=1`` (and ``--gpu-bind`` variants that give each task its own GPUs): each
  task sees only its own; it must use index 0 of what it sees. Using the local rank here is
  the classic "invalid device ordinal" bug; using 0 under per-node binding is the classic
  "all ranks on GPU 0".
- No GPU: CUDA_VISIBLE_DEVICES unset or empty, no SLURM_*GPUS* variables.
https://slurm.schedmd.com/sbatch.html#OPT_gpus-per-task, #OPT_gpu-bind
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


class DeviceError(RuntimeError):
    """The task cannot be given a device of its own; the message says why and what to do."""


@dataclass(frozen=True)
class GpuChoice:
    # Index to pass to torch.cuda.set_device (among the devices this task sees).
    index: int
    # The GPU's id as Slurm's allocation names it (an entry of CUDA_VISIBLE_DEVICES).
    physical: str
    # per_node (pick by local rank) | per_task (the task's own devices)
    binding: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def visible_devices(environ: Mapping[str, str]) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list (None: unset, all devices visible; []: none)."""
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [d.strip() for d in raw.split(",") if d.strip() and d.strip() != "NoDevFiles"]


def slurm_gpus(environ: Mapping[str, str]) -> str | None:
    """What Slurm allocated to this task/job, for messages (None: no GPU from Slurm)."""
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE"):
        if environ.get(name):
            return f"{name}={environ[name]}"
    return None


def gpu_allocated(environ: Mapping[str, str]) -> bool:
    """The launcher gave this task a GPU (Slurm's variables, or a non-empty visible list)."""
    return slurm_gpus(environ) is not None or bool(visible_devices(environ))


def select(environ: Mapping[str, str], local_rank: int, local_world_size: int,
           device_count: int | None = None) -> GpuChoice | None:
    """The GPU this task must use; None when it was given none.

    ``device_count`` is what CUDA reports (None: count CUDA_VISIBLE_DEVICES, as on a
    machine whose GPUs are allocated but not usable, like the test cluster's fake ones).
    Raises DeviceError when two tasks of a node would share one GPU.
    """
    visible = visible_devices(environ)
    ids = visible if visible is not None else [str(i) for i in range(device_count or 0)]
    count = device_count if device_count is not None else len(ids)
    if count < 1 or not ids:
        return None
    # One visible GPU is the task's own when the launcher chose what it sees (per-task
    # binding renumbers each task's GPU to 0). With nothing chosen (torchrun on a one-GPU
    # box) every local rank would take device 0: that is the per-node check below.
    own = count == 1 and (visible is not None or local_world_size == 1)
    if "SLURM_GPUS_PER_TASK" in environ or own:
        # Each task sees only its own GPU(s): the first of them is ours.
        return GpuChoice(0, ids[0], "per_task")
    if local_world_size > count:
        # Every rank of the node says so (not only those past the end): none waits for the
        # others at the rendezvous while one has failed.
        raise DeviceError(
            f"{local_world_size} tasks on this node share {count} visible GPUs "
            f"(CUDA_VISIBLE_DEVICES={','.join(ids) if visible is not None else 'unset'}): "
            f"two ranks would land on one GPU. Ask for one GPU per task "
            f"(cluster.gpus_per_node={local_world_size}) or fewer tasks per node."
        )
    return GpuChoice(local_rank, ids[local_rank] if local_rank < len(ids) else str(local_rank),
                     "per_node")


def collisions(gpu_map: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """(host, GPU) pairs used by more than one rank, with the ranks (empty when none)."""
    def key(m: dict[str, Any]) -> tuple[str, str] | None:
        gpu = m.get("uuid") or m.get("physical")
        return (m["host"], gpu) if gpu else None

    counts = Counter(k for k in map(key, gpu_map) if k is not None)
    return [{"host": host, "gpu": gpu, "ranks": [m["rank"] for m in gpu_map if key(m) == (
        host, gpu)]} for (host, gpu), n in counts.items() if n > 1]
