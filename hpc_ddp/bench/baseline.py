"""A plain, hand-written DDP training loop: the baseline ``python -m hpc_ddp.bench train``
measures hpc_ddp's trainer against.

It is the loop of PyTorch's DDP tutorial, as a user writes it: DistributedDataParallel, a
DistributedSampler, a default DataLoader over a TensorDataset, fp32, and
``zero_grad(); loss.backward(); optimizer.step()``. Nothing from hpc_ddp's trainer; only
the network (``hpc_ddp.trainer.models``) and the bytes of the data set are shared, so both
train the same model on the same data.

Run it on its own, side by side with the suite's baseline figure:

    python -m hpc_ddp.bench.baseline --model tiny_cnn --world-size 2 --steps 200
    torchrun --nproc-per-node 2 -m hpc_ddp.bench.baseline --model resnet18 --steps 10
    srun -N 2 --ntasks-per-node 1 python -m hpc_ddp.bench.baseline --model tiny_cnn

Without torchrun's or Slurm's variables it starts ``--world-size`` processes itself.
Intra-op threads per rank: ``--threads``, default the machine's CPUs divided among its
ranks (the suite uses cluster.cpus_per_task, 1 for a local run).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hpc_ddp.config.schema import DataConfig, ModelConfig, OptimConfig
from hpc_ddp.errors import USAGE_EXIT_CODE, UserError
from hpc_ddp.rank.services.process_exit import leave

MODELS = ("null", "tiny_cnn", "resnet18", "resnet50")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class Parts:
    """What the textbook script builds before its loop."""

    model: Any
    loader: Any
    sampler: Any
    optimizer: Any
    scheduler: Any
    device: Any


def build(model_cfg: ModelConfig, data_cfg: DataConfig, optim_cfg: OptimConfig,
          batch_size: int, seed: int, device: Any, total_steps: int) -> Parts:
    """The setup of the tutorial script (the process group already exists)."""
    # deferred: torch; start-up: data.sets, trainer.models
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from hpc_ddp.data.sets import build_datasets
    from hpc_ddp.trainer.models import build_model

    torch.manual_seed(seed)
    model = build_model(model_cfg, data_cfg.image_size).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    train_set = build_datasets(data_cfg, seed).train
    dataset = TensorDataset(train_set.images, train_set.labels)
    sampler: Any = DistributedSampler(dataset, num_replicas=dist.get_world_size(),
                                      rank=dist.get_rank(), shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=optim_cfg.lr,
                                momentum=optim_cfg.momentum,
                                nesterov=optim_cfg.nesterov and optim_cfg.momentum > 0,
                                weight_decay=optim_cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    return Parts(model, loader, sampler, optimizer, scheduler, device)


def train_steps(parts: Parts, loader: Any = None) -> Generator[Any, None, None]:
    """The textbook loop; it yields the loss after every optimizer step and runs until the
    caller stops asking. ``loader``: the loader to draw from (default ``parts.loader``)."""
    # deferred: torch; start-up: data.tensor_dataset
    import torch
    import torch.nn.functional as F

    from hpc_ddp.data.tensor_dataset import MEAN, STD

    model, optimizer, device = parts.model, parts.optimizer, parts.device
    loader = parts.loader if loader is None else loader
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
    model.train()
    epoch = 0
    while True:
        parts.sampler.set_epoch(epoch)
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            x = (images.float() / 255 - mean) / std
            loss = F.cross_entropy(model(x), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            parts.scheduler.step()
            yield loss
        epoch += 1


# -- on its own ---------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpc_ddp.bench.baseline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny_cnn", help=" | ".join(MODELS))
    p.add_argument("--world-size", type=int, default=2, help="ranks to start (no launcher)")
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--steps", type=int, default=100, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (at least 1)")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--train-size", type=int, default=DataConfig.train_size)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per rank (default: CPUs / ranks on the node)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="CPU: glibc keeps freed memory (as the suite's process does when the "
                   "trainer's keep_freed_memory is on; hpc_ddp/trainer/cpu_memory.py)")
    return p


def check_args(args: argparse.Namespace) -> None:
    """The options' values, before any process starts (UserError if bad)."""
    if args.model not in MODELS:
        raise UserError("--model", args.model, "is not a model.",
                        f"use one of {', '.join(MODELS)}.")
    if args.device not in DEVICES:
        raise UserError("--device", args.device, "is not a device.",
                        f"use one of {', '.join(DEVICES)}.")
    for flag, value, least in (("--world-size", args.world_size, 1),
                               ("--batch-size", args.batch_size, 1),
                               ("--steps", args.steps, 1), ("--train-size", args.train_size, 1),
                               ("--image-size", args.image_size, 8),
                               ("--threads", 1 if args.threads is None else args.threads, 1)):
        if value < least:
            raise UserError(flag, value, f"must be at least {least}.",
                            f"pass {flag} {least} or more (--help shows the defaults).")


def rank_env(environ: Mapping[str, str]) -> tuple[int, int, int, int] | None:
    """(rank, world size, local rank, local world size) from torchrun or Slurm, else None."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        local = int(environ.get("LOCAL_WORLD_SIZE", environ["WORLD_SIZE"]))
        return (int(environ["RANK"]), int(environ["WORLD_SIZE"]),
                int(environ.get("LOCAL_RANK", "0")), local)
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        per_node = int(environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0] or 1)
        return (int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"]),
                int(environ.get("SLURM_LOCALID", "0")), per_node)
    return None


def _slurm_master(environ: Mapping[str, str]) -> str:
    nodes = environ.get("SLURM_JOB_NODELIST", "127.0.0.1")
    done = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                          text=True, check=False)
    return done.stdout.split()[0] if done.returncode == 0 and done.stdout else nodes


def run_rank(rank: int, world: int, local_rank: int, local_world: int,
             args: argparse.Namespace) -> dict[str, Any] | None:
    """One rank: join, build, warm up, time ``args.steps`` steps; rank 0 returns the figures."""
    # deferred: torch; start-up: trainer.loop_timing
    import torch
    import torch.distributed as dist

    from hpc_ddp.trainer.loop_timing import StepTimer

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cpu")
    if cuda:
        # The textbook says cuda:local_rank; that is wrong under --gpus-per-task (each task
        # sees only its own GPU, as index 0), so the GPU is chosen as hpc_ddp's ranks choose.
        # deferred (start-up): rank.join.device
        from hpc_ddp.rank.join.device import DeviceError, select

        try:
            choice = select(os.environ, local_rank, local_world, torch.cuda.device_count())
        except DeviceError as exc:
            raise SystemExit(f"rank {rank}: {exc}") from None
        if choice is None:
            raise SystemExit(f"rank {rank}: --device cuda, but this task sees no GPU "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
        device = torch.device("cuda", choice.index)
        torch.cuda.set_device(device)
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(local_world, 1))
    torch.set_num_threads(threads)
    if args.keep_freed_memory and not cuda:
        # deferred (start-up): trainer.cpu_memory
        from hpc_ddp.trainer.cpu_memory import keep_freed_memory

        keep_freed_memory()
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        model_cfg = ModelConfig(name=args.model)
        data_cfg = DataConfig(image_size=args.image_size, train_size=args.train_size)
        parts = build(model_cfg, data_cfg, OptimConfig(), args.batch_size, args.seed, device,
                      args.warmup + args.steps)
        timer = StepTimer(device).attach(parts.model.parameters(), parts.optimizer)
        steps = train_steps(parts, timer.wrap(parts.loader))
        next(steps)
        first_step_time = time.time()  # wall clock: compared with the submission time
        for _ in range(args.warmup - 1):
            next(steps)
        dist.barrier()
        timer.start()
        for _ in range(args.steps):
            next(steps)
        window = timer.stop(args.steps)
        walls: list[Any] = [None] * world
        dist.all_gather_object(walls, window.wall_s)
        # Leave together: rank 0 hosts the rendezvous store, and a rank still talking to it
        # when it exits aborts.
        dist.barrier()
        if rank != 0:
            return None
        slowest = max(walls)
        samples = world * args.batch_size * args.steps / slowest
        return {"model": args.model, "world_size": world, "batch_size": args.batch_size,
                "steps": args.steps, "threads": threads, "device": str(device),
                "samples_per_s": samples, "samples_per_s_per_rank": samples / world,
                "step_ms": window.per_step_ms(), "peak_mem_mb": window.peak_mem_mb,
                "first_step_time": first_step_time}
    finally:
        dist.destroy_process_group()


def _spawned(index: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result = None
    try:
        result = run_rank(index, world, index, world, args)
    finally:
        queue.put(result)  # also after a failure: the parent waits for one answer per rank
        queue.close()
        queue.join_thread()  # the answer is in the pipe before this process leaves
    # A rank that finished leaves without the interpreter's teardown, which can abort a
    # process that used Gloo (rank/services/process_exit.py).
    leave(0)


def format_result(r: dict[str, Any]) -> str:
    ms = r["step_ms"]
    return (f"hand-written DDP loop: {r['model']}, {r['world_size']} ranks x batch "
            f"{r['batch_size']} on {r['device']} ({r['threads']} threads/rank): "
            f"{r['samples_per_s']:.1f} samples/s ({r['samples_per_s_per_rank']:.1f} per rank), "
            f"step {ms['step']:.2f} ms = data {ms['data']:.2f} + compute {ms['compute']:.2f} + "
            f"comm {ms['comm']:.2f} + optimizer {ms['optimizer']:.2f} + other "
            f"{ms['other']:.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_args(args)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    args.warmup = max(args.warmup, 1)
    found = rank_env(os.environ)
    if found is not None:  # started by torchrun or srun: this process is one rank
        if "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = _slurm_master(os.environ)
        os.environ.setdefault("MASTER_PORT", "29533")
        result = run_rank(*found, args)
    else:

        import torch.multiprocessing as mp  # deferred: torch

        with socket.socket() as s:  # a free port for this run's rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_spawned, args=(i, args.world_size, port, args, queue))
                 for i in range(args.world_size)]
        for proc in procs:
            proc.start()
        results = [queue.get() for _ in procs]
        for proc in procs:
            proc.join()
        if any(proc.exitcode for proc in procs):
            return 1
        result = next((r for r in results if r is not None), None)
    if result is not None:
        print(json.dumps(result) if args.json else format_result(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
