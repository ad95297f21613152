"""Preflight doctor: a short job on the requested nodes that names the bad ones.

    python -m hpc_ddp.doctor cluster=slurm nodes=4 cluster.partition=gpu  # as for submit
    python -m hpc_ddp.doctor nodes=2 --size-mib 8 --min-busbw 10

Every rank reports its host, Python/torch/CUDA/NCCL/cuDNN versions, how its installed
packages drift from the pins of environment.yml, GPUs, IB ports and states, GPUDirect peer
memory and effective NCCL environment; rank 0 gathers them, compares
them across nodes, checks one task per GPU, times an all-reduce, writes ``doctor.json`` into
the run dir, and the command prints a per-node table and a verdict. Exit codes: 0 healthy,
1 problems found (with the ``cluster.exclude=...`` that avoids the bad nodes), 2 bad input.
See docs/nccl.md.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp.config.nccl_schema import nccl_warnings
from hpc_ddp.config.schema import Config
from hpc_ddp.doctor.probe import REPORT, DoctorOptions
from hpc_ddp.doctor.probe import run as probe
from hpc_ddp.rank.join.envcheck import read_pins
from hpc_ddp.rundir import RunDir, read_json

__all__ = ["DoctorOptions", "preflight", "run_doctor"]


def run_doctor(cfg: Config, run: RunDir, options: DoctorOptions | None = None,
               out: TextIO = sys.stdout, timeout_s: float | None = None) -> dict[str, Any]:
    """Submit the doctor with ``cfg`` (resolved) into ``run``, wait, print the table and the
    verdict; returns the report (``ok``, ``bad_nodes``, ``problems``, ...)."""
    # deferred (start-up): config.compose, doctor.job, doctor.render, rank.main.task
    from hpc_ddp.config.compose import to_yaml
    from hpc_ddp.doctor import job, render
    from hpc_ddp.rank.main.task import RankProgram

    options = options or DoctorOptions()
    if not options.pins:
        options = dataclasses.replace(options, pins=reference_pins())
    # Differences between the nodes' software are the doctor's to report, not to stop at.
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster,
                                                               allow_mixed_env=True))
    for warning in nccl_warnings(cfg.nccl):
        print(f"warning: {warning}", file=out)
    task = RankProgram(probe, to_yaml(cfg), str(run.root), options)
    job.submit_and_wait(cfg, run, task, out, timeout_s)
    report = read_json(run.root / REPORT)
    if report is None:
        errors = job.rank_errors(run)
        bad = job.culprit_hosts(errors)
        print(render.failure_summary(bad, [f"rank {r} on {h}: {m}" for r, h, m, _ in errors],
                                     cfg.cluster.exclude), file=out, flush=True)
        return {"ok": False, "bad_nodes": bad, "problems": [], "errors": errors}
    print(render.summary(report), file=out)
    print(f"report: {run.root / REPORT}", file=out, flush=True)
    return dict(report)


def reference_pins() -> tuple[tuple[str, str], ...]:
    """What environment.yml (beside the hpc_ddp checkout) pins; () when there is none."""

    path = Path(__file__).resolve().parents[2] / "environment.yml"
    try:
        return tuple(sorted(read_pins(path).items()))
    except (OSError, ValueError, AttributeError):
        return ()


def preflight(cfg: Config, run_dir: Path | str | RunDir, out: TextIO = sys.stdout,
              options: DoctorOptions | None = None) -> bool:
    """Run the doctor before a training job; True when every node is healthy.

    ``cfg``: the training run's resolved config (same nodes, partition, GPUs, NCCL profile);
    ``run_dir``: the training run dir. The doctor runs as its own short job and keeps its
    files in ``<run_dir>/preflight/<date>_<time>/`` (a resumed run gets a new one each time).
    """
    # deferred (start-up): doctor.job, inputs.run_dir
    from hpc_ddp.doctor.job import stamp
    from hpc_ddp.inputs.run_dir import check_run_dir

    root = run_dir.root if isinstance(run_dir, RunDir) else Path(run_dir)
    folder = root.absolute() / "preflight" / stamp()
    doctor_cfg = dataclasses.replace(
        cfg, run_dir=str(folder), resume=False, dry_run=False,
        # A short job: its warning signal must still come before its own time limit.
        cluster=dataclasses.replace(cfg.cluster, time_min=min(cfg.cluster.time_min, 10),
                                    signal_delay_s=min(cfg.cluster.signal_delay_s, 120),
                                    job_name=f"{cfg.cluster.job_name}_preflight"))
    run = check_run_dir(doctor_cfg)
    run.root.mkdir(parents=True, exist_ok=True)
    return bool(run_doctor(doctor_cfg, run, options, out)["ok"])
