"""Throughput a user can act on (docs/observability.md#throughput): each rank's own time per
step, the slowest rank named when it is more than 10 % behind the others, and the model FLOP
utilisation where the FLOPs can be counted.

In synchronous DDP every rank takes the same wall time per step: the gradient all-reduce
makes the fast ranks wait for the slowest. What differs is the part of a step a rank spends
on its own before that wait: waiting for its next batch, and its forward pass (a GPU's time
by CUDA events, read once complete: nothing here synchronises). Each rank adds its own time
to the periodic all-reduce the loop already makes (rank/services/window_sync.py: no
collective of its own, nothing per step), together with whether it was behind the previous
window's mean by more than ``BEHIND`` and more than ``MARGIN`` times its own noise (how much
its own time per step moves from one window to the next: :class:`OwnNoise`), and its rank
number if so: when one rank alone is behind, the sums name it.

MFU: the FLOPs of one forward pass of a batch (torch.utils.flop_counter, on the module
itself, without gradients: no collective, no state touched) times three (forward and
backward, https://arxiv.org/abs/2204.02311 appendix B), against the device's peak.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import read_json
from hpc_ddp.trainer.loop_timing import mark
from hpc_ddp.trainer.sync_probe import SyncProbe

# A rank this much slower than the others' mean own time per step is named.
BEHIND = 0.10
# ... and this many times its own window-to-window noise: ranks that share cores swing by
# 20-40 % between windows (issue 46: "slowest: rank 0 +37%" where nothing was slow), a
# straggler stays behind by about the same amount.
MARGIN = 3.0
# The latest windows whose changes are the noise (their median: a rank that turned slow
# has one jump among them, not a noisy series).
NOISE_WINDOWS = 8
# Dense peak FLOP/s of the devices we know, (16-bit, 32-bit/TF32), by a part of their name.
# https://www.nvidia.com/en-us/data-center/h200/ , /h100/ , /a100/ ; V100: its datasheet.
PEAKS = {"H200": (989e12, 494.7e12), "H100": (989e12, 494.7e12), "A100": (312e12, 156e12),
         "V100": (125e12, 15.7e12), "L40S": (362e12, 183e12), "A10": (125e12, 62.5e12)}


class RankClock:
    """This rank's own time in the current log window: batch waits and forward passes; and
    the batches' timing for the gradient sync ``probe`` (trainer/sync_probe.py), if any."""

    def __init__(self, device: Any, probe: SyncProbe | None = None) -> None:
        self.cuda = getattr(device, "type", "cpu") == "cuda"
        self.own_s = 0.0
        self.probe = probe
        self._began: Any = None
        self._pending: list[tuple[Any, Any]] = []  # CUDA event pairs not read yet

    def batches(self, batches: Iterable[Any]) -> Iterator[Any]:
        """``batches``, the time each ``next`` took counted as this rank's own."""
        it = iter(batches)
        probe = self.probe
        while True:
            if probe is not None:
                probe.before_batch()
            began = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                if probe is not None:
                    probe.no_batch()
                return
            waited = time.perf_counter() - began
            self.own_s += waited
            if probe is not None:
                probe.batch_in_hand(waited)
            yield batch

    def forward_begins(self) -> None:
        self._began = self._mark()

    def forward_ends(self) -> None:
        if self._began is None:
            return
        if self.cuda:
            self._pending.append((self._began, self._mark()))
        else:
            self.own_s += time.perf_counter() - self._began
        self._began = None

    def take(self) -> float:
        """The window's own time so far (the forward passes the GPU has finished); the
        next window starts from zero."""
        done = 0
        for began, ended in self._pending:
            if not ended.query():  # still queued: counted in the next window
                break
            self.own_s += began.elapsed_time(ended) / 1e3
            done += 1
        del self._pending[:done]
        own, self.own_s = self.own_s, 0.0
        return own

    def _mark(self) -> Any:
        return mark(self.cuda)


class OwnNoise:
    """This rank's own time per step, window after window, and how much it moves from one
    window to the next: a lag within that noise names no one."""

    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=NOISE_WINDOWS + 1)

    def spread(self) -> float | None:
        """The median change of the own time per step between consecutive windows, relative
        to the median own time (about the standard deviation of a noisy series); None
        before three windows."""
        times = list(self._times)
        level = statistics.median(times) if times else 0.0
        if len(times) < 3 or level <= 0:
            return None
        return statistics.median(abs(b - a) for a, b in pairwise(times)) / level

    def slow_above(self, own_s: float, steps: int, mean_s: float | None) -> float | None:
        """The own time in this window (of ``steps`` steps) above which this rank counts as
        behind the ranks' mean per step of the window before (``mean_s``); None while the
        noise is not measured yet. The window's own time joins the noise after."""
        noise = self.spread()
        if own_s > 0 and steps > 0:
            self._times.append(own_s / steps)
        if not mean_s or noise is None:
            return None
        return mean_s * (1 + max(BEHIND, MARGIN * noise)) * steps


@dataclass(frozen=True)
class Straggler:
    """The one rank more than BEHIND slower than the others in a window."""

    rank: int
    own_ms: float  # its own time per step
    others_ms: float  # the others' mean
    host: str = "?"
    world_size: int = 0

    @property
    def behind(self) -> float:
        return self.own_ms / self.others_ms - 1 if self.others_ms > 0 else 0.0

    def text(self) -> str:
        others = f"rank {1 - self.rank}" if self.world_size == 2 else "the others"
        return (f"rank {self.rank} on {self.host} is {100 * self.behind:.0f}% behind {others} "
                f"({self.own_ms:.1f} ms vs {self.others_ms:.1f} ms of data wait + forward "
                "per step)")


class Stragglers:
    """Rank 0's view over the windows: a rank is named only when it was the one behind in
    this window and the one before. One window's figure is noisy where ranks share cores or
    a file system (a 2-rank run on one host swung between +30 % and +122 % from run to run);
    a rank that stays behind is a straggler, a rank behind once is not."""

    def __init__(self) -> None:
        self._last: Straggler | None = None

    def confirmed(self, found: Straggler | None) -> Straggler | None:
        before, self._last = self._last, found
        return found if found is not None and before is not None and (
            before.rank == found.rank) else None


def straggler(own_sum_s: float, slow: float, slow_rank_sum: float, slow_own_s: float,
              world_size: int, steps: int) -> Straggler | None:
    """From a window's sums (window_sync.Sums): the rank that was behind, when exactly one
    was and it is more than BEHIND slower than the mean of the others."""
    if round(slow) != 1 or world_size < 2 or steps < 1:
        return None
    others = (own_sum_s - slow_own_s) / (world_size - 1) / steps
    found = Straggler(int(round(slow_rank_sum)), 1e3 * slow_own_s / steps, 1e3 * others,
                      world_size=world_size)
    return found if found.behind > BEHIND else None


def flops_per_sample(module: Any, inputs: Any) -> float | None:
    """Training FLOPs per sample of ``module`` (three times a forward pass of ``inputs``);
    None where they cannot be counted."""
    import torch  # deferred: torch
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            module(inputs)
        total = counter.get_total_flops()
    except Exception:  # an op the counter does not know, a model that needs more args
        return None
    count = int(inputs.shape[0]) if hasattr(inputs, "shape") and inputs.shape else 0
    return 3.0 * total / count if total and count else None


def count_flops(model: Any, inputs: Any, device: Any, autocast_dtype: Any) -> float:
    """:func:`flops_per_sample` of a (DDP-wrapped) model in eval mode, the random streams
    and the model's state left as they were: a resumed run draws what it would have drawn
    (0.0 where the FLOPs cannot be counted)."""
    import torch  # deferred: torch

    module = getattr(model, "module", model)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.autocast(
            device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        module.eval()
        try:
            return flops_per_sample(module, inputs) or 0.0
        finally:
            module.train()


def named(found: Straggler, ranks: Path) -> Straggler:
    """``found`` with its host, from its rank's record (ranks/rank<N>.json: one file)."""
    record = read_json(ranks / f"rank{found.rank}.json")
    host = record.get("host") if isinstance(record, dict) else None
    return replace(found, host=str(host or "?"))


def peak_flops(device: Any, half: bool) -> float | None:
    """The device's dense peak FLOP/s (16-bit when ``half``), None for one we do not know."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    import torch  # deferred: torch

    name = torch.cuda.get_device_name(device)
    for part, (sixteen, thirty_two) in PEAKS.items():
        if part in name:
            return sixteen if half else thirty_two
    return None


def window_values(loss: float, lr: float, speed: float, step_s: float, world: int,
                  own_mean_s: float, flops: float | None, peak: float | None
                  ) -> dict[str, float]:
    """A log window's figures, as TensorBoard, the trackers and the progress line show them:
    ``speed`` in samples/s over every rank; the model FLOP utilisation where the model's
    FLOPs per sample and the device's peak are known."""
    values = {"train/loss": loss, "train/lr": lr, "train/samples_per_s": speed,
              "train/samples_per_s_per_rank": speed / world, "train/step_ms": 1e3 * step_s,
              "train/own_ms": 1e3 * own_mean_s}
    if flops and peak:
        values["train/mfu"] = flops * speed / (peak * world)
    return values
