"""A Context's sharded models (docs/your-code.md#models-larger-than-one-gpu): FSDP2 over every
rank, and the model's and optimizer's state as a checkpoint holds it (rank/services/
sharding.py does the work; this is the part of the Context a user's loop calls)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpc_ddp.config.schema import Config
from hpc_ddp.errors import UserError


class ShardedModels:
    """Mixed into rank/context/context.py's Context: needs its ``cfg`` and ``device``."""

    cfg: Config
    device: Any

    def shard(self, model: Any, *, precision: str | None = None,
              reshard_after_forward: bool | None = None,
              activation_checkpointing: bool | None = None) -> Any:
        """``model`` on this rank's device, sharded over every rank with FSDP2 (fully_shard
        per block and on the root: rank/services/sharding.py). A collective: every rank calls
        it with the same model. Unset options come from trainer.precision (auto resolved for
        the device), trainer.reshard_after_forward, trainer.activation_checkpointing. Build
        the optimizer from the returned model's parameters."""
        # deferred: torch (sharding, precision)
        from hpc_ddp.rank.services import sharding
        from hpc_ddp.rank.services.precision import resolve_precision

        t = self.cfg.trainer
        if t.ddp_comm_hook != "none":  # it would silently not apply
            raise UserError("trainer.ddp_comm_hook", t.ddp_comm_hook, "is a DDP communication "
                            "hook; ctx.shard's FSDP reduces the gradients itself.",
                            "set trainer.ddp_comm_hook=none for a sharded model, or wrap it "
                            "with ctx.ddp(model).")
        return sharding.shard(
            model, self.device, resolve_precision(precision or t.precision, self.device),
            t.reshard_after_forward if reshard_after_forward is None else reshard_after_forward,
            t.activation_checkpointing if activation_checkpointing is None
            else activation_checkpointing)

    def state_dict(self, model: Any, optimizer: Any = None) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}`` to put in the state you save: for a sharded
        model its DTensors (this rank's shard), the optimizer's state by parameter name, so
        any world size reads it back (torch.distributed.checkpoint.state_dict)."""
        from hpc_ddp.rank.services import sharding  # deferred: torch (sharding)

        return sharding.state_dict(model, optimizer)

    def load_state_dict(self, model: Any, optimizer: Any, state: Mapping[str, Any]) -> None:
        """Hand :meth:`state_dict`'s part of a loaded ``state`` back to the model and
        optimizer (``optimizer`` may be None)."""
        from hpc_ddp.rank.services import sharding  # deferred: torch (sharding)

        sharding.load_state_dict(model, optimizer, dict(state))
