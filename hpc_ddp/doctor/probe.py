"""What runs on every rank of a doctor job: report this rank, time an all-reduce, and (rank 0)
judge them all.

Each rank joins the job exactly as training does (``rank.joined``: logging, NCCL settings,
device, rendezvous, process group), so the doctor tests the path a real run takes.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from hpc_ddp.config.schema import Config
from hpc_ddp.rank.join import envcheck, nccl, nodeinfo
from hpc_ddp.rundir import RunDir, write_json

log = logging.getLogger(__name__)
REPORT = "doctor.json"
# The variables whose values must agree on every node (per-rank ones such as SLURM_PROCID or
# CUDA_VISIBLE_DEVICES under per-task binding legitimately differ).
_COMPARED = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_DEBUG")


@dataclass(frozen=True)
class DoctorOptions:
    # All-reduce message size in MiB (DDP's default gradient bucket is 25 MiB).
    size_mib: float = 32.0
    iters: int = 5
    warmup: int = 2
    # Fail the verdict below this all-reduce bus bandwidth (GB/s); None: report only.
    min_busbw_gbps: float | None = None
    # The versions environment.yml pins (name, version): every node's drift from them is
    # reported (envcheck.read_pins, on the submit side); empty: not checked.
    pins: tuple[tuple[str, str], ...] = ()


def run(cfg: Config, run_dir: RunDir, environ: MutableMapping[str, str],
        options: DoctorOptions) -> dict[str, Any] | None:
    """One rank of the doctor; rank 0 returns (and writes) the report, the others None."""
    import torch.distributed as dist  # deferred: torch; start-up: doctor.checks, rank.join.joined

    from hpc_ddp.doctor.checks import analyse
    from hpc_ddp.rank.join.joined import joined

    with joined(cfg, run_dir, environ) as rank:
        facts = collect(rank, environ, dict(options.pins))
        facts["allreduce"] = timed_all_reduce(rank.device, int(options.size_mib * 2**20),
                                              options.iters, options.warmup)
        gathered: list[Any] = [None] * rank.env.world_size
        dist.all_gather_object(gathered, facts)
        if not rank.env.is_master:
            return None
        # The software check of the rendezvous let differences through for the doctor
        # (allow_mixed_env): they are judged here, with the rest.
        judged = {**context(cfg, options), "software_mixed": (rank.environment or {}).get(
            "mixed", [])}
        report = analyse(gathered, judged)
        write_json(run_dir.root / REPORT, report)
        log.info("doctor: %s; bad nodes: %s", "ok" if report["ok"] else "FAIL",
                 ", ".join(report["bad_nodes"]) or "none")
        return report


def context(cfg: Config, options: DoctorOptions) -> dict[str, Any]:
    """What the checks need to know about the request."""
    c = cfg.cluster
    return {"kind": c.kind, "nodes": cfg.nodes, "tasks_per_node": c.tasks_per_node,
            "gpus_per_node": c.gpus_per_node, "gpu_binding": c.gpu_binding,
            "exclude": c.exclude, "nccl_profile": cfg.nccl.profile,
            "min_busbw_gbps": options.min_busbw_gbps}


def versions() -> dict[str, Any]:
    import torch  # deferred: torch

    try:
        nccl_version: str | None = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # a build without NCCL raises; there is nothing to compare then
        nccl_version = None
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": nccl_version,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available()
            else None}


def collect(rank: Any, environ: Mapping[str, str],
            pins: dict[str, str] | None = None) -> dict[str, Any]:
    """This rank's facts: versions, GPUs, IB ports, peer memory, effective NCCL environment."""
    import torch  # deferred: torch

    node = nodeinfo.detect(nodeinfo.sysfs_root(environ, rank.host), with_gpus=True)
    device = rank.device
    gpu: dict[str, Any] = {"device": str(device), "count": torch.cuda.device_count()
                           if torch.cuda.is_available() else 0,
                           "names": list(node.gpus or ()), "uuid": None,
                           "visible": environ.get("CUDA_VISIBLE_DEVICES")}
    if device.type == "cuda":
        gpu["uuid"] = str(getattr(torch.cuda.get_device_properties(device), "uuid", "")) or None
    env = {k: v for k, v in nccl.recorded_env(environ).items() if k.startswith(_COMPARED)}
    # How this rank's packages drift from environment.yml's pins (reported, not fatal).
    drift = envcheck.drift(pins, envcheck.fingerprint()) if pins else []
    return {"rank": rank.env.rank, "local_rank": rank.env.local_rank, "drift": drift,
            "node_rank": rank.env.node_rank, "local_world_size": rank.env.local_world_size,
            "host": rank.host, **versions(), "gpu": gpu, "node": node.to_dict(), "env": env,
            # What Slurm allocated and which GPU this rank takes (hpc_ddp.rank.join.device.select).
            "placement": {"rank": rank.env.rank, "host": rank.host, **(rank.gpu or {})},
            "detected": {c.name: nccl.mask(c.name, c.new) for c in rank.env_changes
                         if c.source == "detected"},
            "warnings": [list(w) for w in nccl.node_warnings(environ, node)]}


def timed_all_reduce(device: Any, nbytes: int, iters: int, warmup: int) -> dict[str, Any]:
    """Time ``iters`` all-reduces of ``nbytes`` (after ``warmup``) and check one result.

    Bandwidths as nccl-tests defines them: algbw = bytes / time, all-reduce busbw =
    algbw * 2(n-1)/n (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).
    The time is the slowest rank's.
    """
    # deferred: torch
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    count = max(1, nbytes // 4)
    data = torch.zeros(count, dtype=torch.float32, device=device)
    for _ in range(warmup):
        dist.all_reduce(data)
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(data)
    _sync(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    check = torch.full((count,), float(rank + 1), dtype=torch.float32, device=device)
    dist.all_reduce(check)
    expected = world * (world + 1) / 2
    per_op = max(float(elapsed.item()) / max(iters, 1), 1e-9)
    algbw = count * 4 / per_op / 1e9
    return {"bytes": count * 4, "iters": iters, "time_s": per_op, "algbw_gbps": algbw,
            "busbw_gbps": algbw * 2 * (world - 1) / world if world > 1 else 0.0,
            "correct": bool(torch.all(check == expected).item()),
            "backend": str(dist.get_backend())}


def _sync(device: Any) -> None:
    if device.type == "cuda":
        import torch  # deferred: torch

        torch.cuda.synchronize(device)
