"""Run the job on this machine through submitit's local executor.

submitit's local executor supports a single node; ``nodes`` > 1 is simulated by running all
the nodes' ranks here (node rank = rank // tasks_per_node), which exercises the same
multi-node code paths with gloo on loopback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpc_ddp.config.compose import to_yaml
from hpc_ddp.config.schema import Config
from hpc_ddp.rundir import RunDir
from hpc_ddp.task import TrainingTask


def executor_parameters(cfg: Config) -> dict[str, Any]:
    """submitit LocalExecutor parameters for ``cfg`` (pure)."""
    tasks = cfg.nodes * (cfg.cluster.tasks_per_node or 1)
    params: dict[str, Any] = {"tasks_per_node": tasks, "timeout_min": cfg.cluster.time_min,
                              "signal_delay_s": cfg.cluster.signal_delay_s}
    if cfg.cluster.gpus_per_node:
        params["gpus_per_node"] = cfg.cluster.gpus_per_node * cfg.nodes
    return params


def submit(cfg: Config, run: RunDir, task: Callable[[], Any] | None = None) -> Any:
    """Start ``task`` (default: training) on every rank; returns submitit's LocalJob."""
    import submitit

    executor = submitit.LocalExecutor(folder=str(run.submitit))
    executor.update_parameters(**executor_parameters(cfg))
    return executor.submit(task or TrainingTask(to_yaml(cfg), str(run.root)))


def describe(cfg: Config) -> str:
    tasks = cfg.cluster.tasks_per_node or 1
    if cfg.nodes > 1:
        return (f"{cfg.nodes * tasks} ranks on this machine, simulating {cfg.nodes} nodes x "
                f"{tasks} tasks (submitit's local executor runs one node)")
    return f"{tasks} rank{'s' if tasks > 1 else ''} on this machine"


def dry_run(cfg: Config, run: RunDir) -> str:
    params = ", ".join(f"{k}={v}" for k, v in executor_parameters(cfg).items())
    return (f"would run {describe(cfg)} with submitit.LocalExecutor({params}) into {run.root}; "
            "nothing was started.")
