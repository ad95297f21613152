"""One task per GPU on Slurm's real GPU allocation (the test cluster's fake GRES GPUs)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cluster.slurm_final import assert_completed, assert_ended
from tests.cluster.test_slurm_submit import SMALL, job_id_of, summary_of

pytestmark = pytest.mark.cluster
Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.mark.parametrize("binding", ["per_node", "per_task"])
def test_four_ranks_on_four_distinct_gpus(hpc_ddp: Run, slurm_env: dict[str, str],
                                          tmp_path: Path, binding: str) -> None:
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", ["cluster=slurm", "nodes=2", "cluster.gpus_per_node=2",
                              f"cluster.gpu_binding={binding}", "trainer.device=cpu",
                              "trainer.max_steps=10", *SMALL, f"run_dir={run_dir}", "wait=true"],
                   env=slurm_env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_completed(job_id_of(done.stdout), slurm_env, done.stdout)
    summary = summary_of(run_dir)
    pairs = {(m["host"], m["physical"]) for m in summary["gpu_map"]}
    assert len(summary["gpu_map"]) == 4 and len(pairs) == 4
    assert summary["gpu_collisions"] == []
    assert {m["binding"] for m in summary["gpu_map"]} == {binding}
    assert all(m["slurm_allocation"] for m in summary["gpu_map"])


def test_colliding_tasks_are_refused_before_submission(hpc_ddp: Run, slurm_env: dict[str, str],
                                                       tmp_path: Path) -> None:
    before = subprocess.run(["squeue", "-h", "-o", "%i"], env=slurm_env, capture_output=True,
                            text=True).stdout
    done = hpc_ddp("submit", ["cluster=slurm", "nodes=2", "cluster.gpus_per_node=2",
                              "cluster.tasks_per_node=4", f"run_dir={tmp_path}/r"], env=slurm_env)
    assert done.returncode == 2
    assert "cluster.tasks_per_node=4" in done.stderr and "cluster.gpus_per_node=2" in done.stderr
    assert not (tmp_path / "r").exists()
    after = subprocess.run(["squeue", "-h", "-o", "%i"], env=slurm_env, capture_output=True,
                           text=True).stdout
    assert set(after.split()) <= set(before.split())  # nothing was submitted


def test_gpu_allocated_but_no_cuda_fails_at_once(hpc_ddp: Run, node_names: list[str],
                                                 slurm_env: dict[str, str],
                                                 tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", ["cluster=slurm", "nodes=2", "cluster.gpus_per_node=2",
                              "trainer.max_steps=10", *SMALL, f"run_dir={run_dir}", "wait=true"],
                   env=slurm_env, timeout=180)
    assert done.returncode == 1
    error = (run_dir / "logs" / "rank0.error").read_text()
    assert "Slurm allocated a GPU (SLURM_" in error and "sees no CUDA device" in error
    assert "trainer.device=cpu" in error and error.startswith(f"rank 0 on {node_names[0]}")
    assert not (run_dir / "summary.json").exists()
    assert_ended(job_id_of(done.stdout), slurm_env, "FAILED", done.stdout)


def test_doctor_shows_the_rank_node_gpu_map(hpc_ddp: Run, slurm_env: dict[str, str],
                                            tmp_path: Path) -> None:
    done = hpc_ddp("doctor", ["cluster=slurm", "nodes=2", "cluster.gpus_per_node=2",
                              "trainer.device=cpu", f"run_dir={tmp_path / 'doc'}"], env=slurm_env)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("rank -> node -> GPU")),
                "")
    pairs = [entry.split("->")[1] for entry in line.split(": ", 1)[1].split(", ")] if line else []
    assert len(pairs) == 4 and len(set(pairs)) == 4, done.stdout + done.stderr
    assert "FAIL  [one task per GPU]" not in done.stdout and done.returncode == 0
    assert_completed(job_id_of(done.stdout), slurm_env, done.stdout)
