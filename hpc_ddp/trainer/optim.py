"""Optimizer and LR schedule from the optim and scheduler configs (built in, or `_target_`)."""

from __future__ import annotations

import math
from typing import Any

from hpc_ddp.config.schema import OptimConfig, SchedulerConfig


def build_optimizer(params: Any, cfg: OptimConfig, fused: bool | None = False,
                    device_type: str = "cpu") -> Any:
    """The optimizer; ``fused``: True fused, False torch's default implementation, None auto
    (fused where torch has a fused kernel for ``device_type``; built-in optimizers only: a
    `_target_` optimizer runs as its arguments say)."""
    import torch  # deferred: torch

    if cfg.target is not None:
        from hpc_ddp.targets import TargetError, build, call_safely  # deferred (start-up): targets

        make = build("optim", cfg.target, cfg.kwargs, partial=True)
        optimizer = call_safely(make, "optim._target_", cfg.target, params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TargetError("optim._target_", cfg.target, f"made a "
                              f"{type(optimizer).__name__}, not a torch.optim.Optimizer.",
                              "name an optimizer class (called with the model's parameters).")
        return optimizer
    impl = {"fused": True} if use_fused(fused, device_type) else {}
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                               nesterov=cfg.nesterov and cfg.momentum > 0,
                               weight_decay=cfg.weight_decay, **impl)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]),
                             weight_decay=cfg.weight_decay, **impl)


def use_fused(fused: bool | None, device_type: str) -> bool:
    """Whether the optimizer runs as one fused kernel (trainer.fused_optimizer resolved)."""
    if fused is not None:
        return fused
    try:  # torch's own list (internal; the GPU image's torch 2.11 has it too)
        # optional: torch
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return device_type == "cuda"
    return device_type in _get_fused_kernels_supported_devices()


def fused_on_sharded(cfg: OptimConfig, model: Any, device_type: str) -> str | None:
    """None when the built-in optimizer's fused kernel runs on ``model``'s sharded parameters
    (DTensors), else why not. torch registers sharding rules for some fused kernels only
    (AdamW's, not SGD's: "Operator aten._fused_sgd_.default does not have a sharding strategy
    registered"); rather than keep a list per torch version, the kernel is tried once on a
    one-element DTensor laid out as the model's first parameter (no collective: each rank
    steps its own element)."""
    # deferred: torch
    import torch
    from torch.distributed.tensor import DTensor

    first = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    if first is None:
        return None

    def like(value: float) -> Any:
        local = torch.full((1,), value, device=first.to_local().device)
        return DTensor.from_local(local, first.device_mesh, first.placements, run_check=False)

    probe = torch.nn.Parameter(like(1.0))
    probe.grad = like(0.5)
    try:
        build_optimizer([probe], cfg, True, device_type).step()
    except (NotImplementedError, RuntimeError) as exc:
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return None


# The param-group keys that choose how the update runs, not what it computes. torch saves them
# in the optimizer's state_dict and load_state_dict would bring them back; the run's current
# config (and device) decides them instead, so a checkpoint written with a fused kernel on a
# GPU resumes on a CPU, and `trainer.fused_optimizer=false` on resume takes effect.
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def load_optimizer_state(optimizer: Any, state: dict[str, Any]) -> None:
    """optimizer.load_state_dict(state), keeping the optimizer's own implementation flags."""
    chosen = [{k: group[k] for k in _IMPLEMENTATION_KEYS if k in group}
              for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, keys in zip(optimizer.param_groups, chosen, strict=True):
        group.update(keys)
    _strides_of_parameters(optimizer)


def _strides_of_parameters(optimizer: Any) -> None:
    """Each state tensor shaped like its parameter laid out like it. A checkpoint read
    through DCP gives contiguous tensors, while a channels_last convolution's weight is not;
    torch's fused and foreach kernels walk a parameter and its momentum as flat memory, so
    the mismatch mixes up elements (a resumed run's first step differed, seen here)."""
    import torch  # deferred: torch

    for param, values in optimizer.state.items():
        for key, value in list(values.items()):
            if (isinstance(value, torch.Tensor) and value.shape == param.shape
                    and value.stride() != param.stride()):
                values[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)


def lr_factor(step: int, total_steps: int, cfg: SchedulerConfig) -> float:
    """Multiplier of the lr at optimizer step ``step`` (0-based): warm-up, then the schedule."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.name == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.name == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: Any, cfg: SchedulerConfig, total_steps: int) -> Any:
    """The LR scheduler, stepped once per optimizer step (a `_target_` one is called with the
    optimizer: torch.optim.lr_scheduler.StepLR with step_size in steps, or your own)."""
    from torch.optim.lr_scheduler import LambdaLR  # deferred: torch

    if cfg.target is not None:
        from hpc_ddp.targets import TargetError, build, call_safely  # deferred (start-up): targets

        make = build("scheduler", cfg.target, cfg.kwargs, partial=True)
        scheduler = call_safely(make, "scheduler._target_", cfg.target, optimizer)
        if not (hasattr(scheduler, "step") and hasattr(scheduler, "state_dict")):
            raise TargetError("scheduler._target_", cfg.target, f"made a "
                              f"{type(scheduler).__name__}, which has no step()/state_dict().",
                              "name an LR scheduler (called with the optimizer).")
        return scheduler
    return LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg))
