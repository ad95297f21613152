"""DDP's gradient sync settings (trainer.ddp_*, with trainer.grad_accum) and the combinations
refused before anything is submitted: each would fail, or silently train wrong, on every rank
after the job waited in the queue.

docs/performance.md#gradient-compression-ddp-communication-hooks says what each hook does
and costs; the hooks themselves are torch's (rank/services/comm_hooks.py).
"""

from __future__ import annotations

from hpc_ddp.config.schema import Config
from hpc_ddp.errors import UserError, shown

# none: DDP's own all-reduce; fp16/bf16: torch's default_hooks.*_compress_hook; powersgd:
# torch's powerSGD_hook (https://pytorch.org/docs/stable/ddp_comm_hooks.html).
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
# torch's PowerSGDState refuses start_powerSGD_iter <= 1 with error feedback or warm start
# (both on here): DDP rebuilds its buckets after the first iteration, which a tensor
# memorised before the rebuild would not fit (torch/distributed/algorithms/ddp_comm_hooks/
# powerSGD_hook.py).
MIN_POWERSGD_WARMUP = 2


def validate_sync(cfg: Config) -> None:
    """UserError for a DDP sync setting out of range, an unknown hook, or a hook with a
    setting it cannot work with."""
    t = cfg.trainer
    if t.ddp_bucket_cap_mb is not None and t.ddp_bucket_cap_mb < 1:
        raise UserError("trainer.ddp_bucket_cap_mb", t.ddp_bucket_cap_mb, "must be >= 1.",
                        "give MiB per bucket, e.g. 25, or null for DDP's default.")
    if t.ddp_static_graph and t.grad_accum > 1:
        # DDP's reducer asserts when the first backward of a static graph runs in no_sync()
        # (torch 2.14), and a run with accumulation starts (and resumes) there.
        raise UserError("trainer.ddp_static_graph", shown(t.ddp_static_graph),
                        "does not work with gradient accumulation (no_sync).",
                        "set trainer.ddp_static_graph=false or trainer.grad_accum=1.")
    if t.ddp_comm_hook not in COMM_HOOKS:
        raise UserError("trainer.ddp_comm_hook", t.ddp_comm_hook, "is not a communication "
                        "hook.", f"use one of {', '.join(COMM_HOOKS)}.")
    if t.ddp_powersgd_rank < 1:
        raise UserError("trainer.ddp_powersgd_rank", t.ddp_powersgd_rank, "must be >= 1 (the "
                        "rank of PowerSGD's low-rank approximation).",
                        "start from trainer.ddp_powersgd_rank=1 and double it if the loss "
                        "suffers.")
    if t.ddp_powersgd_warmup_steps < MIN_POWERSGD_WARMUP:
        raise UserError("trainer.ddp_powersgd_warmup_steps", t.ddp_powersgd_warmup_steps,
                        f"must be >= {MIN_POWERSGD_WARMUP}: torch's PowerSGD compresses only "
                        "after DDP has rebuilt its buckets.",
                        "give the optimizer steps to all-reduce plainly first, e.g. 10% of "
                        "the run.")
    if t.ddp_comm_hook == "none":
        return
    own_loop = cfg.entry is not None or cfg.script is not None  # it picks DDP or ctx.shard
    if t.strategy == "fsdp" and not own_loop:
        raise UserError("trainer.ddp_comm_hook", t.ddp_comm_hook, "is a DDP communication "
                        "hook; under trainer.strategy=fsdp FSDP reduces the gradients itself.",
                        "set trainer.ddp_comm_hook=none, or trainer.strategy=ddp.")
    if t.ddp_comm_hook == "powersgd" and t.precision == "fp16":
        # A step the fp16 loss scaler skips has inf gradients; PowerSGD's error feedback
        # (input minus its approximation) keeps inf - inf = NaN and adds it to every later
        # step, so the scaler skips them all.
        raise UserError("trainer.ddp_comm_hook", "powersgd", "does not work with "
                        "trainer.precision=fp16: the loss scaler's overflowed steps leave NaN "
                        "in PowerSGD's error feedback for good.",
                        "use trainer.precision=bf16 or fp32 with PowerSGD, or "
                        "trainer.ddp_comm_hook=fp16 with fp16.")
