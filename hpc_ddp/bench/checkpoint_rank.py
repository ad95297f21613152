"""One rank of ``python -m hpc_ddp.bench checkpoint`` (hpc_ddp/bench/checkpoint.py): a
stack of linear blocks, sharded (FSDP2, rank/services/sharding.py) or replicated (DDP), and
either timed saves through the one checkpoint implementation the trainer and ``ctx.save``
share (rank/services/loop_checkpoints.py), or timed training steps with the peak memory.

Every phase runs in fresh processes, gloo on the CPU, so a peak belongs to its phase alone;
rank 0 writes what it measured as JSON to ``out``. The processes are forked from a
forkserver that imported torch (and what DDP and FSDP import on their first use) once for
the whole benchmark, instead of each importing it anew (~4 CPU-s a rank here, 16 ranks
for the 8 phases on 2 ranks): what a phase measures starts after that anyway.
"""

from __future__ import annotations

import json
import multiprocessing
import resource
import time
import warnings
from pathlib import Path
from typing import Any

from hpc_ddp.rank.services.process_exit import leave
from hpc_ddp.trainer.cpu_memory import map_large_blocks_alone

# What the forkserver imports once, before it forks any rank: torch, its distributed parts,
# and Dynamo, which DDP's constructor and the optimizers import on first use in torch 2.14.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "torch._dynamo", "hpc_ddp.bench.checkpoint_rank")
MMAP_THRESHOLD_BYTES = 128 * 1024


def build(dim: int, blocks: int) -> Any:
    """``blocks`` Linear(dim, dim) layers with a ReLU between, in an nn.ModuleList (one FSDP
    unit each) under a module with a forward."""
    import torch  # deferred: torch

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(blocks))

        def forward(self, x: Any) -> Any:
            for block in self.blocks:
                x = torch.relu(block(x))
            return x

    return Stack()


def _rss_mb() -> float:
    """This process's peak resident memory so far (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def _max_over_ranks(values: list[float]) -> list[float]:
    import torch  # deferred: torch
    import torch.distributed as dist

    found = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return [float(v) for v in found]


def _all(values: list[float]) -> list[list[float]]:
    """Every rank's ``values`` (rank order)."""
    import torch.distributed as dist  # deferred: torch

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return [list(v) for v in gathered]


def _model(strategy: str, dim: int, blocks: int) -> Any:
    import torch  # deferred: torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hpc_ddp.rank.services import sharding  # deferred: sharding

    torch.manual_seed(0)
    # A CPU mesh initialises its shards with torch's own generator: fine for a benchmark.
    warnings.filterwarnings("ignore", "DTensor random operators", UserWarning)
    if strategy == "ddp":
        return DDP(build(dim, blocks))
    # Built on the meta device, sharded, then each rank's shards made and initialised: no
    # rank ever holds the whole model (the way to build one larger than a rank's memory).
    with torch.device("meta"):
        net = build(dim, blocks)
    net = sharding.shard(net, torch.device("cpu"), "fp32")
    net.to_empty(device="cpu")
    for module in net.modules():
        if isinstance(module, torch.nn.Linear):
            module.reset_parameters()
    return net


def _state(strategy: str, model: Any, optimizer: Any) -> dict[str, Any]:
    from hpc_ddp.rank.services import sharding  # deferred: torch (sharding)

    if strategy == "fsdp":
        return sharding.state_dict(model, optimizer)
    return {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}


def _step(model: Any, optimizer: Any, batch: int, dim: int) -> None:
    import torch  # deferred: torch

    model(torch.randn(batch, dim)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def saves(rank: int, world: int, root: Path, spec: dict[str, Any]) -> None:
    """Timed saves of one format: spec's strategy, format (full|dcp), background, saves."""
    # deferred: torch, the config schema, loop_checkpoints, rundir
    import torch

    from hpc_ddp.config.compose import compose
    from hpc_ddp.rank.services.loop_checkpoints import LoopCheckpoints
    from hpc_ddp.rundir import RunDir

    _join(rank, world, root / f"store-{spec['name']}")
    model = _model(spec["strategy"], spec["dim"], spec["blocks"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _step(model, optimizer, 4, spec["dim"])  # the optimizer's state exists
    background = "true" if spec["background"] else "false"
    cfg = compose([f"trainer.checkpoint_format={spec['format']}", "trainer.keep_checkpoints=1",
                   f"trainer.checkpoint_background={background}",
                   "trainer.collective_timeout_s=1200"])
    ckpts = LoopCheckpoints(cfg.trainer, RunDir(root / spec["name"]), rank, world, 0, "bench")
    stalls, totals = [], []
    for save in range(1, spec["saves"] + 1):
        torch.distributed.barrier()
        started = time.perf_counter()
        ckpts.save(_state(spec["strategy"], model, optimizer), save)
        stalls.append(time.perf_counter() - started)  # what the step waits for
        ckpts.flush()  # ... and until the set is on disk (the next save would wait here)
        torch.distributed.barrier()
        totals.append(time.perf_counter() - started)
    stall = _max_over_ranks(stalls)
    total = _max_over_ranks(totals)
    if rank == 0:
        (root / f"{spec['name']}.json").write_text(json.dumps(
            {"stall_s": stall, "total_s": total, "peak_rss_mb": _rss_mb()}))
    torch.distributed.destroy_process_group()


def train(rank: int, world: int, root: Path, spec: dict[str, Any]) -> None:
    """Timed steps of one strategy: samples/s over the ranks, peak memory per rank above
    the process's own before the model was built."""
    import torch  # deferred: torch

    _join(rank, world, root / f"store-{spec['name']}")
    before = _current_rss_mb()
    model = _model(spec["strategy"], spec["dim"], spec["blocks"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = spec["batch"]
    for _ in range(spec["warmup"]):
        _step(model, optimizer, batch, spec["dim"])
    torch.distributed.barrier()
    started = time.perf_counter()
    for _ in range(spec["steps"]):
        _step(model, optimizer, batch, spec["dim"])
    torch.distributed.barrier()
    elapsed = time.perf_counter() - started
    peaks = _all([_rss_mb() - before])
    if rank == 0:
        (root / f"{spec['name']}.json").write_text(json.dumps(
            {"samples_per_s": spec["steps"] * batch * world / elapsed,
             "step_s": elapsed / spec["steps"], "peak_mb": [p[0] for p in peaks]}))
    torch.distributed.destroy_process_group()


def _join(rank: int, world: int, store_path: Path) -> None:
    import torch  # deferred: torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the machine's cores
    store = dist.FileStore(str(store_path), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def _map_large_blocks_alone() -> None:
    """Memory: glibc keeps freed heap memory and raises its mmap threshold as large blocks
    are freed, so a rank's resident memory would hold every buffer it ever freed (FSDP's
    gathered blocks). Blocks above 128 KiB mapped on their own go back at once, and the peak
    resident memory is then the peak of what was in use
    (https://man7.org/linux/man-pages/man3/mallopt.3.html). Only in the memory phases:
    mapping every buffer anew slows the saves and steps the other phases time."""
    if not map_large_blocks_alone(MMAP_THRESHOLD_BYTES):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: the memory figures would be "
                           "glibc's cache, not the phase's peak")


def _phase_rank(rank: int, kind: str, world: int, root: Path, spec: dict[str, Any]) -> None:
    """One rank of a phase; a rank that finished leaves without the interpreter's teardown,
    which can abort a process that used Gloo (rank/services/process_exit.py)."""
    if spec.get("memory"):
        _map_large_blocks_alone()
    (saves if kind == "saves" else train)(rank, world, root, spec)
    leave(0)


def run_phase(kind: str, world: int, root: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """Run one phase (``saves`` or ``train``) on ``world`` fresh ranks; what rank 0 measured."""
    import torch.multiprocessing as mp  # deferred: torch

    multiprocessing.set_forkserver_preload(list(PRELOAD))  # read when the server starts
    mp.start_processes(_phase_rank, args=(kind, world, root, spec), nprocs=world,
                       start_method="forkserver")
    found: dict[str, Any] = json.loads((root / f"{spec['name']}.json").read_text())
    return found
