"""Whether a run's ranks train under supervisors (rank/supervise/): a rule the submit side
(the batch script's node-loss driver, launch/slurm.py) and every rank (program.wanted) read
the same way. Pure."""

from __future__ import annotations

from hpc_ddp.config.schema import Config


def supervised(cfg: Config) -> bool:
    """A script always runs under its supervisor; the built-in trainer and an entry do when
    cluster.supervise says so, and unset when the ranks may restart in place
    (cluster.restarts_in_place > 0) or use GPUs (NCCL's watchdog aborts their processes)."""
    if cfg.script is not None:
        return True
    if cfg.cluster.supervise is not None:
        return cfg.cluster.supervise
    return cfg.cluster.restarts_in_place > 0 or (
        bool(cfg.cluster.gpus_per_node) and cfg.trainer.device != "cpu")


def warm(cfg: Config) -> str:
    """The ranks' WARM_ENV (rank/contract.py): "1" (each task forked warm), "light" (each
    task is a supervisor, which imports no torch: it starts at once, and its training process
    is forked warm), "0" (cluster.warm_start=false) or "container" (its runtime, not ours,
    starts the interpreter: cold)."""
    if cfg.cluster.container.kind != "none":
        return "container"
    if not cfg.cluster.warm_start:
        return "0"
    # A script's ranks are supervised everywhere; the trainer's and an entry's on Slurm.
    light = cfg.script is not None or (cfg.cluster.kind != "local" and supervised(cfg))
    return "light" if light else "1"
