"""One rank of ``python -m hpc_ddp.bench scaling``: the user's training on 1, 2, ... N nodes of
one job, then (on the fabric's verdict) each fix at the largest.

Every rank joins the whole job (``joined``). For each node count k the ranks of the first k
nodes form a world of their own: every rank gives up the process group it holds, and those
on nodes ``node_rank < k`` make a new default group through the job's store under a prefix
of its own (``hpc_ddp/scaling/world/<k>``: a group's keys never meet another's), with a DistEnv
of that world (:func:`sub_env`). hpc_ddp's Trainer uses the default group, so it trains on k
nodes unchanged. The other ranks wait in the store until the world's rank 0 says it is over.
The last step forms the whole job's world again, so ``joined`` ends the group it expects.

Within a world: a Trainer with the user's config (checkpoints and evaluation off), warm-up
steps, then the timed steps in a few windows (train_rank.timed_window: every rank's step
split), and the mean training loss of the last window over all ranks (the criterion
wrapped: :class:`LossRecorder`). On more than one node, the fabric: comm.measure's bare
all-reduce at DDP's bucket size, and a probe Trainer whose DDP all-reduces through
bucket_timing's hook (the bandwidth the steps got). Rank 0 writes bench/scaling.json.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import MutableMapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from hpc_ddp.bench.bucket_timing import BucketTimes, timed_reduce
from hpc_ddp.bench.scaling_plan import (
    DDP_DEFAULT_BUCKET_MB,
    RESULT,
    ScalingOptions,
    fixes_for,
    say,
    window_steps,
)
from hpc_ddp.bench.scaling_report import FABRIC, achieved, rows_of, run_row, verdict
from hpc_ddp.bench.train_plan import with_overrides
from hpc_ddp.bench.train_rank import HORIZON, TrainerRunner, timed_window
from hpc_ddp.config.schema import Config
from hpc_ddp.errors import UserError
from hpc_ddp.rank.join.distenv import DistEnv
from hpc_ddp.rundir import RunDir, write_json
from hpc_ddp.trainer.cpu_memory import keep_freed_memory

KEY = "hpc_ddp/scaling"
# Untimed steps of the probe Trainer first: DDP's first step runs in its first bucket layout.
PROBE_WARMUP = 2


@dataclass(frozen=True)
class SubRank:
    """What a TrainerRunner needs of a rank, in one node count's world."""

    env: DistEnv
    device: Any
    host: str


def sub_env(env: DistEnv, k: int) -> DistEnv | None:
    """This rank in the world of the job's first ``k`` nodes; None on a node outside it.
    Ranks are numbered node by node (Slurm's block distribution, a local run's simulated
    nodes), so a rank keeps its number."""
    if env.node_rank >= k:
        return None
    per = env.tasks_on_nodes
    world = sum(per[:k]) if len(per) >= k else k * env.local_world_size
    if env.rank >= world:
        raise RuntimeError(f"rank {env.rank} on node {env.node_rank} lies outside the first "
                           f"{world} ranks: the scaling report needs ranks numbered node by "
                           "node (Slurm's block distribution).")
    return dataclasses.replace(env, world_size=world, num_nodes=k, nodes=env.nodes[:k],
                               tasks_on_nodes=per[:k])


def node_labels(env: DistEnv) -> list[str]:
    """The node of every rank of ``env``'s world: its host name where the job names its
    nodes (Slurm), else its simulated node's number."""
    counts = list(env.tasks_on_nodes) or [env.local_world_size] * env.num_nodes
    out = []
    for node, count in enumerate(counts):
        name = env.nodes[node] if node < len(env.nodes) else str(node)
        out += [name] * count
    return out[:env.world_size]


def run(cfg: Config, run_dir: RunDir, environ: MutableMapping[str, str],
        options: ScalingOptions) -> dict[str, Any] | None:
    """One rank of the report; rank 0 returns (and writes) the raw results."""
    # deferred: hostlist, torch; and TensorBoard's writer, which rank 0's first logged step
    # would import (services/metrics.py) inside the first node count's timed windows
    import torch
    import torch.distributed as dist
    import torch.utils.tensorboard  # noqa: F401

    from hpc_ddp.rank.join.joined import joined

    with joined(cfg, run_dir, environ) as rank:
        # As train_rank: process-wide, set before any Trainer, so every run has it.
        keep = (cfg.trainer.keep_freed_memory and rank.device.type == "cpu"
                and keep_freed_memory())
        backend = str(dist.get_backend())
        hosts: list[Any] = [None] * rank.env.world_size
        dist.all_gather_object(hosts, rank.host)
        base = with_overrides(cfg, (f"trainer.max_steps={HORIZON}",))
        sizes: list[dict[str, Any]] = []
        fixes: list[dict[str, Any]] = []
        for k in options.sizes:
            env = form(rank, k, backend, cfg)
            if env is None:  # not in this world: wait for its end
                rank.store.wait([f"{KEY}/done/{k}"], timedelta(seconds=options.wait_s))
                continue
            me = SubRank(env, rank.device, rank.host)
            sizes.append(measure_size(base, me, run_dir, k, options))
            if k == options.sizes[-1]:
                fixes = run_fixes(base, me, run_dir, sizes, options)
            dist.barrier()
            if env.is_master:
                rank.store.set(f"{KEY}/done/{k}", "1")
        if options.sizes[-1] != rank.env.num_nodes:
            form(rank, rank.env.num_nodes, backend, cfg, "end")  # the whole job, as joined made it
        if not rank.env.is_master:
            return None
        result = {"device": str(rank.device), "backend": backend, "torch": torch.__version__,
                  "threads_per_rank": torch.get_num_threads(), "keep_freed_memory": keep,
                  "hosts": hosts, "nodes": rank.env.num_nodes,
                  "tasks_per_node": rank.env.local_world_size, "model": cfg.model.name,
                  "batch_size": cfg.trainer.batch_size, "steps": options.steps,
                  "warmup_steps": options.warmup_steps,
                  "windows": len(window_steps(options.steps, options.windows)),
                  "options": asdict(options), "time": time.time(), "sizes": sizes,
                  "fixes": fixes}
        write_json(run_dir.root / RESULT, result)
        return result


def form(rank: Any, k: int, backend: str, cfg: Config, name: str = "") -> DistEnv | None:
    """Give up this process's group (after a barrier in it), then join the world of the
    first ``k`` nodes as its default group; None for a rank outside it (it holds none).
    ``name``: the world's part of the store prefix (default ``k``; each world its own)."""
    import torch.distributed as dist  # deferred: torch

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    env = sub_env(rank.env, k)
    if env is None:
        return None
    prefix = f"{KEY}/world/{name or k}"
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, rank.store),
                            rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=cfg.trainer.collective_timeout_s),
                            device_id=rank.device if backend == "nccl" else None)
    return env


def measure_size(cfg: Config, me: SubRank, run_dir: RunDir, k: int,
                 options: ScalingOptions) -> dict[str, Any]:
    """The plain run on ``k`` nodes, and on more than one the fabric's figures."""
    plan = window_steps(options.steps, options.windows)
    _say(me, run_dir, f"{k} node(s) ({me.env.world_size} ranks): warm-up "
         f"{options.warmup_steps} steps, then {options.steps} timed steps in {len(plan)} "
         "windows")
    out = {"nodes": k, **timed_run(cfg, me, run_dir, f"{k}nodes", options)}
    if k > 1:
        out["fabric"] = fabric(cfg, me, run_dir, k, options)
    if me.env.is_master:
        row = run_row(out)
        bw = out.get("fabric") or {}
        say(run_dir.root, f"{k} node(s): {row['samples_per_s']:.1f} samples/s, "
            f"{row['step_ms']['step']:.1f} ms per step"
            + (f", all-reduce busbw {_gbps(bw.get('achieved_busbw_gbps'))} achieved, "
               f"{_gbps(bw.get('bare_busbw_gbps'))} bare" if bw else ""))
    return out


def timed_run(cfg: Config, me: SubRank, run_dir: RunDir, name: str,
              options: ScalingOptions) -> dict[str, Any]:
    """A Trainer of ``cfg`` warmed up, then timed in windows: every rank's windows, the loss
    of the last window."""
    # deferred: torch
    import torch

    runner = TrainerRunner(name, cfg, me, run_dir)
    try:
        losses = LossRecorder(runner.trainer, me.device)
        runner.run(options.warmup_steps)
        plan = window_steps(options.steps, options.windows)
        windows = []
        for i, steps in enumerate(plan):
            losses.on = i == len(plan) - 1
            windows.append(timed_window(runner, steps, me))
        losses.on = False
        t = cfg.trainer
        return {"ranks": me.env.world_size, "windows": windows, "loss": losses.mean(),
                "samples_per_step": t.batch_size * me.env.world_size * t.grad_accum,
                "node_of_rank": node_labels(me.env), "settings": runner.settings}
    finally:
        runner.close()
        gc.collect()
        if me.device.type == "cuda":
            torch.cuda.empty_cache()


class LossRecorder:
    """The trainer's criterion, wrapped: while ``on``, each micro-batch's loss is summed (on
    the device: reading it would make the host wait for the GPU every step)."""

    def __init__(self, trainer: Any, device: Any) -> None:
        import torch  # deferred: torch

        self.inner, self.device, self.on = trainer.criterion, device, False
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.count = 0
        trainer.criterion = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        loss = self.inner(*args, **kwargs)
        if self.on:
            self.total += loss.detach().double()
            self.count += 1
        return loss

    def mean(self) -> float | None:
        """The mean over every rank's recorded micro-batches (a collective)."""
        # deferred: torch
        import torch
        import torch.distributed as dist

        sums = torch.stack([self.total, torch.tensor(float(self.count), dtype=torch.float64,
                                                     device=self.device)])
        dist.all_reduce(sums)
        return float(sums[0] / sums[1]) if float(sums[1]) > 0 else None


def fabric(cfg: Config, me: SubRank, run_dir: RunDir, k: int,
           options: ScalingOptions) -> dict[str, Any]:
    """The bare all-reduce's busbw at DDP's bucket size (bench comm's measure), and the
    busbw the steps achieved (the probe: every rank's bucket marks, scaling_report.achieved)."""
    # deferred: torch; hostlist (bench.comm)
    import torch.distributed as dist

    from hpc_ddp.bench import comm

    bucket = (cfg.trainer.ddp_bucket_cap_mb or DDP_DEFAULT_BUCKET_MB) * 2**20
    bare = comm.measure("all_reduce", bucket, me.device,
                        comm.CommOptions(iters=20, warmup=2, budget_s=options.busbw_budget_s))
    assert bare is not None  # an all-reduce of any size is measured
    marks = probe(cfg, me, run_dir, f"{k}nodes-probe", options)
    every: list[Any] = [None] * me.env.world_size
    dist.all_gather_object(every, marks)
    return {"bucket_bytes": bare["bytes"], "bare_busbw_gbps": bare["busbw_gbps"],
            "bare_time_us": bare["time_us"],
            **achieved(every, comm.bus_factor("all_reduce", me.env.world_size))}


def probe(cfg: Config, me: SubRank, run_dir: RunDir, name: str,
          options: ScalingOptions) -> list[tuple[int, int, float, float, int]]:
    """A Trainer of ``cfg`` (DDP's own all-reduce: a hook the config names is left out, one
    hook per model) whose buckets are timed over a few steps: this rank's marks."""
    import torch.distributed as dist  # deferred: torch

    if cfg.trainer.ddp_comm_hook != "none":
        cfg = with_overrides(cfg, ("trainer.ddp_comm_hook=none",))
    timing: list[BucketTimes] = []

    def register(trainer: Any) -> None:
        times = BucketTimes(trainer.model.process_group, me.device.type == "cuda")
        trainer.model.register_comm_hook(times, timed_reduce)
        timing.append(times)

    runner = TrainerRunner(name, cfg, me, run_dir, before_begin=register)
    try:
        runner.run(PROBE_WARMUP)
        dist.barrier()
        timing[0].start()
        runner.run(options.probe_steps)
        marks = timing[0].stop()
    finally:
        runner.close()
        gc.collect()
    return marks


def run_fixes(cfg: Config, me: SubRank, run_dir: RunDir, sizes: list[dict[str, Any]],
              options: ScalingOptions) -> list[dict[str, Any]]:
    """Rank 0's verdict, agreed; on the fabric (or --fixes all) each fix at this node count."""
    import torch.distributed as dist  # deferred: torch

    cause: list[Any] = [None]
    if me.env.is_master:
        found = verdict(rows_of(sizes))
        cause[0] = found.cause
        say(run_dir.root, f"verdict: {found.line}")
    dist.broadcast_object_list(cause, src=0)
    if options.fixes == "none" or (options.fixes == "auto" and cause[0] != FABRIC):
        return []
    k = me.env.num_nodes
    out = []
    for fix in fixes_for(cfg.trainer, options.warmup_steps):
        head = {"name": fix.name, "overrides": list(fix.overrides), "advice": list(fix.advice),
                "nodes": k}
        try:
            fixed = with_overrides(cfg, fix.overrides)
            _say(me, run_dir, f"fix {fix.name} at {k} nodes: warm-up, then {options.steps} "
                 "timed steps")
            got = timed_run(fixed, me, run_dir, f"{k}nodes-{fix.name.replace(' ', '_')}",
                            options)
        except UserError as exc:  # refused by the checks (the same on every rank)
            _say(me, run_dir, f"fix {fix.name}: skipped: {exc.message}")
            out.append({**head, "skipped": exc.message})
            continue
        out.append({**head, **got})
        if me.env.is_master:
            row = run_row(out[-1])
            say(run_dir.root, f"fix {fix.name}: {row['samples_per_s']:.1f} samples/s, loss "
                f"{row['loss']:.4f}" if row["loss"] is not None else f"fix {fix.name}: done")
    return out


def _say(me: SubRank, run_dir: RunDir, line: str) -> None:
    if me.env.is_master:
        say(run_dir.root, line)


def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} GB/s"
