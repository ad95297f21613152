"""A resume that cannot load the run's checkpoint is refused before it is submitted."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_ddp.config.compose import compose
from hpc_ddp.errors import UserError
from hpc_ddp.inputs.resume_check import check_resumable
from hpc_ddp.inputs.run_dir import write_run_config
from hpc_ddp.rank.services.checkpoint import LATEST
from hpc_ddp.rundir import RunDir

FIRST = ["cluster=local", "model=tiny_cnn", "trainer.max_steps=50"]


def _run_at_step(tmp_path: Path, step: int | None) -> RunDir:
    run = RunDir(tmp_path / "run")
    write_run_config(run, compose(FIRST), FIRST)
    if step is not None:
        run.checkpoints.mkdir(parents=True)
        name = f"step_{step:09d}.pt"
        (run.checkpoints / name).write_bytes(b"")  # only its name is read here
        (run.checkpoints / LATEST).write_text(name)
    return run


@pytest.mark.parametrize("change, message", [
    (["model=resnet18"], r"model\.name=resnet18: changes the network.*model\.name=tiny_cnn"),
    (["data.image_size=64"], r"data\.image_size=64: changes the network.*image_size=32"),
    (["optim=adamw"], r"optim=adamw: differs from the checkpoint's optimizer \(sgd\)"),
    (["trainer.max_steps=34"], r"trainer\.max_steps=34: the run is at step 34 already"),
])
def test_refused_with_what_the_checkpoint_holds(tmp_path: Path, change: list[str],
                                                message: str) -> None:
    run = _run_at_step(tmp_path, 34)
    with pytest.raises(UserError, match=message):
        check_resumable(compose([*FIRST, "resume=true", *change]), run)


def test_what_the_checkpoint_can_take_passes(tmp_path: Path) -> None:
    run = _run_at_step(tmp_path, 34)
    check_resumable(compose([*FIRST, "resume=true", "trainer.max_steps=100", "optim.lr=0.01",
                             "model.num_classes=10"]), run)


def test_without_a_checkpoint_anything_goes(tmp_path: Path) -> None:
    run = _run_at_step(tmp_path, None)
    check_resumable(compose([*FIRST, "resume=true", "model=resnet18", "optim=adamw"]), run)


def _epochs_run(tmp_path: Path, epochs_done: int) -> tuple[RunDir, list[str]]:
    """A run of trainer.epochs=2 whose latest checkpoint says ``epochs_done`` epochs."""
    import torch

    first = ["cluster=local", "model=tiny_cnn", "trainer.epochs=2"]
    run = RunDir(tmp_path / "run")
    write_run_config(run, compose(first), first)
    run.checkpoints.mkdir(parents=True)
    name = "step_000000064.pt"
    torch.save({"counters": {"epoch": epochs_done, "global_step": 64}}, run.checkpoints / name)
    (run.checkpoints / LATEST).write_text(name)
    return run, first


def test_a_finished_epochs_run_is_refused_like_a_finished_max_steps_run(tmp_path: Path) -> None:
    # One behaviour for both ways of giving a run its length (quickstart.md "Resume a run").
    run, first = _epochs_run(tmp_path, 2)
    with pytest.raises(UserError, match=r"trainer\.epochs=2: the run has completed 2 epoch\(s\) "
                       r"already \(step 64\).*Fix: give trainer\.epochs above 2"):
        check_resumable(compose([*first, "resume=true"]), run)
    check_resumable(compose([*first, "resume=true", "trainer.epochs=3"]), run)
    check_resumable(compose([*first, "resume=true", "trainer.max_steps=80"]), run)


def test_an_epochs_run_stopped_mid_way_resumes(tmp_path: Path) -> None:
    run, first = _epochs_run(tmp_path, 1)
    check_resumable(compose([*first, "resume=true"]), run)
