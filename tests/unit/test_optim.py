"""Optimizer state on resume: the state comes from the checkpoint, the kernel choice from now."""

from __future__ import annotations

import torch

from hpc_ddp.config.schema import OptimConfig
from hpc_ddp.trainer.optim import build_optimizer, load_optimizer_state


def _trained(foreach: bool) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=foreach)
    model(torch.randn(8, 4)).square().mean().backward()
    opt.step()
    return opt


def test_checkpoint_state_is_loaded_but_the_kernel_choice_stays_the_current_one() -> None:
    saved = _trained(foreach=True).state_dict()
    assert saved["param_groups"][0]["foreach"] is True

    model = torch.nn.Linear(4, 3)
    fresh = build_optimizer(model.parameters(), OptimConfig(name="sgd", lr=0.5, momentum=0.9),
                            fused=False)
    before = fresh.param_groups[0]["foreach"]
    load_optimizer_state(fresh, saved)

    group = fresh.param_groups[0]
    assert group["foreach"] == before and group["foreach"] is not True
    assert group["lr"] == 0.1  # the hyper-parameters are the checkpoint's (the schedule's)
    buffers = [fresh.state[p]["momentum_buffer"] for p in group["params"]]
    expected = [s["momentum_buffer"] for s in saved["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(buffers, expected, strict=True))


def test_plain_load_state_dict_would_have_taken_the_checkpoints_flag() -> None:
    """The reason load_optimizer_state exists: torch restores the saved flag."""
    saved = _trained(foreach=True).state_dict()
    fresh = torch.optim.SGD(torch.nn.Linear(4, 3).parameters(), lr=0.5, foreach=False)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["foreach"] is True
