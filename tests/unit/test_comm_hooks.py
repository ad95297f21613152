"""DDP's communication hook as checked configuration (trainer.ddp_comm_hook): the schema's
and conf/'s defaults, the refusals in one line naming the key and the fix, and, on one rank in
process, what the hook does: accumulation's micro-batches reduce nothing, PowerSGD's state
travels as data, and a resumed loop that did not settle gets a plain all-reduce in DDP's first
bucket layout rather than error feedback meant for other parameters."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_ddp.config.compose import compose
from hpc_ddp.config.schema import TrainerConfig
from hpc_ddp.config.sync_rules import COMM_HOOKS
from hpc_ddp.rank.services import comm_hooks, trusted
from tests.conftest import compose_refusal
from tests.unit import one_rank

# 16 micro-batches of 4 an epoch; 3 to a step.
SMALL = ["trainer.batch_size=4", "data.train_size=64", "data.eval_size=8",
         "data.image_size=16", "trainer.checkpoint_interval=1000", "trainer.log_interval=100",
         "trainer.precision=fp32"]


def test_defaults_in_schema_and_conf() -> None:
    t = TrainerConfig()
    assert (t.ddp_comm_hook, t.ddp_powersgd_rank, t.ddp_powersgd_warmup_steps) == (
        "none", 1, 1000)
    c = compose([]).trainer
    assert (c.ddp_comm_hook, c.ddp_powersgd_rank, c.ddp_powersgd_warmup_steps) == (
        "none", 1, 1000)
    assert COMM_HOOKS == ("none", "fp16", "bf16", "powersgd")


@pytest.mark.parametrize(("overrides", "says"), [
    (["trainer.ddp_comm_hook=int8"],
     "trainer.ddp_comm_hook=int8: is not a communication hook. Fix: use one of none, fp16, "
     "bf16, powersgd."),
    (["trainer.strategy=fsdp", "trainer.ddp_comm_hook=bf16"],
     "under trainer.strategy=fsdp FSDP reduces the gradients itself. Fix: set "
     "trainer.ddp_comm_hook=none, or trainer.strategy=ddp."),
    (["trainer.strategy=fsdp", "trainer.ddp_comm_hook=powersgd"], "trainer.strategy=ddp."),
    (["trainer.ddp_comm_hook=powersgd", "trainer.precision=fp16"],
     "leave NaN in PowerSGD's error feedback for good. Fix: use trainer.precision=bf16 or "
     "fp32 with PowerSGD, or trainer.ddp_comm_hook=fp16 with fp16."),
    (["trainer.ddp_powersgd_rank=0"], "trainer.ddp_powersgd_rank=0: must be >= 1"),
    (["trainer.ddp_powersgd_warmup_steps=1"],
     "trainer.ddp_powersgd_warmup_steps=1: must be >= 2: torch's PowerSGD compresses only "
     "after DDP has rebuilt its buckets."),
    (["trainer.ddp_bucket_cap_mb=0"], "trainer.ddp_bucket_cap_mb=0: must be >= 1."),
    (["trainer.ddp_static_graph=true", "trainer.grad_accum=2"], "(no_sync)"),
])
def test_refused_in_one_line(overrides: list[str], says: str) -> None:
    message = compose_refusal(overrides)
    assert says in message, message


@pytest.mark.parametrize("overrides", [
    ["trainer.ddp_comm_hook=fp16", "trainer.precision=fp16"],  # the loss scaler sees infs
    ["trainer.ddp_comm_hook=powersgd", "trainer.precision=bf16", "trainer.grad_accum=4"],
    ["trainer.ddp_comm_hook=bf16", "trainer.ddp_static_graph=true"],
    # A function entry picks ctx.ddp or ctx.shard itself (ctx.shard refuses a hook).
    ["trainer.ddp_comm_hook=bf16", "trainer.strategy=fsdp", "entry=my_pkg.train:main"],
])
def test_accepted(overrides: list[str]) -> None:
    assert compose(overrides).trainer.ddp_comm_hook != "none"


def _trainer(overrides: list[str], folder: Path) -> Any:
    return one_rank.trainer([*SMALL, *overrides], folder)


@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_accumulating_micro_batches_skip_the_sync(one_rank_group: None, tmp_path: Path,
                                                  hook: str) -> None:
    """grad_accum=3: 15 micro-batches, 5 steps; the hook sees each bucket once a step (and
    once in the settling step), never in no_sync."""
    trainer = _trainer(["trainer.grad_accum=3", "trainer.max_steps=5",
                        f"trainer.ddp_comm_hook={hook}", "trainer.ddp_powersgd_warmup_steps=2"],
                       tmp_path)
    registered = comm_hooks.registered(trainer.model)
    assert registered is not None and registered.name == hook
    trainer.begin()
    buckets = registered.calls  # the settling step's: one call per bucket
    assert buckets >= 1 and registered.syncs == 0
    trainer.train_steps(5)
    trainer.close()
    assert trainer.global_step == 5 and (trainer.epoch, trainer.micro_in_epoch) == (0, 15)
    assert registered.syncs == 5 and registered.calls == buckets * 6
    assert trainer.tuning.ddp_comm_hook == hook
    if hook == "powersgd":  # the warm-up counter counts steps, not the settling step
        assert registered.state.iter == 5 and registered.state.error_dict


def test_static_graph_settles_in_two_passes_that_leave_powersgd_alone(one_rank_group: None,
                                                                      tmp_path: Path) -> None:
    """static_graph rebuilds DDP's buckets after its second iteration: the settling runs
    both, plain, and the warm-up counter counts only the training steps."""
    trainer = _trainer(["trainer.max_steps=3", "trainer.ddp_static_graph=true",
                        "trainer.ddp_comm_hook=powersgd", "trainer.ddp_powersgd_warmup_steps=2"],
                       tmp_path)
    registered = comm_hooks.registered(trainer.model)
    assert registered is not None
    trainer.begin()
    assert registered.calls >= 2 and registered.state.iter == 0 and not registered.syncs
    trainer.train_steps(3)
    trainer.close()
    assert registered.syncs == 3 and registered.state.iter == 3
    assert registered.state.error_dict  # the third step compressed


def _powersgd_model() -> Any:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model = DDP(net)
    hook = comm_hooks.register(model, TrainerConfig(ddp_comm_hook="powersgd",
                                                    ddp_powersgd_warmup_steps=2))
    assert hook is not None
    return model, hook


def _step(model: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 32, generator=g)).square().sum().backward()
    for p in model.parameters():
        p.grad = None


def test_powersgd_state_is_data_and_a_first_layout_gets_a_plain_all_reduce(
        one_rank_group: None, caplog: pytest.LogCaptureFixture) -> None:
    model, hook = _powersgd_model()
    for seed in range(4):  # 2 plain, 2 compressed
        _step(model, seed)
    saved = hook.state_dict()
    assert saved["iter"] == 4 and saved["error"] and saved["p"] and saved["q"]
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = trusted.load_data(buffer)  # weights_only: tensors and numbers only

    resumed, again = _powersgd_model()  # a new DDP: its first bucket layout
    again.load_state_dict(loaded)
    assert again.state_dict()["error"][0].equal(saved["error"][0])
    error = again.state.error_dict[0].clone()
    with caplog.at_level(logging.WARNING, logger=comm_hooks.__name__):
        _step(resumed, 10)  # not settled: the saved layout is not this one
    assert again.state.iter == 5 and torch.equal(again.state.error_dict[0], error)
    assert "ctx.settle_buckets" in caplog.text
    _step(resumed, 11)  # DDP has rebuilt its buckets: the saved state applies again
    assert again.state.iter == 6 and not torch.equal(again.state.error_dict[0], error)
