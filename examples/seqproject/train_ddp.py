"""The textbook DDP training script, as a user writes it for torchrun:

    torchrun --nproc-per-node=2 train_ddp.py --epochs 3
    python -m hpc_ddp.submit script=train_ddp.py nodes=4 -- --epochs 3    # the same, on Slurm

It knows nothing of hpc_ddp. It reads the torchrun variables (through init_process_group
and LOCAL_RANK), shards with DistributedSampler, reshuffles with set_epoch, and saves on
rank 0. One addition that any script can make without importing hpc_ddp: on SIGUSR2 (the
warning before the time limit) it saves a checkpoint and exits with code 75, which asks
hpc_ddp to requeue the job; with --checkpoint it resumes from the file it saved. Under
hpc_ddp that file is in the run dir ($HPC_DDP_RUN_DIR: ckpt.pt unless --checkpoint names
another; a relative name is taken there), so a new run starts afresh and only a resume of the
same run dir resumes; under torchrun it is --checkpoint as given, or none.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
from seqproj.data import make_splits
from seqproj.model import TinyTransformer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

REQUEUE = 75  # hpc_ddp's "checkpointed, requeue me" exit code
stop_requested = False


def on_signal(signum: int, frame: object) -> None:
    global stop_requested
    stop_requested = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--checkpoint", default=None, help="file to save to and resume from")
    args = parser.parse_args()
    run_dir = os.environ.get("HPC_DDP_RUN_DIR")  # set by hpc_ddp for a script= run
    if run_dir:
        args.checkpoint = os.path.join(run_dir, args.checkpoint or "ckpt.pt")
    signal.signal(signal.SIGUSR2, on_signal)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    splits = make_splits()
    model = DDP(TinyTransformer().to(device), device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sampler = DistributedSampler(splits["train"], world, rank)
    loader = DataLoader(splits["train"], batch_size=args.batch_size, sampler=sampler)

    start = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, map_location=device)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["epoch"]
        if rank == 0:
            print(f"resumed at epoch {start}", flush=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)
            if args.checkpoint:
                torch.save({"model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "epoch": epoch + 1},
                           args.checkpoint + ".tmp")
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
        flag = torch.tensor([float(stop_requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same epoch
        if flag.item() and epoch + 1 < args.epochs:
            dist.destroy_process_group()
            raise SystemExit(REQUEUE)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
