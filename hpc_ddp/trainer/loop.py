"""The DDP training loop of one rank: train, evaluate, checkpoint, resume exactly.

``Trainer.train`` reads like a table of contents; every counter that matters for an exact
resume (step, epoch, position inside the epoch, log window) is in ``state_dict``, and each
rank's RNG streams go in a file of its own (rank/services/ckpt_writer.py). The trainer runs
through the same :class:`~hpc_ddp.rank.context.context.Context` a user's loop gets: its
checkpoints, resume, stop agreement, metrics and restart history are the Context's. The
performance settings (precision, memory format, DDP options, compilation, optimizer kernel,
allocator) are resolved in ``ddp_setup``. Nothing in a step waits for the GPU or for the other ranks
beyond DDP's own all-reduce: the periodic log and stop-agreement collective is read a step
later (``window_sync``); evaluations wait, checkpoints only for the copy to the CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Any

import torch

from hpc_ddp.config.schema import Config
from hpc_ddp.data.global_order import planned_ranks
from hpc_ddp.data.loaders import build_loaders
from hpc_ddp.data.sets import build_datasets, describe, first_batch
from hpc_ddp.rank.context.context import Context
from hpc_ddp.rank.join.distenv import DistEnv
from hpc_ddp.rank.join.joined import Rank
from hpc_ddp.rank.services import pruning, rng, sharded_norms, sharding, stopping, window_sync
from hpc_ddp.rank.services.ddp_warmup import settle_buckets
from hpc_ddp.rundir import RunDir
from hpc_ddp.trainer import ddp_setup, sync_probe, throughput
from hpc_ddp.trainer.augment import flip_and_crop, prepare_inputs
from hpc_ddp.trainer.evaluate import Evaluator, input_and_target
from hpc_ddp.trainer.models import build_model, check_classes, describe_model
from hpc_ddp.trainer.objectives import batch_size, build_loss, build_metrics, to_device
from hpc_ddp.trainer.optim import build_optimizer, build_scheduler, load_optimizer_state

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv, run: RunDir, device: Any,
                 stop: stopping.StopRequest | None = None, cpus: int | None = None,
                 joined: Rank | None = None) -> None:
        """``cpus``: the task's CPUs, for the loader's auto settings (default: the intra-op
        thread count rank.py set from them); ``joined``: the joined rank (its store carries
        the heartbeat a supervisor watches)."""
        self.cfg, self.env, self.run, self.device, self.stop = cfg, env, run, device, stop
        self.ctx = Context(cfg, run, env, device, stop=stop, joined=joined)
        t = cfg.trainer
        rng.seed_all(t.seed)
        self.data = build_datasets(cfg.data, t.seed, env.rank, env.world_size)
        classes = check_classes(cfg, self.data.num_classes)
        rng.seed_all(t.seed)  # the same initial weights everywhere (DDP also broadcasts them)
        model = build_model(cfg.model, cfg.data.image_size, classes)
        tune = ddp_setup.tuning(cfg, device, model)
        # self.model: the DDP module (state, no_sync), or under trainer.strategy=fsdp the
        # sharded model; self.forward: what runs the batch (the same module, or compiled).
        self.sharded = t.strategy == "fsdp"
        self.model, self.forward = ddp_setup.wrap(model, tune, device, self.ctx)
        tune = ddp_setup.fused_optimizer(tune, self.model, cfg, device)
        self.loaders = build_loaders(cfg.data, t.batch_size, env.rank, env.world_size, t.seed,
                                     device.type, cpus or torch.get_num_threads(), self.data,
                                     planned_ranks(cfg))  # the global order: min_nodes
        ls = self.loaders.settings
        assert ls is not None
        self.tuning = dataclasses.replace(tune, num_workers=ls.num_workers,
                                          pin_memory=ls.pin_memory, batched_loader=ls.batched)
        self.criterion = build_loss(cfg.loss)
        self.evaluator = Evaluator(build_metrics(cfg.metrics), self.criterion, device)
        self.micro_per_epoch = math.ceil(self.loaders.samples_per_epoch() / t.batch_size)
        steps_per_epoch = math.ceil(self.micro_per_epoch / t.grad_accum)
        self.total_steps = steps_per_epoch * t.epochs
        if t.max_steps is not None:
            self.total_steps = t.max_steps
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optim,
                                         self.tuning.fused_optimizer, device.type)
        self.scheduler = build_scheduler(self.optimizer, cfg.scheduler, self.total_steps)
        self.autocast_dtype = ddp_setup.autocast_dtype(self.tuning.precision, t.strategy)
        self.scaler = ddp_setup.grad_scaler(self.tuning, device)
        self.aug_gen = torch.Generator().manual_seed(t.seed * 7919 + env.rank)
        self.global_step = self.epoch = self.micro_in_epoch = self.samples_seen = 0
        # A trial of an adaptive sweep: pruned from its evaluations (rank/services/pruning.py).
        self.trial = pruning.from_environ(os.environ, env.is_master, run.root)
        # loss_sum: a float, on a GPU a float64 tensor (see _forward_backward).
        self.window: dict[str, Any] = {"loss_sum": 0.0, "count": 0, "samples": 0}
        self.last_train_loss, self.last_eval = float("nan"), dict[str, float]()
        self.checkpoint_step: int | None = None
        self._settled = False  # DDP's buckets (_settle_buckets)
        # Throughput (trainer/throughput.py): own time, the ranks' mean per step in the last
        # window (what "behind" is measured against), FLOPs per sample, gradient sync's share.
        self.clock = throughput.RankClock(device, sync_probe.for_trainer(
            self.model, self.optimizer, t, env.world_size, device))
        self._own_mean_s: float | None = None
        self.stragglers = throughput.Stragglers()  # rank 0 names them
        self.noise = throughput.OwnNoise()  # this rank's own time, window to window
        self._logged_step = 0
        self._flops: float | None = None

    # -- state ---------------------------------------------------------------------------
    def _generators(self) -> dict[str, Any]:
        return {"augment": self.aug_gen, "loader": self.loaders.train.generator}

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume but the random streams, which each rank saves on its own
        (save_checkpoint), and the restart history and world size, which the Context records
        beside it. References to the live tensors: copy them before they change."""
        self._finish_reduction()  # samples_seen and the loss are counted in
        return {
            **self._weights(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "counters": {"global_step": self.global_step, "epoch": self.epoch,
                         "micro_in_epoch": self.micro_in_epoch,
                         "samples_seen": self.samples_seen,
                         "window": {**self.window, "loss_sum": float(self.window["loss_sum"])},
                         "last_train_loss": self.last_train_loss,
                         "last_eval": dict(self.last_eval)},
        }

    def _weights(self) -> dict[str, Any]:
        """The model's and optimizer's state: under fsdp this rank's shards (DTensors, the
        optimizer's state by parameter name: rank/services/sharding.py)."""
        if self.sharded:
            return sharding.state_dict(self.model, self.optimizer)
        # Rank 0's buffers everywhere first: a DCP checkpoint writes each from any rank.
        sharded_norms.broadcast_buffers(self.model.module)
        return {"model": self.model.module.state_dict(),
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.sharded:
            sharding.load_state_dict(self.model, self.optimizer, state)
        else:
            self.model.module.load_state_dict(state["model"])
            load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        c = state["counters"]
        self.global_step, self.epoch = c["global_step"], c["epoch"]
        self.micro_in_epoch, self.samples_seen = c["micro_in_epoch"], c["samples_seen"]
        self.window, self.last_train_loss = dict(c["window"]), c["last_train_loss"]
        self.last_eval = dict(c["last_eval"])

    def resume_if_possible(self, cause: str) -> None:
        """Continue from the newest usable checkpoint, if any (ctx.load: this rank's random
        streams too). Loaded onto the CPU: RNG states must stay CPU byte tensors, and
        load_state_dict moves the weights and optimizer state to the parameters' device
        itself (optimizer step counters stay on the CPU where torch wants them there)."""
        self.ctx.resume_cause = cause
        # Sharded: a checkpoint's tensors are read into this rank's shards in place.
        into = self._weights() if self.sharded else None
        if self.ctx.load(generators=self._generators(), check=self.load_state_dict,
                         into=into) is None:
            return
        self.checkpoint_step = self.global_step
        saved_world = self.ctx.checkpoints.resumed_world_size
        if saved_world not in (None, self.env.world_size) and not self.loaders.global_order:
            # Each rank's batches of the epoch so far, counted for the new world size: the
            # samples of the epoch already trained are skipped (exactly when the counts
            # divide; docs/fault-tolerance.md#resuming-on-another-world-size).
            self.micro_in_epoch = self.micro_in_epoch * saved_world // self.env.world_size
        log.info("resumed from step %d (epoch %d, batch %d of the epoch)", self.global_step,
                 self.epoch, self.micro_in_epoch)

    # -- the loop --------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Train to total_steps; returns the summary (written to summary.json by rank 0)."""
        self.begin()
        finished = False
        try:
            self.train_steps(self.total_steps - self.global_step)
            if not self.last_eval or self.last_eval.get("step") != self.global_step:
                self.evaluate()
            if self.checkpoint_step != self.global_step:
                self.save_checkpoint()
            self.ctx.flush()  # the last checkpoint is on disk before the run reports done
            finished = True
            return self.summary()
        finally:
            self.close(finished)

    def begin(self) -> None:
        """Start the clock (train() does this; benchmarks call it)."""
        self.ctx.total_steps = self.total_steps
        log.info("training %s on %s (%s): %d steps, world size %d, %d steps done",
                 describe_model(self.cfg.model), describe(self.data), self.device,
                 self.total_steps, self.env.world_size, self.global_step)
        log.info("settings: %s", ", ".join(f"{k}={v}" for k, v in self.tuning.as_dict().items()))
        self._settle_buckets()
        self._count_flops()
        self.started = self._window_start = time.perf_counter()
        self._logged_step = self.global_step
        self.samples_at_start = self.samples_seen

    def _settle_buckets(self) -> None:
        """DDP's final gradient buckets before the first real step (services/ddp_warmup), so
        a resumed run sums gradients exactly as the uninterrupted one."""
        if self._settled or self.sharded:  # FSDP has no buckets to settle
            return
        self._settled = True
        x, targets = self._first_batch()
        with torch.autocast(self.device.type, dtype=self.autocast_dtype,
                            enabled=self.autocast_dtype is not None):
            settle_buckets(self.model, x, targets, self.criterion, self._generators())

    def _count_flops(self) -> None:
        """FLOPs per sample of the model, on one batch (throughput.count_flops)."""
        if self._flops is None:
            self._flops = throughput.count_flops(self.model, self._first_batch()[0],
                                                 self.device, self.autocast_dtype)

    def _first_batch(self) -> tuple[Any, Any]:
        """The training set's first batch on the device, its inputs as the model takes them."""
        inputs, targets = input_and_target(first_batch(self.data.train,
                                                       self.cfg.trainer.batch_size))
        return (prepare_inputs(to_device(inputs, self.device), self.data.stats,
                               self.tuning.channels_last), to_device(targets, self.device))

    def close(self, finished: bool = True) -> None:
        """Flush what is pending (Context.close); ``finished`` false (the loop raised): the
        error in flight is the cause, so neither the log reduction (a dead peer never joins
        it) nor the checkpoint being written (only logged if it fails) replaces it."""
        self.ctx.close(finished)

    def train_steps(self, steps: int) -> None:
        """Train ``steps`` more optimizer steps (at most up to total_steps), then return.

        The same steps, in the same order, as an uninterrupted train(): a stretch ends
        mid-epoch exactly as a resumed run starts there.
        """
        until = min(self.global_step + steps, self.total_steps)
        while self.global_step < until and self.trial.pruned_at is None:
            self._train_epoch(until)

    def _train_epoch(self, until: int) -> None:
        t = self.cfg.trainer
        self.loaders.set_position(self.epoch, self.micro_in_epoch * t.batch_size)
        self.model.train()
        batches = iter(self.loaders.train)
        if not self.loaders.seekable:  # an iterable data set without set_position: skip
            for _ in range(self.micro_in_epoch):
                next(batches)
        for batch in self.clock.batches(batches):
            images, labels = input_and_target(batch)
            self.micro_in_epoch += 1
            end_of_epoch = self.micro_in_epoch == self.micro_per_epoch
            stepping = end_of_epoch or self.micro_in_epoch % t.grad_accum == 0
            self._forward_backward(images, labels, sync=stepping)
            if stepping:
                self._optimizer_step()
                if end_of_epoch:
                    self.epoch += 1
                    self.micro_in_epoch = 0
                self._after_step(end_of_epoch)
                if self.global_step >= until or end_of_epoch or self.trial.pruned_at:
                    return

    def _forward_backward(self, images: Any, labels: Any, sync: bool) -> None:
        images = to_device(images, self.device)
        labels = to_device(labels, self.device)
        if self.data.batch_augment:
            images = flip_and_crop(images, self.aug_gen)
        x = prepare_inputs(images, self.data.stats, self.tuning.channels_last)
        # no_sync: accumulate locally, all-reduce once per optimizer step.
        ctx = ddp_setup.gradient_sync(self.model, sync)
        with ctx, torch.autocast(self.device.type, dtype=self.autocast_dtype,
                                 enabled=self.autocast_dtype is not None):
            self.clock.forward_begins()
            loss = self.loaders.weighed(self.criterion(self.forward(x), labels))
            self.clock.forward_ends()
        accum = self.cfg.trainer.grad_accum
        self.scaler.scale(loss / accum if accum > 1 else loss).backward()
        # Summed in float64 either way; on a GPU as a tensor, since reading the loss every
        # step would make the host wait for the GPU.
        if self.device.type == "cpu":
            self.window["loss_sum"] += float(loss.detach())
        else:
            self.window["loss_sum"] = self.window["loss_sum"] + loss.detach().double()
        self.window["count"] += 1
        self.window["samples"] += batch_size(labels)

    def _optimizer_step(self) -> None:
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.global_step += 1

    def _after_step(self, end_of_epoch: bool) -> None:
        t = self.cfg.trainer
        last = self.global_step >= self.total_steps
        self._finish_reduction()  # the one launched at an earlier step
        self.ctx.stepped(self.global_step)
        log_now = self.global_step % t.log_interval == 0 or last
        check_stop = (self.stop is not None and not last
                      and self.global_step % t.stop_check_interval == 0)
        if log_now or check_stop:
            self._start_reduction(log_now, check_stop)
            if last:
                self._finish_reduction()
        if (t.eval_interval and self.global_step % t.eval_interval == 0) or (
                not t.eval_interval and end_of_epoch):
            self.evaluate()
        # The last step's checkpoint is written by train() after the final evaluation, so a
        # finished run's checkpoint holds its final metrics too.
        if self.global_step % t.checkpoint_interval == 0 and not last:
            self.save_checkpoint()
        if self.ctx.stop_code != stopping.NONE:
            self._stop()

    def _stop(self) -> None:
        """The ranks agreed that one of them was signalled: all stop here, checkpointed."""
        code = self.ctx.stop_code
        log.warning("stop requested (%s): checkpointing at step %d", "SIGTERM" if code ==
                    stopping.TERM else "requeue signal", self.global_step)
        if self.checkpoint_step != self.global_step:
            self.save_checkpoint()
        self.ctx.flush()  # complete before the job is requeued or ends
        self._finish_reduction()  # every rank is here: this step's log window is read
        # progress.json says where the run stands: the stop step (its checkpoint), which may
        # lie after the last logged step.
        self.ctx.metrics.write_progress(self.global_step, self.epoch,
                                        {"loss": self.last_train_loss, "stopped": 1.0})
        raise stopping.StopTraining(code, self.global_step)

    def _start_reduction(self, log_now: bool, check_stop: bool) -> None:
        """Launch this step's collective through the Context (services/window_sync): the log
        window's sums and/or the stop agreement; read at the next step or before anything
        that needs the result."""
        now = time.perf_counter()
        elapsed = max(now - self._window_start, 1e-9)
        w = self.window
        own = self.clock.take() if log_now else 0.0
        steps = max(self.global_step - self._logged_step, 1)
        slow_above = self.noise.slow_above(own, steps, self._own_mean_s) if log_now else None
        self.ctx.launch_collective(
            step=self.global_step, check_stop=check_stop,
            window=(w["loss_sum"], w["count"], w["samples"]) if log_now else None,
            on_sums=self._write_log if log_now else None, epoch=self.epoch,
            lr=self.scheduler.get_last_lr()[0], elapsed_s=elapsed, own_s=own,
            slow_above=slow_above)
        if log_now:
            self._window_start = now
            self.window = {"loss_sum": 0.0, "count": 0, "samples": 0}

    def _finish_reduction(self) -> None:
        self.ctx.finish_collective()

    def _write_log(self, p: window_sync.Reduction, sums: window_sync.Sums) -> None:
        self.samples_seen += int(sums.samples)
        self.last_train_loss = sums.loss_sum / max(sums.batches, 1)
        world, steps = self.env.world_size, max(p.step - self._logged_step, 1)
        self._logged_step = p.step
        self._own_mean_s = sums.own_s / world / steps
        speed = sums.samples / p.elapsed_s
        values = sync_probe.values_of(self.clock.probe) | throughput.window_values(
            self.last_train_loss, p.lr, speed, p.elapsed_s / steps, world, self._own_mean_s,
            self._flops, throughput.peak_flops(self.device, self.autocast_dtype is not None))
        slow = self.stragglers.confirmed(throughput.straggler(
            sums.own_s, sums.slow, sums.slow_rank, sums.slow_own_s, world, steps)
            if self.env.is_master else None)
        if slow is not None:
            values.update({"train/slowest_rank": float(slow.rank),
                           "train/slowest_behind": slow.behind})
        self.ctx.log(values, p.step, epoch=p.epoch, final=p.step >= self.total_steps)
        log.info("step %d/%d epoch %d loss %.4f lr %.4g samples/s %.0f step %.1f ms%s%s",
                 p.step, self.total_steps, p.epoch, self.last_train_loss, p.lr, speed,
                 values["train/step_ms"], f" MFU {100 * values['train/mfu']:.1f}%"
                 if "train/mfu" in values else "",
                 f"; {throughput.named(slow, self.run.ranks).text()}" if slow else "")

    def evaluate(self) -> dict[str, float]:
        """Loss and metrics over the whole eval set, summed over ranks (no sample twice)."""
        self._finish_reduction()  # the log of this step goes out first
        if self.loaders.eval is None:
            return self.last_eval
        self.model.eval()
        means = self.evaluator.run(self.forward, self.loaders.eval, self.data.stats,
                                   self.tuning.channels_last, self.autocast_dtype,
                                   lockstep=self.sharded, alive=self.ctx.alive)
        self.model.train()
        self.last_eval = {"step": self.global_step, **means}
        self.ctx.log({f"eval/{k}": v for k, v in means.items()}, self.global_step,
                     progress=False)
        log.info("eval at step %d: %s", self.global_step,
                 " ".join(f"{k} {v:.4f}" for k, v in means.items()))
        self.trial.after_eval(self.global_step, means, self.device)  # a collective in a trial
        return self.last_eval

    def save_checkpoint(self) -> None:
        """Every rank, at the same step: rank 0's state and each rank's random streams are
        copied to the CPU here and written in the background (rank/services/ckpt_writer.py)."""
        self._finish_reduction()  # on every rank: its result is awaited by all
        self.ctx.save(self.state_dict(), self.global_step, generators=self._generators())
        self.checkpoint_step = self.global_step

    def summary(self) -> dict[str, Any]:
        self._finish_reduction()
        elapsed = time.perf_counter() - self.started
        return {
            "world_size": self.env.world_size, "num_nodes": self.env.num_nodes,
            "global_step": self.global_step, "total_steps": self.total_steps,
            "epochs_completed": self.epoch, "samples_seen": self.samples_seen,
            "final_train_loss": self.last_train_loss,
            "eval_loss": self.last_eval.get("loss"),
            "eval_accuracy": self.last_eval.get("accuracy"),
            "eval_metrics": {k: v for k, v in self.last_eval.items() if k != "step"},
            "samples_per_s": (self.samples_seen - self.samples_at_start) / max(elapsed, 1e-9),
            "train_time_s": elapsed,
            "resumed_from_step": self.ctx.resumed_from_step, "restarts": len(self.ctx.restarts),
            "restart_history": self.ctx.restarts,
            "device": str(self.device), "settings": self.tuning.as_dict(),
            **sync_probe.summary_of(self.clock.probe),  # gradient sync's share of a step
        }

