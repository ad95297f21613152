"""A user's own loop over the run's configured model (model=...), as the combination matrix
runs it: sharded with ctx.shard (app.shard=true) or wrapped in DDP, trained with its own
optimizer on random batches, saved, stopped when asked and resumed through the context."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from hpc_ddp.trainer.models import build_model


def main(ctx: Any) -> dict[str, Any]:
    app = ctx.app
    size, steps, shard = app.get("image_size", 16), app.get("steps", 4), app.get("shard", False)
    torch.manual_seed(0)
    net = build_model(ctx.cfg.model, size, 10)
    model = ctx.shard(net) if shard else DDP(net.to(ctx.device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = 0

    def snapshot() -> dict[str, Any]:
        if shard:
            return {"step": step, **ctx.state_dict(model, optimizer)}
        return {"step": step, "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict()}

    state = ctx.load(into=snapshot() if shard else None)
    if state is not None:
        if shard:
            ctx.load_state_dict(model, optimizer, state)
        else:
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    ctx.total_steps = steps
    # Each step's batch from (seed, step, rank): the same after a resume.
    while step < steps:
        g = torch.Generator().manual_seed(1000 * step + ctx.rank)
        x = torch.randn(4, 3, size, size, generator=g).to(ctx.device)
        y = torch.randint(0, 10, (4,), generator=g).to(ctx.device)
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        ctx.log({"loss": float(loss)}, step)
        if ctx.should_stop():
            ctx.save(snapshot(), step)
            return {"stopped": step}
    ctx.save(snapshot(), step)
    return {"steps": step, "loss": float(loss)}
