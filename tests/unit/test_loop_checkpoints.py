"""A loop's checkpoints (rank/services/loop_checkpoints.py), the one implementation the
built-in trainer and a user's loop (ctx.save/ctx.load) share; the metrics they log."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpc_ddp.config.compose import compose
from hpc_ddp.rank.context.context import Context, _progress_names
from hpc_ddp.rank.join.distenv import DistEnv
from hpc_ddp.rank.services import checkpoint
from hpc_ddp.rank.services.loop_checkpoints import LoopCheckpoints
from hpc_ddp.rank.services.metrics import MetricsWriter
from hpc_ddp.rundir import RunDir


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def _saves(tmp_path: Path, program: str | None = "entry my.loop:main") -> LoopCheckpoints:
    cfg = compose(["trainer.checkpoint_background=false"])
    return LoopCheckpoints(cfg.trainer, RunDir(tmp_path / "run"), 0, 1, 0, program)


def test_the_loop_gets_back_its_own_keys_and_ours_sit_beside_them(group: None,
                                                                  tmp_path: Path) -> None:
    saves = _saves(tmp_path)
    saves.save({"step": 4, "model": {"w": torch.ones(2)}}, 4)
    whole = checkpoint.load_latest(tmp_path / "run" / "checkpoints")
    assert whole is not None and set(whole) == {"step", "model", "hpc_ddp"}
    assert whole["hpc_ddp"] == {"step": 4, "world_size": 1, "restarts": [],
                                "program": "entry my.loop:main"}
    again = _saves(tmp_path)
    state = again.load("requeue")
    assert state is not None and set(state) == {"step", "model"}
    assert again.resumed_from_step == 4 and again.restarts[0]["cause"] == "requeue"
    with pytest.raises(ValueError, match="'hpc_ddp'"):  # our key is ours
        again.save({"hpc_ddp": 1}, 5)


def test_generators_continue_where_they_were_saved(group: None, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    saves = _saves(tmp_path)
    saves.save({"x": torch.zeros(1)}, 1, {"loader": gen})
    expected = torch.rand(4, generator=gen)
    gen.manual_seed(123)  # a new process starts its generator afresh
    _saves(tmp_path).load("resume", {"loader": gen})
    assert torch.equal(torch.rand(4, generator=gen), expected)


def test_a_state_check_that_refuses_falls_back_to_the_one_before(group: None,
                                                                 tmp_path: Path) -> None:
    saves = _saves(tmp_path)
    saves.save({"width": 8}, 1)
    saves.save({"width": 16}, 2)

    def check(state: dict[str, object]) -> None:
        if state["width"] != 8:
            raise RuntimeError("size mismatch for width")

    again = _saves(tmp_path)
    state = again.load("resume", check=check)
    assert state == {"width": 8} and again.resumed_from_step == 1


@pytest.mark.parametrize("layout", ["ctx.save's first", "the trainer's first"])
def test_checkpoints_of_the_earlier_layouts_still_resume(group: None, tmp_path: Path,
                                                         layout: str) -> None:
    folder = tmp_path / "run" / "checkpoints"
    if layout == "ctx.save's first":
        whole = {"user": {"step": 3, "w": torch.ones(1)},
                 "hpc_ddp": {"step": 3, "world_size": 1, "restarts": [], "program": "x"}}
        expected = {"step": 3, "w": torch.ones(1)}
    else:
        whole = {"model": {"w": torch.ones(1)}, "counters": {"global_step": 3},
                 "restarts": [{"from_step": 1, "cause": "resume", "time": 0.0}],
                 "world_size": 1}
        expected = {"model": {"w": torch.ones(1)}, "counters": {"global_step": 3}}
    checkpoint.save(whole, folder, 3, keep=2)
    saves = _saves(tmp_path)
    state = saves.load("resume")
    assert state is not None and state.keys() == expected.keys()
    assert saves.resumed_from_step == 3
    assert len(saves.restarts) == (2 if layout == "the trainer's first" else 1)


def test_a_file_that_is_no_loops_checkpoint_is_not_resumed(group: None, tmp_path: Path) -> None:
    checkpoint.save({"weights": torch.ones(1)}, tmp_path / "run" / "checkpoints", 1, keep=2)
    with pytest.raises(checkpoint.CheckpointError, match="not a checkpoint of an hpc_ddp"):
        _saves(tmp_path).load("resume")


def test_tensorboard_drops_what_an_earlier_attempt_logged_after_the_checkpoint(
        tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    first = MetricsWriter(tb, tmp_path / "progress.json", True, None, 10)
    for step in range(1, 9):
        first.scalars(step, {"loss": float(step)})
    first.close()
    # Resumed from the checkpoint of step 4 (steps 5-8 are logged again).
    second = MetricsWriter(tb, tmp_path / "progress.json", True, 4, 10)
    for step in range(5, 11):
        second.scalars(step, {"loss": 100.0 + step})
    second.close()
    events = EventAccumulator(str(tb))
    events.Reload()
    seen = [(e.step, e.value) for e in events.Scalars("loss")]
    assert seen == [(s, float(s)) for s in range(1, 5)] + [(s, 100.0 + s) for s in range(5, 11)]


def test_progress_names_a_tag_by_its_last_part_unless_two_share_it() -> None:
    assert _progress_names({"train/loss": 1.0, "train/lr": 0.1}) == {"loss": 1.0, "lr": 0.1}
    assert _progress_names({"train/loss": 1.0, "val/loss": 2.0, "acc": 3.0}) == {
        "train/loss": 1.0, "val/loss": 2.0, "acc": 3.0}


def test_the_trainer_runs_through_a_context(group: None, tmp_path: Path) -> None:
    from hpc_ddp.trainer.loop import Trainer

    cfg = compose(["model=tiny_cnn", "data=synthetic", "trainer.max_steps=2",
                   "trainer.batch_size=8", "data.train_size=32", "data.eval_size=16",
                   "trainer.checkpoint_interval=1", "trainer.log_interval=1"])
    env = DistEnv(0, 0, 1, 0, 1, 1, "single", "test")
    trainer = Trainer(cfg, env, RunDir(tmp_path / "run"), torch.device("cpu"))
    assert isinstance(trainer.ctx, Context)
    summary = trainer.train()
    whole = checkpoint.load_latest(tmp_path / "run" / "checkpoints")
    assert whole is not None and whole["hpc_ddp"]["step"] == summary["global_step"] == 2
    assert {"model", "optimizer", "counters"} <= set(whole) and "restarts" not in whole
