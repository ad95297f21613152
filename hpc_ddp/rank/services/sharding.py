"""A model sharded over the ranks with FSDP2 (``torch.distributed.fsdp.fully_shard``), and
its state as a checkpoint holds it: the built-in trainer's ``trainer.strategy=fsdp`` and a
user's ``ctx.shard(model)`` are this.

``fully_shard`` is applied to every block, then to the root (the layout torch's FSDP2
tutorial and torchtitan use: each block's parameters are gathered just before its forward
and freed after it, the root holds what is left: embeddings, heads). A block is an element of
the model's outermost ``nn.ModuleList`` (a transformer's layers); a model without one is cut
into its top-level children that hold parameters.
https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html

The state (:func:`state_dict`) comes from torch.distributed.checkpoint.state_dict: the
model's parameters as DTensors (this rank's shard), the optimizer's state keyed by parameter
name (not by position), so a checkpoint of it is read back by any world size
(docs/fault-tolerance.md#sharded-checkpoints-dcp).
"""

from __future__ import annotations

from typing import Any

from hpc_ddp.rank.services import sharded_norms
from hpc_ddp.rank.services.tensor_tree import has_dtensor


def blocks(model: Any) -> list[Any]:
    """The modules sharded one by one before the root (see the module docstring)."""
    import torch.nn as nn  # deferred: torch

    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return list(module)
    return [child for child in model.children()
            if any(True for _ in child.parameters())]


def precision_dtype(precision: str) -> Any:
    """The parameters' compute dtype of a resolved trainer.precision (None: fp32)."""
    import torch  # deferred: torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def shard(model: Any, device: Any, precision: str = "fp32", reshard_after_forward: bool = True,
          activation_checkpointing: bool = False, compile: bool = False) -> Any:
    """``model`` moved to ``device`` and sharded over every rank of the default process group
    (a collective: every rank calls it with the same model, initialised alike). ``precision``
    bf16/fp16: the forward and backward run in it, gradients are reduced and the optimizer
    steps in fp32 (MixedPrecisionPolicy). ``reshard_after_forward``: free each block's
    gathered parameters after its forward (gathered again in the backward).
    ``activation_checkpointing``: recompute each block's activations in the backward instead
    of keeping them (torch.distributed._composable.checkpoint: the parameter names do not
    change, so checkpoints stay the same). ``compile``: each block's forward compiled
    (torch.compile) before it is sharded, torchtitan's combination: FSDP's hooks stay outside
    the compiled code, the parameter names do not change. Layers with running statistics
    (BatchNorm) stay in fp32 and every rank trains with rank 0's buffers, as under DDP
    (sharded_norms.py). A model built on the meta device (``with
    torch.device("meta"):``) is sharded there, so no rank ever holds it whole; then
    ``model.to_empty(device=...)`` and initialise its parameters (each rank its shards)."""
    # deferred: torch
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("sharding a model needs the process group hpc_ddp starts (run it "
                           "through hpc_ddp.submit or api.submit)")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    dtype = precision_dtype(precision)
    # Blocks hand their output on in the compute dtype; the root's output (what the loss
    # sees) comes back in fp32.
    policy, root_policy = MixedPrecisionPolicy(), MixedPrecisionPolicy()
    if dtype is not None:
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        root_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                           output_dtype=torch.float32)
    if not any(p.is_meta for p in model.parameters()):
        model = model.to(device)  # one built on the meta device stays there (see above)
    # Innermost first, as fully_shard wants: the fp32 norm layers, the blocks, the root.
    norms = sharded_norms.shard_norms(model, mesh, dtype, reshard_after_forward)
    for block in blocks(model):
        if activation_checkpointing:
            from torch.distributed._composable import checkpoint  # deferred: torch

            checkpoint(block)
        if compile:
            block.forward = torch.compile(block.forward)
        if id(block) not in norms:  # a norm layer that is a block: sharded already
            fully_shard(block, mesh=mesh, mp_policy=policy,
                        reshard_after_forward=reshard_after_forward)
    # The root: what no block holds; its parameters stay gathered after the forward (the
    # backward needs them first).
    fully_shard(model, mesh=mesh, mp_policy=root_policy, reshard_after_forward=False)
    sharded_norms.keep_buffers_alike(model)
    return model


def is_sharded(model: Any) -> bool:
    """Whether ``model`` was sharded by :func:`shard` (FSDP2)."""
    from torch.distributed.fsdp import FSDPModule  # deferred: torch

    return isinstance(model, FSDPModule)


def state_dict(model: Any, optimizer: Any = None) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` of a sharded model (or any model): DTensors, this
    rank's shard; the optimizer's state keyed by parameter name (its state is made first if
    it has not stepped yet, so a checkpoint before the first step has the same keys)."""
    from torch.distributed.checkpoint.state_dict import (  # deferred: torch
        get_model_state_dict,
        get_state_dict,
    )

    if is_sharded(model):  # one copy of the buffers, whichever rank writes it
        sharded_norms.broadcast_buffers(model)
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def load_state_dict(model: Any, optimizer: Any, state: dict[str, Any]) -> None:
    """Put :func:`state_dict`'s ``state`` back (after ctx.load(into=...) already filled its
    tensors, this only hands them to the model and optimizer). A state of whole tensors (a
    checkpoint in the full format, or loaded without ``into``) is cut into this rank's
    shards."""
    from torch.distributed.checkpoint.state_dict import (  # deferred: torch
        StateDictOptions,
        set_model_state_dict,
        set_state_dict,
    )

    whole = is_sharded(model) and not has_dtensor(state.get("model"))
    options = StateDictOptions(full_state_dict=whole)
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=options)
        return
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=options)
