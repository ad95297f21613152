"""The tuned trainer keeps its guarantees: stretches of train_steps are one run, and the
loader's fast path and workers train to the same weights bitwise. One rank, in process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_ddp.config.compose import compose
from hpc_ddp.config.schema import Config
from hpc_ddp.rank.services import precision
from hpc_ddp.rundir import RunDir
from hpc_ddp.trainer import ddp_setup
from hpc_ddp.trainer.models import builtin_model
from tests.unit import one_rank
from tests.unit.one_rank import ENV

SMALL = ["trainer.max_steps=12", "trainer.batch_size=16", "data.train_size=160",
         "data.eval_size=32", "data.augment=true", "trainer.grad_accum=2",
         "trainer.log_interval=3", "trainer.checkpoint_interval=1000"]


def _trainer(overrides: list[str], folder: Path) -> Any:
    return one_rank.trainer([*SMALL, *overrides], folder)


def _weights(trainer: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.module.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_stretches_of_train_steps_are_one_run(one_rank_group: None, tmp_path: Path) -> None:
    whole = _trainer([], tmp_path / "a")
    assert whole.model.bucket_bytes_cap_default  # DDP's own buckets: 1 MiB first, then 25
    whole.train()
    parts = _trainer([], tmp_path / "b")
    parts.begin()
    for n in (5, 1, 4, 100):  # mid-epoch stops, then past the end (stops at max_steps)
        parts.train_steps(n)
    parts.close()
    assert parts.global_step == whole.global_step == 12
    assert _same(_weights(whole), _weights(parts))
    assert parts.window == whole.window and parts.epoch == whole.epoch


@pytest.mark.parametrize("variant", [["data.batched=false"], ["data.num_workers=2"],
                                     ["trainer.fused_optimizer=false"]])
def test_loader_and_optimizer_paths_train_the_same_weights(one_rank_group: None, tmp_path: Path,
                                                           variant: list[str]) -> None:
    reference = _trainer(["trainer.precision=fp32"], tmp_path / "ref")
    reference.train()
    other = _trainer(["trainer.precision=fp32", *variant], tmp_path / "other")
    other.train()
    if variant == ["trainer.fused_optimizer=false"]:  # another kernel: equal to rounding
        a, b = _weights(reference), _weights(other)
        assert all(torch.allclose(a[k].float(), b[k].float(), atol=1e-5) for k in a)
    else:
        assert _same(_weights(reference), _weights(other))


def test_settings_in_the_summary_and_the_model(one_rank_group: None, tmp_path: Path) -> None:
    trainer = _trainer(["trainer.channels_last=true", "trainer.ddp_bucket_cap_mb=3",
                        "trainer.ddp_static_graph=true", "trainer.grad_accum=1"], tmp_path / "s")
    assert trainer.tuning.channels_last and trainer.tuning.batched_loader
    assert trainer.model.bucket_bytes_cap == 3 * 2**20 and trainer.model.static_graph
    assert trainer.model.gradient_as_bucket_view
    weight = trainer.model.module[0].weight
    assert weight.is_contiguous(memory_format=torch.channels_last)
    summary = trainer.train()
    assert summary["settings"]["ddp_bucket_cap_mb"] == 3 and summary["global_step"] == 12


def _cfg(*overrides: str) -> Config:
    return compose(list(overrides))


@pytest.mark.parametrize("overrides, device, native, expected", [
    ((), "cpu", True, ("bf16", True, True)),
    ((), "cpu", False, ("fp32", True, True)),
    ((), "cuda", False, ("bf16", True, True)),
    (("trainer.precision=fp32", "trainer.channels_last=false",
      "trainer.fused_optimizer=false"), "cuda", True, ("fp32", False, False)),
    (("trainer.precision=bf16",), "cpu", False, ("bf16", True, True)),
])
def test_auto_settings(monkeypatch: pytest.MonkeyPatch, overrides: tuple[str, ...], device: str,
                       native: bool, expected: tuple[str, bool, bool]) -> None:
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    tune = ddp_setup.tuning(_cfg(*overrides), torch.device(device),
                            builtin_model("tiny_cnn", 10, 32))
    assert (tune.precision, tune.channels_last, tune.fused_optimizer) == expected


def test_channels_last_only_for_conv_nets() -> None:
    cfg = _cfg("trainer.channels_last=true")
    null = builtin_model("null", 10, 32)  # no convolution
    assert not ddp_setup.tuning(cfg, torch.device("cpu"), null).channels_last
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert not ddp_setup.tuning(cfg, torch.device("cpu"), mlp).channels_last
    assert ddp_setup.tuning(cfg, torch.device("cpu"), builtin_model("resnet18", 10, 32)
                            ).channels_last
    assert ddp_setup.autocast_dtype("fp32") is None
    assert ddp_setup.autocast_dtype("bf16") == torch.bfloat16


def test_static_graph_with_accumulation_is_refused() -> None:
    from hpc_ddp.errors import UserError

    with pytest.raises(UserError, match="no_sync"):
        compose(["trainer.ddp_static_graph=true", "trainer.grad_accum=2"])


@pytest.mark.parametrize("log_interval", [4, 3])
def test_an_agreed_stop_checkpoints_and_raises(one_rank_group: None, tmp_path: Path,
                                               log_interval: int) -> None:
    from hpc_ddp.rank.services import checkpoint, stopping
    from hpc_ddp.trainer.loop import Trainer

    cfg = compose([*SMALL, "trainer.stop_check_interval=4",
                   f"trainer.log_interval={log_interval}"])
    stop = stopping.StopRequest()
    trainer = Trainer(cfg, ENV, RunDir(tmp_path), torch.device("cpu"), stop)
    trainer.begin()
    trainer.train_steps(2)
    stop.code = stopping.REQUEUE  # as the signal handler would
    with pytest.raises(stopping.StopTraining) as stopped:
        trainer.train_steps(100)
    trainer.close()
    # Agreed at step 4's collective, acted on when it is read: the step after.
    assert stopped.value.code == stopping.REQUEUE and stopped.value.step == 5
    state = checkpoint.load_latest(tmp_path / "checkpoints")
    assert state is not None and state["counters"]["global_step"] == 5
