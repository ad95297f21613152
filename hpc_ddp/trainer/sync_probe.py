"""How much of each step waits on gradient sync, measured on sampled steps of a run
(docs/performance.md#scaling).

A multi-rank DDP run times one step in every ``every`` (``max(trainer.log_interval,
MIN_EVERY)``, the first after ``WARMUP_STEPS``) with the benchmark's own split
(loop_timing.StepTimer: one way to split a step, not two): from asking for the step's first
batch to the end of ``optimizer.step``, and within it the *exposed* gradient sync, from the
last gradient computed to ``optimizer.step`` — the all-reduce that the backward pass did not
hide, DDP's finalisation waiting for it, and waiting for a slower rank to join it. Every
rank samples the same steps (the step count is the same everywhere), so none arrives late
at the all-reduce because the others are being measured.

A loop of your own (``entry=``, ``script=``) is followed the same way by :class:`LoopProbe`,
through torch's global optimizer hooks (rank/main/entry.py, rank/main/script_runner.py).

Cost: between samples one optimizer step hook (a counter) and a check per batch; the
parameter hooks are attached only for a sampled step. On CUDA the marks are CUDA events and
the sampled step is bracketed by two ``torch.cuda.synchronize`` calls (its wall time must be
the GPU's too); no other step waits for the GPU.

Limits: a sampled step starts with an empty GPU queue, so its wall time includes the host's
launch of its first kernels (a slightly longer step, a slightly lower share); under fp16 loss
scaling ``scaler.step`` checks the gradients for inf before ``optimizer.step``, counted as
sync; a step the scaler skips is not sampled; a rank's wait for a slower rank counts as sync
(a straggler shows here too); the summary has rank 0's figure. FSDP (its reduce-scatter is
no DDP all-reduce and its sharded parameters carry no such hooks) and a single rank (nothing
to sync) measure nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hpc_ddp.trainer.loop_timing import StepTimer, Window, sync_share

# An attempt's first steps are not sampled: the allocator, lazy initialisation and DDP's
# first buckets make them slower than the run's steps.
WARMUP_STEPS = 2
# At most one sampled step in this many (every log_interval steps when that is longer): on
# CUDA a sample drains the GPU's queue twice, at most once in ten steps.
MIN_EVERY = 10
# The latest sampled steps the progress (``status`` of a running run) shows the share of.
RECENT = 5


@dataclass(frozen=True)
class SyncFigures:
    """Sampled steps' gradient sync: the share of a step's wall time, and the mean exposed
    sync and step time per sampled step (ms); None where nothing was sampled."""

    share: float | None
    sync_ms: float | None
    step_ms: float | None
    steps: int

    def summary(self) -> dict[str, Any]:
        """summary.json's fields (docs/run-directory.md#summaryjson)."""
        return {"sync_share": self.share, "sync_ms": self.sync_ms,
                "sync_step_ms": self.step_ms, "sync_sampled_steps": self.steps}


def figures(windows: Iterable[Window]) -> SyncFigures:
    """The figures of sampled windows: a ratio of sums (a long step weighs as it costs)."""
    comm = wall = 0.0
    steps = 0
    for w in windows:
        comm, wall, steps = comm + w.comm_s, wall + w.wall_s, steps + w.steps
    if steps == 0:
        return SyncFigures(None, None, None, 0)
    return SyncFigures(sync_share(comm, wall), 1e3 * comm / steps, 1e3 * wall / steps, steps)


def sampled(step: int, every: int) -> bool:
    """Whether the step that follows ``step`` optimizer steps of this attempt is timed."""
    return step >= WARMUP_STEPS and (step - WARMUP_STEPS) % every == 0


class SyncProbe:
    """A StepTimer attached to a model and its optimizer for one sampled step at a time.

    The loop's batch iterator tells it when a batch is asked for (:meth:`before_batch`) and
    how long it took (:meth:`batch_in_hand`): throughput.RankClock does, nothing in the
    loop itself."""

    def __init__(self, device: Any, parameters: Iterable[Any], optimizer: Any, every: int,
                 accum: int = 1) -> None:
        self.timer = StepTimer(device, memory=False, after_step=self._close)
        self.every, self.accum = max(1, every), max(1, accum)
        self.steps = 0  # optimizer steps this attempt
        self._params = [p for p in parameters if p.requires_grad]
        self._optimizer = optimizer
        self._boundary = True  # the next batch is a step's first
        self._open = False
        self._micro = 0  # micro-batches in the open window
        self._attached = False
        self._sums = (0.0, 0.0, 0)  # comm_s, wall_s, steps of every sampled window
        self.recent: deque[Window] = deque(maxlen=RECENT)
        self._handle = optimizer.register_step_post_hook(self._stepped)

    # -- the loop's batches ------------------------------------------------------------------
    def before_batch(self) -> None:
        """A batch is about to be asked for: a sampled step begins here."""
        if self._open and self._micro >= self.accum:
            self._drop()  # a whole step's micro-batches and no optimizer step: a skipped one
        if self._attached and not self._open:
            self.timer.detach()  # not inside the optimizer's hook: its dict is being iterated
            self._attached = False
        if self._boundary and not self._open and sampled(self.steps, self.every):
            self.timer.attach(self._params, self._optimizer)
            self._attached = self._open = True
            self._micro = 0
            self.timer.start()
        self._boundary = False

    def batch_in_hand(self, waited_s: float) -> None:
        if self._open:
            self._micro += 1
            self.timer.data_wait(waited_s)

    def no_batch(self) -> None:
        """The iterator ended before a batch came: the window opened for nothing waits for
        the next epoch's first batch (its start moved there)."""
        if self._open and self._micro == 0:
            self._drop()
            self._boundary = True

    # -- figures -------------------------------------------------------------------------------
    def total(self) -> SyncFigures:
        """Every sampled step of this attempt."""
        return _from_sums(*self._sums)

    def values(self) -> dict[str, float]:
        """The latest sampled steps' share, as the trainer logs it (TensorBoard, progress)."""
        share = figures(self.recent).share
        return {} if share is None else {"train/sync_share": share}

    def close(self) -> None:
        self._drop()
        if self._attached:
            self.timer.detach()
            self._attached = False
        self._handle.remove()

    # -- hooks ---------------------------------------------------------------------------------
    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        self._boundary = True

    def _close(self) -> None:
        """The timer's step ended (its optimizer hook): the sampled step is complete."""
        if not self._open:
            return
        self._open = False
        window = self.timer.stop(1)
        self.recent.append(window)
        comm, wall, steps = self._sums
        self._sums = (comm + window.comm_s, wall + window.wall_s, steps + 1)

    def _drop(self) -> None:
        self._open = False  # not timed: its marks are reset by the next start


class LoopProbe:
    """The sampled steps of a loop of your own (``entry=``, ``script=``), where no batch
    iterator of ours tells a step's start: torch's global optimizer step hooks
    (``torch.optim.optimizer.register_optimizer_step_pre_hook``/``post_hook``) follow the
    first optimizer that steps, and a sampled step runs from the end of the step before it
    to its own end (its wait for the next batch included, as in the trainer's split); its
    gradient sync, as everywhere, from the last gradient of that optimizer's parameters to
    its ``step``. Other optimizers (a GAN's second) are not followed."""

    def __init__(self, every: int = MIN_EVERY) -> None:
        import torch.optim.optimizer as optim  # deferred: torch

        # Made for the first optimizer that steps, on its parameters' device (a CPU loop on
        # a GPU node makes no CUDA events).
        self.timer: StepTimer | None = None
        self.every = max(1, every)
        self.steps = 0
        self._optimizer: Any = None
        self._open = False
        self._sums = (0.0, 0.0, 0)
        # Removed at close, never inside a step: torch iterates these dicts while it calls them.
        self._handles = [optim.register_optimizer_step_pre_hook(self._before),
                         optim.register_optimizer_step_post_hook(self._after)]

    def total(self) -> SyncFigures:
        return _from_sums(*self._sums)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.timer is not None:
            self.timer.detach()
        self._open = False

    def _before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._open and optimizer is self._optimizer and self.timer is not None:
            self.timer.step_begins()

    def _after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._optimizer is None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if not params:
                return
            self._optimizer = optimizer
            self.timer = StepTimer(params[0].device, memory=False)
        if optimizer is not self._optimizer or self.timer is None:
            return
        if self._open:
            self.timer.step_ends()
            window = self.timer.stop(1)
            self.timer.detach()  # the parameters' hooks only: a dict not being iterated
            self._open = False
            comm, wall, steps = self._sums
            self._sums = (comm + window.comm_s, wall + window.wall_s, steps + 1)
        self.steps += 1
        if sampled(self.steps, self.every):
            self.timer.attach_parameters(
                p for group in optimizer.param_groups for p in group["params"])
            self.timer.start()
            self.timer.data_wait(0.0)  # compute is counted from here: no batch is seen
            self._open = True


def _from_sums(comm_s: float, wall_s: float, steps: int) -> SyncFigures:
    return figures([Window(steps, wall_s, 0.0, 0.0, comm_s, 0.0, None, "none", None)])


def for_trainer(model: Any, optimizer: Any, trainer: Any, world_size: int,
                device: Any) -> SyncProbe | None:
    """The probe of the built-in trainer (``trainer``: cfg.trainer), or None where there is
    no DDP gradient sync to measure (one rank, FSDP)."""
    if world_size < 2 or trainer.strategy != "ddp":
        return None
    return SyncProbe(device, model.parameters(), optimizer,
                     max(trainer.log_interval, MIN_EVERY), trainer.grad_accum)


def for_loop(world_size: int, strategy: str) -> LoopProbe | None:
    """The probe of a loop of your own, or None where there is no DDP gradient sync to
    measure (one rank; ``trainer.strategy=fsdp``)."""
    return LoopProbe() if world_size >= 2 and strategy == "ddp" else None


def summary_of(probe: SyncProbe | LoopProbe | None) -> dict[str, Any]:
    """summary.json's sync fields (null where not measured)."""
    return (probe.total() if probe is not None else figures(())).summary()


def values_of(probe: SyncProbe | None) -> dict[str, float]:
    return probe.values() if probe is not None else {}
