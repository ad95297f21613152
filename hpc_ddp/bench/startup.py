"""Submit to first step on Slurm: ``python -m hpc_ddp.submit`` against a bare ``srun``.

Both start the same number of ranks on the same nodes and train one tiny-CNN step:
``hpc_ddp.submit ... trainer.max_steps=1 wait=true`` (sbatch through submitit, the rank
setup, the trainer) and ``srun ... python -m hpc_ddp.bench.baseline --steps 1`` (the
hand-written loop, started as one job step). Each figure is wall-clock seconds from the
command's start to the end of the first optimizer step (rank 0's clock; the test cluster's
nodes share this machine's clock, a real cluster's are NTP-synchronised).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp.config.schema import Config
from hpc_ddp.rundir import read_json


def srun_command(cfg: Config, python: str) -> list[str]:
    """The bare srun a user would type for the same ranks (pure)."""
    c = cfg.cluster
    cmd = ["srun", f"--nodes={cfg.nodes}", f"--ntasks-per-node={c.tasks_per_node or 1}",
           f"--cpus-per-task={c.cpus_per_task}", f"--time={c.time_min}",
           f"--job-name={c.job_name}_bare"]
    for flag, value in (("partition", c.partition), ("account", c.account), ("qos", c.qos),
                        ("constraint", c.constraint), ("nodelist", c.nodelist),
                        ("exclude", c.exclude)):
        if value:
            cmd.append(f"--{flag}={value}")
    if c.gpus_per_node:
        cmd.append(f"--gpus-per-node={c.gpus_per_node}")
    return [*cmd, python, "-m", "hpc_ddp.bench.baseline", "--model", "tiny_cnn",
            "--steps", "1", "--warmup", "1", "--json"]


def measure_startup(cfg: Config, user: Sequence[str], root: Path, out: TextIO,
                    timeout_s: float = 900) -> dict[str, Any]:
    """Both figures, or the reason they were not taken (``line`` says it in one line)."""
    print(f"startup: timing submit-to-first-step on {cfg.nodes} node(s), hpc_ddp then a bare "
          "srun ...", file=out, flush=True)
    if cfg.cluster.kind != "slurm":
        return {"skipped": "needs Slurm (cluster=slurm, or a controller cluster=auto finds)",
                "line": "startup: skipped (needs Slurm)"}
    python = cfg.cluster.python or sys.executable
    run_dir = root / "startup-hpc_ddp"
    started = time.time()
    done = subprocess.run([python, "-m", "hpc_ddp.submit", *user, "model=tiny_cnn",
                           "trainer.max_steps=1", "wait=true", f"run_dir={run_dir}"],
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    progress = read_json(run_dir / "progress.json")
    ours = progress["time"] - started if done.returncode == 0 and progress else None
    started = time.time()
    bare = subprocess.run(srun_command(cfg, python), capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    first = _first_step_time(bare.stdout)
    theirs = first - started if bare.returncode == 0 and first else None
    result: dict[str, Any] = {"hpc_ddp_s": ours, "bare_srun_s": theirs,
                              "nodes": cfg.nodes, "tasks_per_node": cfg.cluster.tasks_per_node}
    if ours is None or theirs is None:
        why = done.stderr[-300:] if ours is None else bare.stderr[-300:]
        result["error"] = why
        result["line"] = f"startup: not measured ({why.strip().splitlines()[-1:] or why})"
    else:
        result["ratio"] = ours / theirs
        result["line"] = (f"submit to first step on {cfg.nodes} nodes: hpc_ddp {ours:.1f} s, "
                          f"bare srun {theirs:.1f} s ({ours / theirs:.2f}x)")
    return result


def _first_step_time(stdout: str) -> float | None:
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                return float(json.loads(line)["first_step_time"])
            except (ValueError, KeyError, TypeError):
                continue
    return None
