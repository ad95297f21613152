"""One rank of ``python -m hpc_ddp.bench.train``: the contenders, timed in rotating rounds.

For each model the rank builds the hand-written loop and one Trainer per setting, warms each
up, picks the steps per window from the baseline's pace (the same on every rank), then runs
as many rounds as fit the time budget; in round r the order starts at contender r, so none
always runs first.
Each window is bracketed by barriers and reported by every rank (its wall time and step
split); rank 0 collects them and writes the job's result.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, MutableMapping
from typing import Any

from hpc_ddp.bench.train_plan import (
    RESULT,
    TrainOptions,
    for_model,
    replace_model,
    with_overrides,
)
from hpc_ddp.config.schema import Config
from hpc_ddp.rundir import RunDir, write_json
from hpc_ddp.trainer.cpu_memory import keep_freed_memory
from hpc_ddp.trainer.loop_timing import StepTimer

# The trainers' schedules and the baseline's cosine span this many steps: a benchmark never
# reaches the end of either.
HORIZON = 10**9


class BaselineRunner:
    """The hand-written loop (hpc_ddp/bench/baseline.py), driven step by step."""

    name = "baseline"

    def __init__(self, cfg: Config, device: Any) -> None:
        from hpc_ddp.bench import baseline  # deferred (start-up): bench.baseline

        self.parts = baseline.build(cfg.model, cfg.data, cfg.optim, cfg.trainer.batch_size,
                                    cfg.trainer.seed, device, HORIZON)
        self.timer = StepTimer(device).attach(self.parts.model.parameters(),
                                              self.parts.optimizer)
        self._steps = baseline.train_steps(self.parts, self.timer.wrap(self.parts.loader))
        self.settings = {"loop": "hand-written", "precision": "fp32", "channels_last": False,
                         "optimizer": "torch default", "data": "DataLoader per sample",
                         "ddp": "defaults"}

    def run(self, steps: int) -> None:
        # deferred (start-up): trainer.ddp_setup
        from hpc_ddp.trainer.ddp_setup import apply_process_settings

        apply_process_settings(False, False)  # torch's defaults: what a plain script runs with
        for _ in range(steps):
            next(self._steps)

    def close(self) -> None:
        self._steps.close()
        self.timer.detach()


class TrainerRunner:
    """hpc_ddp's Trainer with one setting, driven through Trainer.train_steps."""

    def __init__(self, name: str, cfg: Config, rank: Any, run_dir: RunDir,
                 before_begin: Callable[[Any], None] | None = None) -> None:
        """``rank``: anything with the ``env`` and ``device`` of a joined Rank;
        ``before_begin``: called with the Trainer before its first backward (a DDP
        communication hook can still be registered then)."""
        # deferred: torch; start-up: rank.services.stopping
        from hpc_ddp.rank.services import stopping
        from hpc_ddp.trainer.loop import Trainer

        self.name = name
        folder = RunDir(run_dir.root / "variants" / f"{cfg.model.name}-{name}")
        # A StopRequest nobody signals: the trainer still agrees on it every
        # stop_check_interval steps, as in a real run (part of its overhead).
        self.trainer = Trainer(cfg, rank.env, folder, rank.device, stopping.StopRequest())
        if before_begin is not None:
            before_begin(self.trainer)
        self.timer = StepTimer(rank.device).attach(self.trainer.model.parameters(),
                                                   self.trainer.optimizer)
        self.trainer.loaders.train = self.timer.wrap(self.trainer.loaders.train)
        self.trainer.begin()
        self.settings = self.trainer.tuning.as_dict()

    def run(self, steps: int) -> None:
        # deferred (start-up): trainer.ddp_setup
        from hpc_ddp.trainer.ddp_setup import apply_process_settings

        tune = self.trainer.tuning
        apply_process_settings(tune.deterministic, tune.cudnn_benchmark,
                               tune.fill_uninitialized_memory)
        self.trainer.train_steps(steps)

    def close(self) -> None:
        self.trainer.close()
        self.timer.detach()


def run(cfg: Config, run_dir: RunDir, environ: MutableMapping[str, str],
        options: TrainOptions) -> dict[str, Any] | None:
    """One rank of the benchmark; rank 0 returns (and writes) the results."""
    # deferred: hostlist, torch
    import torch
    import torch.distributed as dist

    from hpc_ddp.rank.join.joined import joined

    with joined(cfg, run_dir, environ) as rank:
        # Process-wide and not undone: set before any contender exists, so all of them, the
        # baseline too, run under the same allocator (the trainer would set it anyway).
        keep = (cfg.trainer.keep_freed_memory and rank.device.type == "cpu"
                and keep_freed_memory())
        models = [measure_model(cfg, rank, run_dir, model, options) for model in options.models]
        hosts: list[Any] = [None] * rank.env.world_size
        dist.all_gather_object(hosts, rank.host)
        if not rank.env.is_master:
            return None
        result = {"world_size": rank.env.world_size, "hosts": hosts,
                  "device": str(rank.device), "backend": str(dist.get_backend()),
                  "threads_per_rank": torch.get_num_threads(), "keep_freed_memory": keep,
                  "batch_size": cfg.trainer.batch_size, "image_size": cfg.data.image_size,
                  "torch": torch.__version__, "time": time.time(), "models": models}
        write_json(run_dir.root / RESULT, result)
        return result


def measure_model(cfg: Config, rank: Any, run_dir: RunDir, model: str,
                  options: TrainOptions) -> dict[str, Any]:
    import torch  # deferred: torch

    runners: list[Any] = []
    try:
        runners.append(BaselineRunner(replace_model(cfg, model), rank.device))
        for variant in for_model(model, options.variants):
            vcfg = replace_model(with_overrides(cfg, (*variant.overrides,
                                                      f"trainer.max_steps={HORIZON}")), model)
            runners.append(TrainerRunner(variant.name, vcfg, rank, run_dir))
        for runner in runners:
            runner.run(options.warmup_steps)
        steps, rounds = _plan(runners, options, rank.device)
        windows: dict[str, list[list[dict[str, Any]]]] = {r.name: [] for r in runners}
        for round_ in range(rounds):
            k = round_ % len(runners)
            for runner in runners[k:] + runners[:k]:
                windows[runner.name].append(timed_window(runner, steps, rank))
        return {"model": model, "steps_per_window": steps, "windows": windows,
                "order": [r.name for r in runners],
                "settings": {r.name: r.settings for r in runners},
                "checkpoint_mb": {r.name: _checkpoint_mb(r) for r in runners
                                  if _checkpoint_mb(r)}}
    finally:
        for runner in runners:
            runner.close()
        runners.clear()
        gc.collect()
        if rank.device.type == "cuda":
            torch.cuda.empty_cache()


def _checkpoint_mb(runner: Any) -> float | None:
    """The size of the contender's latest checkpoint (rank 0's file), if it wrote one."""
    from hpc_ddp.rank.services import checkpoint  # deferred (start-up): rank.services.checkpoint

    trainer = getattr(runner, "trainer", None)
    path = checkpoint.latest_path(trainer.run.checkpoints) if trainer is not None else None
    return path.stat().st_size / 2**20 if path is not None and path.exists() else None


def timed_window(runner: Any, steps: int, rank: Any) -> list[dict[str, Any]]:
    """Every rank's account of one timed window of ``steps`` steps (``rank.env``: the
    process group's ranks; the scaling report runs it on a smaller world too)."""
    import torch.distributed as dist  # deferred: torch

    writer = getattr(getattr(runner, "trainer", None), "writer", None)
    saved = writer.saves if writer is not None else 0
    dist.barrier()
    runner.timer.start()
    runner.run(steps)
    window = runner.timer.stop(steps)
    record = {**window.as_dict(), "checkpoints": (writer.saves - saved) if writer else 0}
    if writer is not None:  # a background write ends here, untimed, not in the next window
        writer.wait()
    gathered: list[Any] = [None] * rank.env.world_size
    dist.all_gather_object(gathered, record)
    return gathered


def _plan(runners: list[Any], options: TrainOptions, device: Any) -> tuple[int, int]:
    """(steps per window, rounds): windows of about options.window_s of the baseline's steps;
    as many rounds as fit options.budget_s, each contender timed once on a short probe. The
    same on every rank (the slowest rank decides)."""
    # deferred: torch
    import torch
    import torch.distributed as dist

    per_step = []
    for runner in runners:
        dist.barrier()
        runner.timer.start()
        runner.run(options.min_steps)
        per_step.append(runner.timer.stop(options.min_steps).wall_s / options.min_steps)
    steps = max(options.min_steps, round(options.window_s / max(per_step[0], 1e-6)))
    fit = int(options.budget_s / max(sum(per_step) * steps, 1e-6))
    rounds = min(options.rounds, max(options.min_rounds, fit))
    # A whole number of rotations where --rounds allows one: every contender is timed in
    # every position of a round equally often (what runs just before a contender can slow
    # it: caches, the allocator).
    n = len(runners)
    if rounds >= n:
        rounds = min(-(-rounds // n) * n, options.rounds // n * n)
    agreed = torch.tensor([steps, rounds], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return int(agreed[0]), int(agreed[1])
