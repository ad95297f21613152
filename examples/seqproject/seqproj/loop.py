"""The project's own training loop, run by hpc_ddp on every rank as a function entry:

    python -m hpc_ddp.submit --config-dir conf entry=seqproj.loop:main nodes=4

hpc_ddp has made the process group and chosen the device; this loop keeps its own state
and uses the context for what a cluster needs: stop when asked, save, resume, log.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from seqproj.data import make_splits
from seqproj.model import TinyTransformer


def main(ctx: Any) -> dict[str, float]:
    app = ctx.app  # this project's keys (conf/app/seq.yaml)
    torch.manual_seed(app.get("seed", 0))
    splits = make_splits(app.get("train_size", 2048), app.get("eval_size", 256),
                         app.get("length", 16), app.get("seed", 0))
    net = TinyTransformer(app.get("length", 16), app.get("dim", 32))
    # app.shard=true: parameters, gradients and optimizer state split over the ranks (FSDP2);
    # else every rank holds the whole model (DDP).
    shard = bool(app.get("shard", False))
    model = ctx.shard(net) if shard else DDP(net.to(ctx.device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=app.get("lr", 3e-3))
    sampler = DistributedSampler(splits["train"], ctx.world_size, ctx.rank, seed=0)
    loader = DataLoader(splits["train"], batch_size=app.get("batch_size", 64), sampler=sampler)
    # app.steps when given, else the run's trainer.max_steps (conf/config.yaml: 200), so that
    # trainer.max_steps=20 means 20 steps here as it does for the built-in trainer.
    steps = int(app.get("steps") or ctx.cfg.trainer.max_steps or 200)
    ctx.total_steps = steps
    step, epoch, done_in_epoch = 0, 0, 0

    def snapshot() -> dict[str, Any]:
        where = {"step": step, "epoch": epoch, "done_in_epoch": done_in_epoch,
                 "world_size": ctx.world_size}
        if shard:  # this rank's shards; every rank writes its own (no gather)
            return {**where, **ctx.state_dict(model, optimizer)}
        return {**where, "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict()}

    # None on a fresh start; our own dict after a requeue or resume. A sharded model's
    # tensors are read into it in place, whatever the world size that saved them.
    state = ctx.load(into=snapshot() if shard else None)
    if state is not None:
        if shard:
            ctx.load_state_dict(model, optimizer, state)
        else:
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        step, epoch = state["step"], state["epoch"]
        # This rank's batches of the epoch: the same samples seen, on another world size too.
        saved_world = state.get("world_size", ctx.world_size)
        done_in_epoch = state["done_in_epoch"] * saved_world // ctx.world_size

    # One throw-away step, so a resumed DDP run sums gradients as an uninterrupted one.
    if not shard:
        sample_x, sample_y = splits["train"][0:8]
        ctx.settle_buckets(model, sample_x.to(ctx.device), sample_y.to(ctx.device),
                           torch.nn.functional.mse_loss)

    loss = torch.zeros(())
    while step < steps:
        sampler.set_epoch(epoch)
        for index, (x, y) in enumerate(loader):
            if index < done_in_epoch:
                continue  # this epoch's batches trained before the requeue
            x, y = x.to(ctx.device), y.to(ctx.device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step, done_in_epoch = step + 1, index + 1
            if step % 10 == 0:
                ctx.log({"loss": loss.item()}, step)
            if step % app.get("checkpoint_every", 50) == 0:
                ctx.save(snapshot())
            if ctx.should_stop():  # the requeue signal (or SIGTERM), agreed by every rank
                ctx.save(snapshot())
                return {}
            if step >= steps:
                break
        else:
            epoch, done_in_epoch = epoch + 1, 0
    ctx.save(snapshot())
    return {"final_loss": _mean_over_ranks(loss.detach(), ctx.device)}


def _mean_over_ranks(value: torch.Tensor, device: Any) -> float:
    total = value.to(device).double().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()
