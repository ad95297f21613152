"""The keys of sharded training and checkpoints (trainer.strategy, trainer.checkpoint_format)
and the combinations the built-in trainer refuses before anything is submitted.

docs/your-code.md#models-larger-than-one-gpu says what each does; these are the ones that
would fail (or silently mislead) on every rank after the job waited in the queue.
"""

from __future__ import annotations

from hpc_ddp.config.schema import Config
from hpc_ddp.errors import UserError, shown

STRATEGIES = ("ddp", "fsdp")
CHECKPOINT_FORMATS = ("auto", "full", "dcp")


def validate_sharding(cfg: Config) -> None:
    """UserError for a strategy or checkpoint format that is unknown, or a setting the
    built-in trainer cannot combine with FSDP (a function entry or a script shards its own
    model with ctx.shard and is not held to these)."""
    t = cfg.trainer
    for key, value, allowed in (("trainer.strategy", t.strategy, STRATEGIES),
                                ("trainer.checkpoint_format", t.checkpoint_format,
                                 CHECKPOINT_FORMATS)):
        if value not in allowed:
            raise UserError(key, value, "unknown value.", f"use one of {', '.join(allowed)}.")
    if t.strategy != "fsdp" or cfg.entry is not None or cfg.script is not None:
        return
    if t.channels_last:
        raise UserError("trainer.channels_last", shown(t.channels_last), "is not supported "
                        "with trainer.strategy=fsdp.", "leave trainer.channels_last unset "
                        "(auto: off under fsdp).")
