"""Evaluation over the whole eval set: the loss and the metrics, summed over ranks at once.

Each rank runs its shard (disjoint, unpadded: every sample counts once), sums loss x batch
size and metric x batch size, and the ranks add their sums in one all-reduce. The metric
names are fixed at the first evaluation from rank 0's (one broadcast), so every rank sends
the same vector even where a shard gives a metric nothing to say.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpc_ddp.trainer.augment import Stats, prepare_inputs
from hpc_ddp.trainer.objectives import Metrics, batch_size, to_device


def input_and_target(batch: Any) -> tuple[Any, Any]:
    """(inputs, targets) of a batch; the built-in trainer needs pairs."""
    if isinstance(batch, list | tuple) and len(batch) == 2:
        return batch[0], batch[1]
    shape = (f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, list | tuple)
             else f"a {type(batch).__name__}")
    raise TypeError(f"the built-in trainer needs (input, target) batches and the data gave "
                    f"{shape}: return (input, target) from __getitem__ (and a collate_fn that "
                    "keeps the pair), or train with your own loop (entry=..., "
                    "docs/your-code.md)")


class Evaluator:
    def __init__(self, metrics: Metrics | None, criterion: Callable[[Any, Any], Any],
                 device: Any) -> None:
        self.metrics = metrics
        self.criterion = criterion
        self.device = device
        self.names: list[str] | None = None

    def run(self, forward: Callable[[Any], Any], loader: Any, stats: Stats | None,
            channels_last: bool, autocast_dtype: Any, lockstep: bool = False,
            alive: Callable[[], None] = lambda: None) -> dict[str, float]:
        """{"loss": mean, <metric>: mean, ...} over every rank's shard. ``lockstep``: a
        forward is a collective (a sharded model gathers its parameters), so every rank runs
        as many as the rank with the most batches, the extra ones uncounted. ``alive`` is
        called per batch (a long evaluation is not a hang: Context.alive)."""
        # deferred: torch
        import torch
        import torch.distributed as dist

        sums: dict[str, Any] = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        extra = _missing_batches(loader) if lockstep else 0
        last = None
        with torch.no_grad(), torch.autocast(self.device.type, dtype=autocast_dtype,
                                             enabled=autocast_dtype is not None):
            for batch in loader:
                alive()
                inputs, targets = input_and_target(batch)
                inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
                last = prepare_inputs(inputs, stats, channels_last)
                outputs = forward(last)
                n = batch_size(targets)
                outputs = outputs.float() if isinstance(outputs, torch.Tensor) else outputs
                loss_sum += self.criterion(outputs, targets).double() * n
                count += n
                for name, value in (self.metrics(outputs, targets) if self.metrics else {}).items():
                    term = torch.as_tensor(value, dtype=torch.float64, device=self.device) * n
                    sums[name] = sums[name] + term if name in sums else term
            for _ in range(extra):
                if last is None:
                    raise RuntimeError("a sharded model's evaluation needs an eval batch on "
                                       "every rank: give data an eval set of at least one "
                                       "sample per rank")
                forward(last)
        if self.names is None:
            shared: list[Any] = [sorted(sums)]
            dist.broadcast_object_list(shared, src=0)
            self.names = list(shared[0])
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        totals = torch.stack([loss_sum, torch.tensor(float(count), dtype=torch.float64,
                                                     device=self.device),
                              *[sums.get(name, zero) for name in self.names]])
        dist.all_reduce(totals)
        values = totals.tolist()
        seen = max(values[1], 1.0)
        return {"loss": values[0] / seen,
                **{name: v / seen for name, v in zip(self.names, values[2:], strict=True)}}


def _missing_batches(loader: Any) -> int:
    """How many batches fewer this rank's eval shard has than the largest (one all-reduce)."""
    # deferred: torch
    import torch
    import torch.distributed as dist

    mine = len(loader)
    most = torch.tensor([mine], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        most = most.cuda()
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item()) - mine
