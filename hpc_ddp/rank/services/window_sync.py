"""The trainer's periodic collective, started at one step and read at a later one.

Every ``log_interval`` steps the ranks sum their loss window, and every
``stop_check_interval`` steps they agree whether any rank was signalled to stop. Both travel
in one all-reduce of nine float64 values (with each rank's own time and whether it was
behind: trainer/throughput.py), launched without waiting: the step after (or the
next checkpoint, evaluation or summary, whichever comes first) reads it. Waiting on the spot
costs every rank a collective's latency each time — milliseconds with gloo on a busy CPU
node, and on a GPU a drained pipeline, since reading the result waits for all queued work.

The stop code is agreed as the MAX over ranks (``stopping``: the strongest request wins),
derived from the sums of one-hot counts: requeue if any rank asked to requeue, else
SIGTERM if any got one, else none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from hpc_ddp.rank.services import stopping


class Sums(NamedTuple):
    """What an all-reduce of the window gives back, summed over the ranks."""

    loss_sum: float
    batches: float  # micro-batches
    samples: float
    stop_code: int | None  # the agreed stop code, None when this one carried no agreement
    # The ranks' own time in the window (trainer/throughput.py), and of the ranks that were
    # behind: how many, the sum of their rank numbers, the sum of their own times.
    own_s: float = 0.0
    slow: float = 0.0
    slow_rank: float = 0.0
    slow_own_s: float = 0.0


@dataclass
class Reduction:
    """One launched all-reduce and what it is for."""

    step: int
    epoch: int
    lr: float
    elapsed_s: float  # wall time of the log window it closes
    log: bool  # carries a log window
    stop: bool  # carries a stop agreement
    _work: Any
    _values: Any  # the reduced tensor (CPU), or its pinned host copy (CUDA)
    _ready: Any = None  # CUDA event after the copy to the host

    def result(self) -> Sums:
        """The sums over the ranks; waits if needed."""
        if self._ready is not None:
            self._ready.synchronize()
        else:
            self._work.wait()
        loss_sum, count, samples, term, requeue, *own = self._values.tolist()
        code = None
        if self.stop:
            code = stopping.REQUEUE if requeue else stopping.TERM if term else stopping.NONE
        return Sums(loss_sum, count, samples, code, *own)


def start(loss_sum: Any, count: int, samples: int, stop_code: int | None, device: Any, *,
          step: int, epoch: int, lr: float, elapsed_s: float, log: bool, own_s: float = 0.0,
          slow: bool = False, rank: int = 0) -> Reduction:
    """Launch the sum of this rank's window and stop code over all ranks (every rank calls
    it at the same step). ``loss_sum``: a float, or a float64 tensor on ``device``.
    ``own_s``, ``slow``: this rank's own time in the window and whether it was behind
    (trainer/throughput.py); ``rank`` names it in the sums when it was."""
    # deferred: torch
    import torch
    import torch.distributed as dist

    rest = [float(count), float(samples), float(stop_code == stopping.TERM),
            float(stop_code == stopping.REQUEUE), float(own_s), float(slow),
            float(rank) * slow, float(own_s) * slow]
    cuda = device.type == "cuda"
    if isinstance(loss_sum, torch.Tensor):
        tail = torch.tensor(rest, dtype=torch.float64).pin_memory()
        values = torch.cat([loss_sum.reshape(1).double(),
                            tail.to(device, non_blocking=True)])
    elif cuda:  # a pageable copy would wait for the GPU's queue
        values = torch.tensor([float(loss_sum), *rest], dtype=torch.float64).pin_memory()
        values = values.to(device, non_blocking=True)
    else:
        values = torch.tensor([float(loss_sum), *rest], dtype=torch.float64, device=device)
    work = dist.all_reduce(values, async_op=True)
    ready = None
    if cuda:
        work.wait()  # NCCL: the current stream waits for the all-reduce; the host does not
        host = torch.empty(len(rest) + 1, dtype=torch.float64, pin_memory=True)
        host.copy_(values, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        values = host
    return Reduction(step, epoch, lr, elapsed_s, log, stop_code is not None, work, values,
                     ready)


class Periodic:
    """A loop's periodic collective: at most one launched, read at a later call, and the
    stop the ranks agreed on so far (the strongest request wins). The built-in trainer and a
    user's loop (the Context's should_stop) keep theirs in one of these."""

    def __init__(self) -> None:
        self.pending: Reduction | None = None
        self.agreed = stopping.NONE

    def launch(self, reduction: Reduction) -> None:
        self.pending = reduction

    def read(self) -> tuple[Reduction, Sums] | None:
        """The launched reduction and its sums (waiting if needed), or None if none is
        launched; an agreed stop is kept in ``agreed``."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        sums = pending.result()
        if sums.stop_code is not None:
            self.agreed = max(self.agreed, sums.stop_code)
        return pending, sums

    def drop(self) -> None:
        """Forget the launched one unread (a failed peer may never join it)."""
        self.pending = None


def agree_to_stop(stop_code: int, device: Any, step: int) -> Reduction:
    """Launch the stop agreement alone (a loop that has no log window to sum: a user's,
    through the Context); read its ``result().stop_code`` a call later."""
    return start(0.0, 0, 0, stop_code, device, step=step, epoch=0, lr=0.0, elapsed_s=0.0,
                 log=False)
