"""A user's loop that takes its DDP model from the context (ctx.ddp: trainer.ddp_comm_hook
registered, its state kept by ctx.save/ctx.load), accumulating app.accum micro-batches per
step in no_sync; it returns how many backward passes the hook reduced."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from hpc_ddp.rank.services import comm_hooks
from hpc_ddp.trainer.models import build_model


def _batch(step: int, micro: int, rank: int, size: int) -> tuple[Any, Any]:
    """Each micro-batch from (step, micro-batch, rank): the same after a resume."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(4, 3, size, size, generator=g), torch.randint(0, 10, (4,), generator=g)


def main(ctx: Any) -> dict[str, Any]:
    app = ctx.app
    size, steps, accum = app.get("image_size", 16), app.get("steps", 6), app.get("accum", 2)
    torch.manual_seed(0)
    model = ctx.ddp(build_model(ctx.cfg.model, size, 10))
    hook = comm_hooks.registered(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x0, y0 = _batch(0, 0, ctx.rank, size)
    ctx.settle_buckets(model, x0, y0, torch.nn.functional.cross_entropy)
    step, micro = 0, 0

    def snapshot() -> dict[str, Any]:
        return {"step": step, "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict()}

    state = ctx.load()
    if state is not None:
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    ctx.total_steps = steps
    while step < steps:
        for i in range(accum):
            x, y = _batch(step, i, ctx.rank, size)
            sync = i == accum - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = torch.nn.functional.cross_entropy(model(x), y) / accum
                loss.backward()
            micro += 1
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        ctx.log({"loss": float(loss)}, step)
        if ctx.should_stop():
            ctx.save(snapshot(), step)
            return {"stopped": step}
    ctx.save(snapshot(), step)
    return {"steps": step, "micro_batches": micro, "hook": hook.name if hook else "none",
            "syncs": hook.syncs if hook else None, "calls": hook.calls if hook else None}
