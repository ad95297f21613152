"""A textbook torchrun-style DDP script that reports its own throughput (the subject of
``python -m hpc_ddp.bench entries``): the tiny CNN on synthetic images, plain DDP.

    torchrun --nproc-per-node=2 hpc_ddp/bench/ddp_script.py --steps 100 --out result.json

It reads only the torchrun variables (through ``init_process_group`` and LOCAL_RANK) and
imports nothing of hpc_ddp's runtime but the network and the data, so it measures the same
way under ``script=`` and under a bare ``srun``.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    # deferred: the typed schemas, torch; start-up: data.synthetic
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hpc_ddp.data.synthetic import make_split
    from hpc_ddp.trainer.models import builtin_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", required=True)
    parser.add_argument("--first-step", default=None,
                        help="rank 0 writes the wall-clock time its first step ended here")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = DDP(builtin_model("tiny_cnn", 10, 32).to(device),
                device_ids=[local] if cuda else None)
    data = make_split(0, args.batch_size * 8, 2.5, 0)
    batches = [(data.images[i:i + args.batch_size].float().to(device) / 255,
                data.labels[i:i + args.batch_size].to(device))
               for i in range(0, len(data), args.batch_size)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    started = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            started = time.perf_counter()
        x, y = batches[step % len(batches)]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 0 and args.first_step and dist.get_rank() == 0:
            with open(args.first_step, "w") as handle:  # bench startup: time to first step
                handle.write(f"{time.time()}\n")
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    elapsed = time.perf_counter() - started
    if dist.get_rank() == 0:
        samples = args.steps * args.batch_size * dist.get_world_size()
        with open(args.out, "w") as handle:
            json.dump({"samples_per_s": samples / elapsed, "step_ms": 1000 * elapsed /
                       args.steps, "world_size": dist.get_world_size()}, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
