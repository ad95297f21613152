"""GPU choice under every way Slurm hands out GPUs (a table of task environments)."""

from __future__ import annotations

import pytest

from hpc_ddp.rank.join.device import (
    DeviceError,
    collisions,
    gpu_allocated,
    select,
    slurm_gpus,
    visible_devices,
)

PER_NODE = {"SLURM_JOB_GPUS": "0,1,2,3", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}


@pytest.mark.parametrize("environ, local_rank, local_world, count, index, physical, binding", [
    # --gpus-per-node=4: every task sees all four, picks by local rank.
    (PER_NODE, 0, 4, 4, 0, "0", "per_node"),
    (PER_NODE, 3, 4, 4, 3, "3", "per_node"),
    # --gpus-per-task=1 with device cgroups: each task sees its own GPU as index 0.
    ({"SLURM_GPUS_PER_TASK": "1", "CUDA_VISIBLE_DEVICES": "0"}, 3, 4, 1, 0, "0", "per_task"),
    # --gpus-per-task=1 without cgroups (task/none): its own GPU keeps the node's number.
    ({"SLURM_GPUS_PER_TASK": "1", "CUDA_VISIBLE_DEVICES": "1"}, 1, 2, None, 0, "1", "per_task"),
    # --gpus-per-task=2: the task's first GPU, not its local rank (which may be out of range).
    ({"SLURM_GPUS_PER_TASK": "2", "CUDA_VISIBLE_DEVICES": "2,3"}, 1, 2, 2, 0, "2", "per_task"),
    # --gpu-bind=single:1 / map_gpu: one device each, whatever the local rank.
    ({"SLURM_STEP_GPUS": "5", "CUDA_VISIBLE_DEVICES": "5"}, 2, 4, 1, 0, "5", "per_task"),
    # Fake GPUs (no CUDA): count what Slurm made visible.
    ({"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_JOB_GPUS": "0,1"}, 1, 2, None, 1, "1", "per_node"),
    # CUDA_VISIBLE_DEVICES unset (a workstation): all devices, by local rank.
    ({}, 1, 2, 2, 1, "1", "per_node"),
    # More GPUs than tasks.
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 1, 2, 8, 1, "1", "per_node"),
])
def test_selection(environ: dict[str, str], local_rank: int, local_world: int,
                   count: int | None, index: int, physical: str, binding: str) -> None:
    choice = select(environ, local_rank, local_world, count)
    assert choice is not None
    assert (choice.index, choice.physical, choice.binding) == (index, physical, binding)
    assert count is None or choice.index < count  # never an index the task cannot see


@pytest.mark.parametrize("environ", [{}, {"CUDA_VISIBLE_DEVICES": ""},
                                     {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}])
def test_no_gpu(environ: dict[str, str]) -> None:
    assert select(environ, 0, 2, None) is None
    assert not gpu_allocated(environ) and slurm_gpus(environ) is None


def test_more_tasks_than_gpus_is_refused_on_every_rank() -> None:
    for local_rank in range(4):  # rank 0 too: it must not wait at the rendezvous alone
        with pytest.raises(DeviceError, match="two ranks would land on one GPU"):
            select({"CUDA_VISIBLE_DEVICES": "0,1"}, local_rank, 4, 2)


def test_torchrun_with_two_ranks_on_a_one_gpu_box_is_refused() -> None:
    # Nothing chose what each task sees, so both would take device 0.
    for local_rank in (0, 1):
        with pytest.raises(DeviceError, match="CUDA_VISIBLE_DEVICES=unset"):
            select({}, local_rank, 2, 1)
    alone = select({}, 0, 1, 1)
    assert alone is not None and alone.index == 0


def test_two_ranks_of_a_node_never_share_a_gpu() -> None:
    for env in (PER_NODE,):
        chosen = {select(env, r, 4, 4).physical for r in range(4)}  # type: ignore[union-attr]
        assert len(chosen) == 4


def test_visible_devices_and_allocation() -> None:
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "0, 1"}) == ["0", "1"]
    assert gpu_allocated({"SLURM_JOB_GPUS": "0"})
    assert slurm_gpus({"SLURM_STEP_GPUS": "2", "SLURM_JOB_GPUS": "0,1,2"}) == "SLURM_STEP_GPUS=2"


def test_collisions_are_flagged() -> None:
    placed = [{"rank": 0, "host": "n1", "physical": "0"},
              {"rank": 1, "host": "n1", "physical": "0"},
              {"rank": 2, "host": "n2", "physical": "0"}, {"rank": 3, "host": "n2"}]
    assert collisions(placed) == [{"host": "n1", "gpu": "0", "ranks": [0, 1]}]
