"""A Context's world-size-invariant data order, for a loop of your own that should survive a
shrink (``cluster.min_nodes``, docs/fault-tolerance.md#shrinking-past-a-lost-node): each
step's samples by the global batch index, not by rank (hpc_ddp/data/global_order.py does the
work; this is the part of the Context a user's loop calls)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpc_ddp.config.schema import Config
from hpc_ddp.data.global_order import GlobalBatches, planned_ranks

if TYPE_CHECKING:
    from hpc_ddp.rank.join.distenv import DistEnv


class GlobalOrder:
    """Mixed into rank/context/context.py's Context: needs its ``cfg`` and ``env``."""

    cfg: Config
    env: DistEnv

    def global_batches(self, dataset: Any, batch_size: int,
                       seed: int | None = None) -> GlobalBatches:
        """A batch sampler of this rank's part of each global micro-batch of ``dataset`` (a
        map-style data set, or its length): ``batch_size`` is the per-rank batch the run was
        planned with, the global batch ``batch_size`` x the planned ranks (``nodes`` x
        ``tasks_per_node`` with cluster.min_nodes set, else this world size). Use it as
        ``DataLoader(dataset, batch_sampler=it)``, call ``it.set_position(epoch,
        batches_done * batch_size)`` before each epoch, and multiply each batch's mean loss
        by ``it.weight`` before ``backward()``: step s then trains on the same samples, with
        the same global batch, on any number of ranks."""
        length = dataset if isinstance(dataset, int) else len(dataset)
        planned = planned_ranks(self.cfg) or self.env.world_size
        return GlobalBatches(length, batch_size, planned, self.env.world_size, self.env.rank,
                             self.cfg.trainer.seed if seed is None else seed)
