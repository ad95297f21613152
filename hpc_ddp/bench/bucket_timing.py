"""How long a step's gradient all-reduce keeps the fabric busy, from inside DDP: a
communication hook that runs the plain all-reduce DDP would run (torch's
``default_hooks.allreduce_hook``) and marks each bucket's start (the hook is called: its
gradients are ready) and completion (the all-reduce's future is done: ``Future.then``).

The scaling report (scaling_rank.py) registers it on a Trainer of its own before the first
backward (DDP takes one hook per model), runs a few steps, and gathers every rank's marks,
each counted from a barrier's exit (scaling_report.achieved): a bucket's all-reduce runs from
the last rank's start to the last rank's completion (a rank that starts early waits for the
others; one that starts last finds their data already sent), and a step's all-reduce time is
the union of its buckets' (scaling_report.busy_s): the achieved bandwidth is the step's
bucket bytes over that time, with nccl-tests' bus factor (comm.bus_factor). The ranks' zero
differs by the barrier's exit skew (microseconds on one host, tens on a fabric).

On CPU the marks are ``perf_counter`` readings (Gloo completes the future on its own thread
when the reduction ends). On CUDA they are CUDA events: the start recorded on the stream that
computed the gradients, the completion on the stream torch runs the future's callback on,
which waits for the all-reduce's kernels (torch.futures.Future.then), so both are device
time; read once the probe's steps are over and the device synchronised.
"""

from __future__ import annotations

from typing import Any

from hpc_ddp.trainer.loop_timing import mark


class BucketTimes:
    """A DDP communication hook's state: every bucket's (step, start, end, bytes) while on."""

    def __init__(self, group: Any, cuda: bool) -> None:
        # deferred: torch (its DDP hooks)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.group, self.cuda = group, cuda
        self._allreduce = default_hooks.allreduce_hook
        self.on = False
        self.step = 0  # synced backward passes seen while on
        # [step, bucket index, start, end (None until done), bytes]
        self.marks: list[list[Any]] = []
        self.reference: Any = None  # the zero of the marks (an event on CUDA)

    def start(self) -> None:
        """Begin recording (between steps, right after a barrier: every rank's marks count
        from about the same moment)."""
        self.marks.clear()
        self.step = 0
        self.reference = mark(self.cuda)
        self.on = True

    def hook(self, bucket: Any) -> Any:
        fut = self._allreduce(self.group, bucket)
        if not self.on:
            return fut
        buffer = bucket.buffer()
        entry = [self.step, bucket.index(), mark(self.cuda), None,
                 buffer.numel() * buffer.element_size()]
        self.marks.append(entry)
        if bucket.is_last():
            self.step += 1

        def done(f: Any) -> Any:
            entry[3] = mark(self.cuda)
            return f.value()

        return fut.then(done)

    def stop(self) -> list[tuple[int, int, float, float, int]]:
        """Stop recording; (step, bucket index, start s, end s, bytes) of every bucket, in
        seconds from :meth:`start` (synchronises the device on CUDA)."""
        self.on = False
        if self.cuda:
            import torch  # deferred: torch

            torch.cuda.synchronize()
        return [(step, index, self._seconds(a), self._seconds(b), nbytes)
                for step, index, a, b, nbytes in self.marks if b is not None]

    def _seconds(self, m: Any) -> float:
        if self.cuda:
            return float(self.reference.elapsed_time(m)) / 1e3
        return float(m - self.reference)


def timed_reduce(state, bucket):
    """What DDP calls with each bucket (``state``: a BucketTimes). Unannotated: DDP reads the
    signature and accepts only dist.GradBucket and Future[Tensor] there, which this module's
    postponed annotations would give it as strings (DistributedDataParallel._check_comm_hook)."""
    return state.hook(bucket)
