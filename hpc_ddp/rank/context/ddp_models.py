"""A Context's DDP models (docs/your-code.md#gradient-sync-and-compression): your model in
DistributedDataParallel with the run's sync settings and communication hook, the hook's state
kept in this rank's checkpoint file (rank/services/comm_hooks.py does the work; this is the
part of the Context a user's loop calls, and the built-in trainer's too)."""

from __future__ import annotations

from typing import Any

from hpc_ddp.config.schema import Config
from hpc_ddp.rank.services import comm_hooks
from hpc_ddp.rank.services.loop_checkpoints import LoopCheckpoints

# The name a hook's state has in a rank's file (a second DDP model's: comm_hook.1, ...).
STATE_NAME = "comm_hook"


class DdpModels:
    """Mixed into rank/context/context.py's Context: needs its ``cfg``, ``device`` and
    ``checkpoints``."""

    cfg: Config
    device: Any
    checkpoints: LoopCheckpoints

    def ddp(self, model: Any, **options: Any) -> Any:
        """``model`` on this rank's device in DistributedDataParallel with the run's sync
        settings (trainer.ddp_bucket_cap_mb, ddp_gradient_as_bucket_view, ddp_static_graph)
        and its communication hook (trainer.ddp_comm_hook, :meth:`register_comm_hook`).
        ``options`` go to DDP and win over the config (e.g. find_unused_parameters=True).
        A collective: every rank calls it with the same model. Build the optimizer from the
        returned model's parameters."""
        from torch.nn.parallel import DistributedDataParallel as DDP  # deferred: torch

        t = self.cfg.trainer
        given = {"device_ids": [self.device.index] if self.device.type == "cuda" else None,
                 "bucket_cap_mb": t.ddp_bucket_cap_mb,
                 "gradient_as_bucket_view": t.ddp_gradient_as_bucket_view,
                 "static_graph": t.ddp_static_graph, **options}
        ddp_model = DDP(model.to(self.device), **given)
        self.register_comm_hook(ddp_model)
        return ddp_model

    def register_comm_hook(self, ddp_model: Any) -> comm_hooks.CommHook | None:
        """trainer.ddp_comm_hook on a DDP model you built yourself (:meth:`ddp` does it for
        you): torch's fp16/bf16 compression or PowerSGD. PowerSGD's state (its error
        feedback, this rank's own, and its warm-up counter) is then saved by ``ctx.save`` in
        this rank's file and put back by ``ctx.load``, so a resumed run stays bitwise equal
        to an uninterrupted one (call :meth:`settle_buckets` before the loop). Returns the
        hook (``syncs``: the synced backward passes so far), None for ``none``."""
        hook = comm_hooks.register(ddp_model, self.cfg.trainer)
        if hook is not None and hook.state is not None:
            taken = sum(1 for name in self.checkpoints.kept if name.startswith(STATE_NAME))
            self.checkpoints.keep(STATE_NAME if not taken else f"{STATE_NAME}.{taken}", hook)
        return hook
