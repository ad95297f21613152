"""LR schedule, environment rule and masking, device choice: pure functions over tables."""

from __future__ import annotations

import pytest

from hpc_ddp.config.schema import NcclConfig, SchedulerConfig
from hpc_ddp.rank.join.nccl import mask, planned_changes, recorded_env
from hpc_ddp.trainer.optim import lr_factor


def test_warmup_then_cosine_to_min() -> None:
    cfg = SchedulerConfig(warmup_steps=4, name="cosine", min_lr_ratio=0.1)
    factors = [lr_factor(s, 20, cfg) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(factors[4:], factors[5:], strict=False))
    assert lr_factor(20, 20, cfg) == pytest.approx(0.1)


def test_linear_and_constant() -> None:
    assert lr_factor(10, 20, SchedulerConfig(warmup_steps=0, name="linear")) == pytest.approx(0.5)
    assert lr_factor(15, 20, SchedulerConfig(warmup_steps=0, name="constant")) == 1.0


def test_profile_overrides_exports_and_leaves_the_rest() -> None:
    cfg = NcclConfig(env={"NCCL_DEBUG": "WARN", "NCCL_IB_TIMEOUT": "22"},
                     extra_env={"NCCL_SOCKET_IFNAME": "=ib0"})
    environ = {"NCCL_DEBUG": "INFO", "NCCL_IB_TIMEOUT": "22", "NCCL_ALGO": "Ring"}
    changes = {c.name: (c.old, c.new) for c in planned_changes(cfg, environ)}
    assert changes == {"NCCL_DEBUG": ("INFO", "WARN"), "NCCL_SOCKET_IFNAME": (None, "=ib0")}


def test_secrets_are_masked_in_records() -> None:
    recorded = recorded_env({"NCCL_DEBUG": "INFO", "TORCH_HUB_TOKEN": "abc",
                             "SLURM_JOB_ID": "3", "HOME": "/root", "NCCL_API_KEY": "k"})
    assert recorded == {"NCCL_API_KEY": "****", "NCCL_DEBUG": "INFO", "SLURM_JOB_ID": "3",
                        "TORCH_HUB_TOKEN": "****"}
    assert mask("MY_PASSWORD", "x") == "****" and mask("NCCL_ALGO", "Ring") == "Ring"
