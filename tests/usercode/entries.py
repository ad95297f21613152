"""Entry functions, good and bad."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist


def two_args(ctx: Any, other: Any) -> None:
    """Takes two arguments: refused as an entry."""


def report(ctx: Any) -> dict[str, Any]:
    """One all-reduce, the torchrun variables and the context as the entry sees them."""
    total = torch.tensor([float(ctx.rank)], device=ctx.device)  # NCCL takes GPU tensors only
    dist.all_reduce(total)
    return {"total": total.item(), "env_rank": os.environ["RANK"],
            "env_world": os.environ["WORLD_SIZE"], "ctx_world": ctx.world_size,
            "master": os.environ["MASTER_ADDR"], "app": dict(ctx.app),
            "backend": dist.get_backend()}


def counts(ctx: Any) -> dict[str, Any]:
    """A loop of app.steps steps that checkpoints, logs, stops when asked and resumes."""
    state = ctx.load() or {"step": 0, "value": torch.zeros(())}
    step, value = state["step"], state["value"]
    steps = ctx.app.get("steps", 40)
    ctx.total_steps = steps
    while step < steps:
        value = value + torch.rand(())  # draws from the RNG hpc_ddp checkpoints
        step += 1
        ctx.log({"value": float(value)}, step)
        if step % 10 == 0:
            ctx.save({"step": step, "value": value})
        if ctx.should_stop():
            ctx.save({"step": step, "value": value})
            return {}
        if ctx.app.get("sleep"):
            import time

            time.sleep(ctx.app["sleep"])
    ctx.save({"step": step, "value": value})
    return {"value": float(value), "steps": step}


def fails_once(ctx: Any) -> dict[str, Any]:
    """Rank 1 fails in torchrun's first attempt, before any collective (rank 0 then waits in
    report's all-reduce until torchrun restarts both); the second attempt reports."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if ctx.rank == 1 and attempt == "0":
        raise RuntimeError("rank 1 fails in torchrun's first attempt")
    return {**report(ctx), "attempt": attempt}


def staged(ctx: Any) -> dict[str, Any]:
    """data.root as staged for this node (ctx.data_root), and one more folder staged by
    ctx.stage() (app.extra)."""
    extra = ctx.stage(ctx.app["extra"])
    files = sorted(p.name for p in extra.rglob("*") if p.is_file())
    return {"data_root": str(ctx.data_root), "extra": str(extra), "extra_files": files}


def where(ctx: Any) -> dict[str, Any]:
    """Where each rank runs: its host, Python, the Slurm commands it can see, the container
    marker podman leaves (/run/.containerenv); rank 0 returns every rank's, in rank order."""
    import shutil
    import socket
    import sys

    mine = {"host": socket.gethostname(), "python": sys.executable,
            "virtual_env": os.environ.get("VIRTUAL_ENV"),
            "slurm_tools": {t: shutil.which(t) for t in ("scontrol", "squeue", "srun", "sh")},
            "podman_marker": os.path.exists("/run/.containerenv"),
            "usr_bin": os.path.isdir("/usr/bin")}
    found: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(found, mine)
    return {"ranks": found}


SECRET_NAMES = ("WANDB_API_KEY", "HF_TOKEN", "MY_SERVICE_PASSWORD")


def secrets_seen(ctx: Any) -> dict[str, Any]:
    """Which secrets reached this rank's environment (their SHA-256, never the values), after
    logging them as a careless program would: the rank's log must show **** instead."""
    import hashlib
    import logging

    seen = {name: hashlib.sha256(os.environ[name].encode()).hexdigest()
            for name in SECRET_NAMES if name in os.environ}
    for name in seen:
        logging.getLogger("user").info("careless: %s is %s", name, os.environ[name])
    ctx.save({"step": 1, "seen": sorted(seen)})
    return {"sha256": seen}


def _sha(value: str) -> str:
    import hashlib

    return hashlib.sha256(value.encode()).hexdigest()


def command_lines_holding(values: list[str]) -> list[str]:
    """Every process of this node whose command line (what ps shows every user) holds one of
    ``values``: their pids, never the values."""
    from pathlib import Path

    found = []
    for proc in Path("/proc").iterdir():
        try:
            line = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        found += [proc.name for v in values if v.encode() in line]
    return found


def secrets_reached(ctx: Any) -> dict[str, Any]:
    """What every secret channel delivered on this rank (SHA-256 of each value, never the
    value): the environment, the configured model's argument (built here as user code would,
    with the config's `_target_`), ctx.app; and the command lines of this node that hold one
    of the planted values ($PLANTED_FILE lists them, outside the run dir). It logs them as a
    careless program would: the rank's log must show ****."""
    import json
    import logging

    from hpc_ddp.targets import build

    planted = json.loads(open(os.environ["PLANTED_FILE"]).read())
    env = {n: _sha(os.environ[n]) for n in (*SECRET_NAMES, "DB_PASSWORD", "T")
           if n in os.environ}
    model = build("model", ctx.cfg.model.target, ctx.cfg.model.kwargs)
    app = {k: _sha(str(v)) for k, v in ctx.app.items()}
    received = [os.environ[n] for n in env] + [str(v) for v in ctx.app.values()]
    for value in received:
        logging.getLogger("user").info("careless: %s", value)
    return {"sha256": {**env, "model.api_token": model.token_sha,
                       **{f"app.{k}": v for k, v in app.items()}},
            "argv_holding": command_lines_holding(list(planted.values()))}


def _helper_that_fails(ctx: Any) -> int:
    if ctx.rank == 1:
        return {}["missing"]  # a KeyError in the user's own frames
    return 0


def fails_in_own_code(ctx: Any) -> dict[str, Any]:
    """Rank 1 raises from a helper of the entry: the report must show these frames."""
    return {"x": _helper_that_fails(ctx)}


def fails_with_its_token(ctx: Any) -> None:
    """Raises with the run's secret in the message, as an auth error of a client may."""
    raise RuntimeError(f"auth failed for {ctx.app['api_token']}")


def fails_with_escapes(ctx: Any) -> None:
    """Prints terminal control sequences, then raises with one in its message."""
    print("\x1b]52;c;cm0gLXJmIH4=\x07 before", flush=True)
    raise RuntimeError("bad \x1b[2J\u009b2J end")


def ordered_sharded(ctx: Any) -> dict[str, Any]:
    """A loop of a user's own that survives a shrink: FSDP2 through ctx.shard, the
    world-size-invariant order through ctx.global_batches, its state saved and loaded by
    ctx (resharded on load). Each step's sample ids go to ``app.record_dir/rank<R>.jsonl``
    with the start they belong to (the test's record); the loss to ctx.log."""
    import json
    from pathlib import Path

    from torch.utils.data import DataLoader

    from tests.usercode.parts import IdImages, sample_ids

    app = ctx.app
    steps, batch = int(app.get("steps", 64)), int(app.get("batch_size", 16))
    data = IdImages(int(app.get("size", 1024)), 4, 0)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 32),
                              torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model = ctx.shard(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    order = ctx.global_batches(data, batch)
    step = 0
    state = ctx.load(into={"step": 0, **ctx.state_dict(model, optimizer)})
    if state is not None:
        ctx.load_state_dict(model, optimizer, state)
        step = int(state["step"])
    record = Path(app["record_dir"]) / f"rank{ctx.rank}.jsonl"
    start = [os.environ.get("SLURM_RESTART_COUNT", "0"), os.environ.get("HPC_DDP_DRIVEN", "0"),
             os.environ.get("HPC_DDP_GENERATION", "0")]
    per_epoch = order.micro_per_epoch
    while step < steps:
        epoch, done = divmod(step, per_epoch)
        order.set_position(epoch, done * batch)
        for x, y in DataLoader(data, batch_sampler=order):
            with open(record, "a") as out:
                out.write(json.dumps({"start": start, "ids": sample_ids(x)}) + "\n")
            time.sleep(float(app.get("delay_s", 0)))  # long enough to lose a node mid-run
            loss = torch.nn.functional.cross_entropy(model(x.to(ctx.device)),
                                                     y.to(ctx.device)) * order.weight
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % 8 == 0:
                ctx.save({"step": step, **ctx.state_dict(model, optimizer)})
                ctx.log({"loss": float(loss.detach()) / order.weight}, step)
            if step >= steps or ctx.should_stop():
                break
        if ctx.should_stop():
            ctx.save({"step": step, **ctx.state_dict(model, optimizer)})
            return {}
    return {"step": step, "world_size": ctx.world_size}


def searched(ctx: Any) -> dict[str, Any]:
    """A trial of an adaptive search in a user's own loop: app.steps steps of app.step_s
    seconds each (asleep: a trial's length without its CPU), the loss of a learning rate
    app.lr (above 1: it grows, past any pruner's bound and then to inf), evaluated every
    app.eval_every steps, logged and reported to the study (ctx.report), which may prune it."""
    steps, lr = int(ctx.app["steps"]), float(ctx.app["lr"])
    every, pause = int(ctx.app.get("eval_every", 10)), float(ctx.app.get("step_s", 0.0))
    ctx.total_steps = steps
    loss = 1.0
    for step in range(1, steps + 1):
        time.sleep(pause)
        loss = loss * 1.5 if lr > 1 else loss * (1.0 - 0.01 * lr)
        if step % every == 0 or step == steps:
            ctx.log({"eval/loss": loss}, step)
            if ctx.report({"eval/loss": loss}, step):
                return {"eval/loss": loss, "pruned_at": step}
    return {"eval/loss": loss}
