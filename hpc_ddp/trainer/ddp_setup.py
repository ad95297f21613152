"""The model as a rank trains it: memory format, precision, DDP's options, compilation.

Every choice left on auto in :class:`TrainerConfig` is resolved here, once, into a
:class:`Tuning` the trainer logs and reports in its summary; docs/performance.md has the
measurements behind each default.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from hpc_ddp.config.schema import Config, TrainerConfig
from hpc_ddp.rank.services import rng
from hpc_ddp.rank.services.precision import resolve_precision
from hpc_ddp.trainer.cpu_memory import keep_freed_memory
from hpc_ddp.trainer.models import is_conv_net
from hpc_ddp.trainer.optim import fused_on_sharded, use_fused

if TYPE_CHECKING:  # the type only
    from hpc_ddp.rank.context.context import Context

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tuning:
    """The performance settings in effect on this rank (auto values resolved)."""

    precision: str  # fp32 | bf16 | fp16 (the autocast dtype; fp32: no autocast)
    channels_last: bool
    fused_optimizer: bool
    compile: bool
    ddp_bucket_cap_mb: int | None
    ddp_gradient_as_bucket_view: bool
    ddp_static_graph: bool
    # trainer.ddp_comm_hook (none under fsdp): rank/services/comm_hooks.py
    ddp_comm_hook: str = "none"
    # cuDNN tries the convolution algorithms once per shape and keeps the fastest: on CUDA
    # when trainer.deterministic is off (the fastest may not be deterministic).
    cudnn_benchmark: bool = False
    deterministic: bool = True
    fill_uninitialized_memory: bool = False
    keep_freed_memory: bool = False  # on CPU (hpc_ddp/trainer/cpu_memory.py)
    num_workers: int = 0
    pin_memory: bool = False
    batched_loader: bool = True
    # trainer.strategy: ddp (DistributedDataParallel) | fsdp (FSDP2, rank/services/sharding.py)
    strategy: str = "ddp"
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def autocast_dtype(precision: str, strategy: str = "ddp") -> Any:
    """The autocast dtype of a resolved precision (None: fp32, no autocast; and under fsdp,
    whose mixed-precision policy casts the parameters instead: rank/services/sharding.py)."""
    import torch  # deferred: torch

    if strategy == "fsdp":
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def tuning(cfg: Config, device: Any, model: Any) -> Tuning:
    """Resolve the trainer's auto settings for ``device`` and ``model`` (pure apart from CPU
    feature checks)."""
    t: TrainerConfig = cfg.trainer
    conv = is_conv_net(model) and t.strategy == "ddp"  # fsdp: NCHW (validate refuses true)
    return Tuning(
        precision=resolve_precision(t.precision, device),
        channels_last=conv if t.channels_last is None else t.channels_last and conv,
        fused_optimizer=use_fused(t.fused_optimizer, device.type),
        compile=t.compile,
        ddp_bucket_cap_mb=t.ddp_bucket_cap_mb,
        ddp_gradient_as_bucket_view=t.ddp_gradient_as_bucket_view,
        ddp_static_graph=t.ddp_static_graph,
        ddp_comm_hook=t.ddp_comm_hook if t.strategy == "ddp" else "none",
        cudnn_benchmark=device.type == "cuda" and not t.deterministic,
        deterministic=t.deterministic,
        fill_uninitialized_memory=t.fill_uninitialized_memory,
        keep_freed_memory=t.keep_freed_memory and device.type == "cpu",
        strategy=t.strategy,
        reshard_after_forward=t.reshard_after_forward,
        activation_checkpointing=t.activation_checkpointing,
    )


def apply_process_settings(deterministic: bool, cudnn_benchmark: bool,
                           fill_uninitialized_memory: bool = True) -> None:
    """The process-wide switches a rank trains under (rank.py sets determinism when it joins,
    :func:`wrap` the rest; a benchmark running several contenders in one process sets them
    before each). The defaults of the last two are torch's."""
    # deferred: torch
    import torch
    import torch.utils.deterministic

    rng.deterministic_kernels(deterministic)
    torch.backends.cudnn.benchmark = cudnn_benchmark
    torch.utils.deterministic.fill_uninitialized_memory = (  # type: ignore[attr-defined]
        fill_uninitialized_memory)


def wrap(model: Any, tune: Tuning, device: Any,
         ctx: Context | None = None) -> tuple[Any, Any]:
    """(the DDP module, the callable to run forward with: the same module, or compiled);
    under trainer.strategy=fsdp the model sharded with FSDP2 (twice).
    Also sets the process-wide switches of ``tune`` (cuDNN autotuning, NaN-filling, the CPU
    allocator). ``ctx``: registers trainer.ddp_comm_hook through it, as a user's
    ``ctx.ddp`` does (its state then goes in the Context's checkpoints)."""
    # deferred: torch
    import torch
    import torch.utils.deterministic
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.backends.cudnn.benchmark = tune.cudnn_benchmark
    if tune.keep_freed_memory:
        keep_freed_memory()
    torch.utils.deterministic.fill_uninitialized_memory = (  # type: ignore[attr-defined]
        tune.fill_uninitialized_memory)
    if tune.strategy == "fsdp":
        from hpc_ddp.rank.services import sharding  # deferred: sharding (FSDP)

        sharded = sharding.shard(model, device, tune.precision, tune.reshard_after_forward,
                                 tune.activation_checkpointing, tune.compile)
        return sharded, sharded
    model = model.to(device)
    if tune.channels_last:
        model = model.to(memory_format=torch.channels_last)
        _channels_last_gradients(model)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=tune.ddp_bucket_cap_mb,
              gradient_as_bucket_view=tune.ddp_gradient_as_bucket_view,
              static_graph=tune.ddp_static_graph)
    if ctx is not None and tune.ddp_comm_hook != "none":
        ctx.register_comm_hook(ddp)  # before compiling: the reducer runs it either way
    if not tune.compile:
        return ddp, ddp
    # Compiling the DDP module lets dynamo split the graph at bucket boundaries, so the
    # all-reduces still overlap the backward pass (DDPOptimizer).
    return ddp, torch.compile(ddp)


def fused_optimizer(tune: Tuning, model: Any, cfg: Config, device: Any) -> Tuning:
    """``tune`` with the fused optimizer kept only where it computes the update right, else
    torch's foreach implementation, and why said once in the rank's log (a warning where
    trainer.fused_optimizer=true asked for it). Two cases fall back:

    - fp16 with SGD's momentum: the loss scaler skips the first step when its initial scale
      overflows (the usual case), and torch's fused SGD has by then allocated its momentum
      buffers empty without writing them; the next step reads that memory as momentum
      (weights of 1e30 after 4 steps, seen here; torch/optim/sgd.py ``_fused_sgd``).
    - under fsdp, a kernel with no sharding rule for DTensors (optim.fused_on_sharded).
    """
    if not tune.fused_optimizer or cfg.optim.target is not None:
        return tune
    why = None
    if tune.precision == "fp16" and cfg.optim.name == "sgd" and cfg.optim.momentum > 0:
        why = ("with the fp16 loss scaler, a first step it skips leaves the fused kernel's "
               "momentum buffers unwritten")
    elif tune.strategy == "fsdp":
        found = fused_on_sharded(cfg.optim, model, device.type)
        why = found and f"it does not run on sharded parameters: {found}"
    if why is None:
        return tune
    say = log.warning if cfg.trainer.fused_optimizer else log.info
    say("optimizer: not %s's fused kernel in torch %s (%s); using its foreach "
        "implementation", cfg.optim.name, _torch_version(), why)
    return replace(tune, fused_optimizer=False)


def _torch_version() -> str:
    import torch  # deferred: torch

    return str(torch.__version__)


def grad_scaler(tune: Tuning, device: Any) -> Any:
    """The loss scaler: on for fp16 only (bf16 and fp32 need none). Under fsdp torch's
    ShardedGradScaler, whose inf/NaN check is all-reduced, so that every rank skips the same
    steps (GradScaler would look at this rank's shard of the gradients only)."""
    import torch  # deferred: torch

    fp16 = tune.precision == "fp16"
    if tune.strategy == "fsdp" and fp16:
        from torch.distributed.fsdp.sharded_grad_scaler import (  # deferred: torch
            ShardedGradScaler,
        )

        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type, enabled=fp16)


def gradient_sync(model: Any, sync: bool) -> Any:
    """A context in which the backward reduces gradients over the ranks (``sync``) or only
    accumulates them locally (gradient accumulation's micro-batches before the last): DDP's
    no_sync, FSDP2's set_requires_gradient_sync."""
    if sync:
        return contextlib.nullcontext()
    if hasattr(model, "set_requires_gradient_sync"):
        return _fsdp_no_sync(model)
    return model.no_sync()


@contextlib.contextmanager
def _fsdp_no_sync(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _channels_last_gradients(model: Any) -> None:
    """Hand the layers before every nn.Flatten their gradient in channels_last order.

    Flatten's gradient comes back in NCHW order, while the pooling and activation layers
    before it run NHWC; their CPU backward kernels then convert inside every step (for the
    tiny CNN three copies and a fill, ~2.5 ms a step). Converting the gradient once at the
    flatten is one copy; the values are the same.
    """
    # deferred: torch
    import torch
    import torch.nn as nn

    class _NHWCGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return grad.contiguous(memory_format=torch.channels_last)

    def hook(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        x = args[0]
        if x.dim() != 4 or not x.requires_grad:
            return None
        return (_NHWCGradient.apply(x), *args[1:])

    for module in model.modules():
        if isinstance(module, nn.Flatten):
            module.register_forward_pre_hook(hook)
