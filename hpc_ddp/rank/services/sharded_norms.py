"""What a sharded model's normalisation layers and buffers need that FSDP2 does not do itself:
the built-in trainer's ``trainer.strategy=fsdp`` and a user's ``ctx.shard`` both get it
(sharding.py calls it), so BatchNorm networks (the ResNets) train sharded as they do with DDP.

**Norm layers in fp32.** FSDP2's MixedPrecisionPolicy casts a module's parameters to the
compute dtype but never its buffers, so a BatchNorm under bf16 meets its fp32 running
statistics and fails ("expected scalar type BFloat16 but found Float"); its statistics are
also what low precision harms most. FSDP1 therefore left BatchNorm out of mixed precision by
default (``MixedPrecision._module_classes_to_ignore``); the same here: each layer with
running statistics (BatchNorm, SyncBatchNorm, InstanceNorm with ``track_running_stats``) is a
``fully_shard`` unit of its own whose policy keeps its parameters in fp32, casts its input to
fp32 and its output back to the compute dtype, so the layers around it see what they expect.
https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html#torch.distributed.fsdp.MixedPrecisionPolicy

**Buffers, one copy.** FSDP shards parameters only; every rank keeps its own buffers, and its
own batches move the running statistics apart. DDP broadcasts rank 0's before every training
forward (``broadcast_buffers=True``,
https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html);
a sharded model does the same, and once more before its state is taken, so that a checkpoint
holds one consistent copy whichever rank DCP writes it from (it spreads tensors every rank
holds over the ranks) and a resumed run trains exactly as the uninterrupted one.
"""

from __future__ import annotations

from typing import Any


def fp32_norms(model: Any) -> list[Any]:
    """The layers of ``model`` that keep running statistics (innermost first, as
    ``fully_shard`` must be applied)."""
    from torch.nn.modules.batchnorm import _NormBase  # deferred: torch

    found = [m for m in model.modules() if isinstance(m, _NormBase)
             and getattr(m, "track_running_stats", False)]
    return found[::-1]


def shard_norms(model: Any, mesh: Any, compute_dtype: Any, reshard_after_forward: bool) -> set[int]:
    """Each running-statistics layer of ``model`` sharded on its own in fp32 (see the module
    docstring) when ``compute_dtype`` is bf16/fp16; the ids of the layers sharded (none in
    fp32: the blocks' own policy already is fp32). Layers without parameters (``affine=False``)
    get the same casts from hooks: FSDP has nothing of theirs to shard."""
    # deferred: torch
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if compute_dtype is None:
        return set()
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                  output_dtype=compute_dtype, cast_forward_inputs=True)
    done: set[int] = set()
    for norm in fp32_norms(model):
        if any(True for _ in norm.parameters(recurse=False)):
            fully_shard(norm, mesh=mesh, mp_policy=policy,
                        reshard_after_forward=reshard_after_forward)
            done.add(id(norm))
        else:
            _cast_around(norm, compute_dtype)
    return done


def _cast_around(module: Any, compute_dtype: Any) -> None:
    """``module`` computes in fp32 and hands its output on in ``compute_dtype``."""
    import torch  # deferred: torch

    def before(_: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point()
                     else a for a in args)

    def after(_: Any, __: Any, out: Any) -> Any:
        return out.to(compute_dtype) if isinstance(out, torch.Tensor) else out

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def keep_buffers_alike(model: Any) -> None:
    """Rank 0's buffers on every rank before each training forward of ``model`` (the root;
    see the module docstring). Nothing for a model without buffers, or alone."""
    import torch  # deferred: torch
    import torch.distributed as dist

    if not any(True for _ in model.buffers()) or dist.get_world_size() == 1:
        return

    def before_forward(module: Any, _: Any) -> None:
        if module.training and torch.is_grad_enabled():
            broadcast_buffers(module)

    model.register_forward_pre_hook(before_forward)


def broadcast_buffers(model: Any) -> None:
    """Rank 0's buffers of ``model`` copied to every rank (a collective: one broadcast per
    dtype and device, the buffers flattened into one tensor)."""
    # deferred: torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    groups: dict[tuple[Any, Any], list[Any]] = {}
    for buffer in model.buffers():
        if not buffer.is_meta:
            groups.setdefault((buffer.device, buffer.dtype), []).append(buffer)
    for buffers in groups.values():
        flat = _flatten_dense_tensors([b.detach() for b in buffers])
        dist.broadcast(flat, src=0)
        for buffer, value in zip(buffers, _unflatten_dense_tensors(flat, buffers), strict=True):
            buffer.detach().copy_(value)
