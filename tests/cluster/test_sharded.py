"""Sharded models on the real 4-node cluster (docs/your-code.md#models-larger-than-one-gpu,
docs/fault-tolerance.md#sharded-checkpoints-dcp): the example project's transformer under
trainer.strategy=fsdp, and its own loop as a function entry with ctx.shard, each

- stopped on 4 nodes (the requeue signal; the loop's ranks also SIGKILLed in the middle of
  its asynchronous saves, one every step) and resumed bitwise on 4,
- then continued on 2 nodes from the 4-node checkpoint, the loss curve within a stated
  tolerance of the uninterrupted 4-node run's;

and a file planted in a sharded checkpoint refused before anything is submitted, its payload
never run.

The learning rate is constant after its warm-up (scheduler=constant; the loop's AdamW has no
schedule), so the 60-step runs train the first 60 steps of the 90-step reference exactly.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_ddp.rank.services import checkpoint, dcp_read
from tests.cluster.slurm_final import assert_completed
from tests.cluster.test_checkpoints_and_secrets import Payload
from tests.cluster.test_fault_tolerance import (
    assert_completed_at_last,
    finish_releasing_requeues,
    squeue_state,
    wait_for_step,
)
from tests.cluster.test_slurm_submit import job_id_of
from tests.cluster.test_your_code import (
    PROJECT,
    finish_beside,
    requeue_signal,
    run_to_end,
    start_beside,
    submit,
)
from tests.integration.test_local_run import tb_scalars

pytestmark = pytest.mark.cluster
Run = Callable[..., subprocess.CompletedProcess[str]]
COMMON = ["--config-dir", "conf", "cluster=slurm", "trainer.stop_check_interval=2",
          "trainer.collective_timeout_s=60", "trainer.rendezvous_timeout_s=60",
          "trainer.keep_checkpoints=12"]
# The trainer's ranks each in their own process, without a supervisor: sharding, the stop
# agreement and the requeue are what is tested here (4 ranks' processes on 2 shared cores,
# not 8); the entry's test below keeps them for its SIGKILLs.
TRAINER = [*COMMON, "trainer.strategy=fsdp", "scheduler=constant", "cluster.supervise=false",
           "trainer.checkpoint_interval=10", "trainer.log_interval=10",
           "trainer.eval_interval=30"]
ENTRY = [*COMMON, "entry=seqproj.loop:main", "app.shard=true"]
# Each logged loss of the run continued on 2 nodes from the 4-node checkpoint at step 60 lies
# within this fraction of the loss at step 60 from the 4-node run's at the same step (the same
# samples in the same order, a global batch half as large; measured locally: at most 0.12).
TOLERANCE = 0.25


def state_at(run_dir: Path, step: int) -> dict[str, Any]:
    """A run's checkpoint of ``step``, every tensor whole."""
    found = [p for p in checkpoint.entries(run_dir / "checkpoints")
             if checkpoint.step_of(p) == step]
    assert found, f"no checkpoint of step {step} in {run_dir}"
    return checkpoint.read_data(found[-1], run_dir)


def assert_bitwise(expected: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    state = checkpoint.load_latest(run_dir / "checkpoints")
    assert state is not None and state["hpc_ddp"]["step"] == expected["hpc_ddp"]["step"]
    assert checkpoint.latest_path(run_dir / "checkpoints").name.endswith(".dcp")  # type: ignore[union-attr]
    for name, tensor in expected["model"].items():  # every node's shards, bitwise
        assert torch.equal(tensor, state["model"][name]), name
    return state


def continue_on_two(hpc_ddp: Run, args: list[str], env: dict[str, str], run_dir: Path,
                    reference: Path, tag: str) -> dict[str, Any]:
    """Resume the 4-node run ``run_dir`` (at step 60) on 2 nodes to step 90."""
    run_to_end(hpc_ddp, [*args, "nodes=2", "resume=true"], env, run_dir)
    state = checkpoint.load_latest(run_dir / "checkpoints")
    assert state is not None and state["hpc_ddp"]["step"] == 90
    assert state["hpc_ddp"]["world_size"] == 2
    assert state["hpc_ddp"]["restarts"][-1]["from_step"] == 60
    curve = dict(tb_scalars(reference / "tb", tag))
    after = [(s, v) for s, v in tb_scalars(run_dir / "tb", tag) if s > 60]
    assert [s for s, _ in after] == [70, 80, 90]
    assert all(abs(v - curve[s]) <= TOLERANCE * curve[60] for s, v in after), (curve, after)
    return state


def test_fsdp_trainer_requeued_resumes_bitwise_and_continues_on_two_nodes(
        hpc_ddp: Run, slurm_env: dict[str, str], tmp_path: Path) -> None:
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    beside = start_beside(hpc_ddp, [*TRAINER, "nodes=4", "trainer.max_steps=90"], slurm_env,
                          reference)
    job = submit(hpc_ddp, [*TRAINER, "nodes=4", "trainer.max_steps=60"], slurm_env,
                 f"run_dir={run_dir}")
    wait_for_step(run_dir, 20)
    requeue_signal(job, slurm_env)
    assert finish_releasing_requeues(job, run_dir, slurm_env) >= 1
    assert_completed_at_last(job, slurm_env)
    finish_beside(beside, reference, slurm_env)
    state = assert_bitwise(state_at(reference, 60), run_dir)
    assert len(state["hpc_ddp"]["restarts"]) == 1
    steps = [s for s, _ in tb_scalars(run_dir / "tb", "train/loss")]
    assert steps == list(range(10, 61, 10))  # no step twice, none missing
    continue_on_two(hpc_ddp, [*TRAINER, "trainer.max_steps=90"], slurm_env, run_dir,
                    reference, "train/loss")


def release_once(job: str, env: dict[str, str], timeout: float = 180) -> None:
    """Once the requeued job is pending again, let it start (finish_releasing_requeues says
    why not at once)."""
    deadline = time.monotonic() + timeout
    while squeue_state(job, env) != "PENDING":
        assert time.monotonic() < deadline, f"job {job} was not requeued"
        time.sleep(0.2)
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env,
                   capture_output=True, check=False)


def mid_save(folder: Path, timeout: float = 60) -> Path:
    """A sharded set being written (its temp folder, dcp_files.py), as soon as one is."""
    deadline = time.monotonic() + timeout
    while not (found := sorted(folder.glob(".step_*.dcp.*.tmp"))):
        assert time.monotonic() < deadline, "no save in progress"
        time.sleep(0.005)
    return found[-1]


def _rank_pids(run_dir: Path, ranks: int) -> list[int]:
    return [json.loads((run_dir / "ranks" / f"rank{r}.json").read_text())["pid"]
            for r in range(ranks)]


def test_ctx_shard_entry_requeued_killed_mid_save_resumes_bitwise_continues_and_refuses_a_plant(
        hpc_ddp: Run, slurm_env: dict[str, str], tmp_path: Path) -> None:
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    beside = start_beside(hpc_ddp, [*ENTRY, "nodes=4", "app.steps=90", "app.checkpoint_every=10",
                                    "cluster.supervise=false"], slurm_env, reference)
    # A save every step, written in the background: the loop is nearly always mid-save.
    args = [*ENTRY, "nodes=4", "app.steps=60", "app.checkpoint_every=1",
            "cluster.supervise=true"]
    job = submit(hpc_ddp, args, slurm_env, f"run_dir={run_dir}")
    wait_for_step(run_dir, 20)
    first = _rank_pids(run_dir, 4)
    requeue_signal(job, slurm_env)
    release_once(job, slurm_env)
    wait_for_step(run_dir, 40)  # the second start, past its resume
    pids = _rank_pids(run_dir, 4)
    assert set(pids).isdisjoint(first)
    saving = mid_save(run_dir / "checkpoints")
    for pid in pids:  # no Python code of the loop runs after it, its writer thread's neither
        os.kill(pid, signal.SIGKILL)
    # The kill came while a set was being written: that one, or (where it was renamed in the
    # moment before the kill, on a busy machine) the next one, which starts at once.
    def step_of(temp: Path) -> int:
        return int(temp.name.split(".")[1].removeprefix("step_"))

    cut = [t for t in (run_dir / "checkpoints").glob(".step_*.dcp.*.tmp")
           if step_of(t) >= step_of(saving)]
    assert cut, sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    finish_releasing_requeues(job, run_dir, slurm_env)
    assert_completed_at_last(job, slurm_env)
    finish_beside(beside, reference, slurm_env)
    state = assert_bitwise(state_at(reference, 60), run_dir)
    assert len(state["hpc_ddp"]["restarts"]) == 2
    continue_on_two(hpc_ddp, [*ENTRY, "app.steps=90", "app.checkpoint_every=10"], slurm_env,
                    run_dir, reference, "loss")

    latest = checkpoint.latest_path(run_dir / "checkpoints")
    assert latest is not None
    dcp_read.check(latest, run_dir)  # whole and ours, before the plant
    marker = tmp_path / "payload-ran"
    (latest / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    done = hpc_ddp("submit", [*ENTRY, "nodes=4", "app.steps=120", f"run_dir={run_dir}",
                              "resume=true"], env=slurm_env, cwd=PROJECT)
    assert done.returncode == 2 and "planted" in done.stderr, done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not marker.exists()


@pytest.mark.parametrize("model", [[], ["model=resnet50", "data.image_size=16"]],
                         ids=["defaults", "resnet50"])
def test_fsdp_with_the_defaults_trains_checkpoints_and_resumes_on_four_nodes(
        hpc_ddp: Run, slurm_env: dict[str, str], tmp_path: Path, model: list[str]) -> None:
    """What a new user types: trainer.strategy=fsdp and nothing else of ours (the tiny CNN with
    SGD, whose fused kernel has no DTensor rule; ResNet-50 with its BatchNorm layers), run from
    the repository (not the example project), then resumed: both jobs COMPLETED 0:0."""
    run_dir = tmp_path / "run"
    # Sized to the subject (a step, a sharded checkpoint, a resume): one step, then a second
    # after the resume; 32 images to evaluate (ResNet-50 on 4 ranks sharing 2 cores).
    args = ["cluster=slurm", "nodes=4", "trainer.strategy=fsdp", *model, f"run_dir={run_dir}",
            "trainer.batch_size=8", "trainer.checkpoint_interval=1", "data.eval_size=32",
            "wait=true"]
    for steps, resume in ((1, []), (2, ["resume=true"])):
        done = hpc_ddp("submit", [*args, f"trainer.max_steps={steps}", *resume],
                       env=slurm_env, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        assert_completed(job_id_of(done.stdout), slurm_env, done.stdout)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["global_step"], summary["resumed_from_step"]) == (
        4, 2, 1)
    assert summary["settings"]["strategy"] == "fsdp"
    assert summary["final_train_loss"] == summary["final_train_loss"]  # not NaN
    latest = checkpoint.latest_path(run_dir / "checkpoints")
    assert latest is not None and latest.name.endswith(".dcp")
    assert sorted(p.name for p in latest.glob("*.distcp")) == [
        f"__{r}_0.distcp" for r in range(4)]  # every node wrote its own shards
