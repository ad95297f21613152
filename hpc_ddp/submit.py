"""Submit a DDP training run: ``python -m hpc_ddp.submit [key=value ...]``.

    python -m hpc_ddp.submit                                   # local, 2 ranks, synthetic data
    python -m hpc_ddp.submit cluster=slurm nodes=4 cluster.partition=gpu
    python -m hpc_ddp.submit run_dir=outputs/try1 resume=true trainer.max_steps=500
    python -m hpc_ddp.submit --cfg                              # print the resolved config

Overrides use Hydra's grammar over the groups in conf/ (docs/configuration.md). Bad input
exits with code 2 and one line naming the key, the value and the fix.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from hpc_ddp.errors import USAGE_EXIT_CODE, UserError


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__, file=out)
        return 0
    show_cfg = "--cfg" in args
    overrides = [a for a in args if a != "--cfg"]
    unknown = [a for a in overrides if a.startswith("-")]
    try:
        if unknown:
            raise UserError("option", unknown[0], "is not an option of this command.",
                            "pass key=value overrides; see --help.")
        return _submit(overrides, show_cfg, out)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE


def _submit(overrides: list[str], show_cfg: bool, out: TextIO) -> int:
    from hpc_ddp.config.compose import compose, to_yaml
    from hpc_ddp.launch import resolve as plan

    overrides = plan.merge_resume_overrides(overrides)
    cfg = compose(overrides)
    cfg = plan.resolve(cfg, os.environ, Path.cwd())
    if show_cfg:
        print(to_yaml(cfg), file=out, end="")
        return 0
    plan.check_inputs(cfg)
    run = plan.check_run_dir(cfg)
    if cfg.cluster.kind == "slurm":
        from hpc_ddp.launch import slurm as target
    else:
        from hpc_ddp.launch import local as target  # type: ignore[no-redef]
    if cfg.dry_run:
        print(target.dry_run(cfg, run), file=out)
        return 0
    plan.write_run_config(run, cfg, overrides)
    job = target.submit(cfg, run)
    print(f"hpc_ddp: {cfg.cluster.kind} job {job.job_id}: {target.describe(cfg)}\n"
          f"  run dir:     {run.root}\n"
          f"  rank-0 log:  {run.rank_log(0)}\n"
          f"  tensorboard: tensorboard --logdir {run.tb}", file=out, flush=True)
    hint = target.follow_hint(job) if hasattr(target, "follow_hint") else ""
    if hint:
        print(f"  follow:      {hint}", file=out, flush=True)
    if not cfg.wait:
        return 0
    from hpc_ddp.follow import follow

    if cfg.cluster.kind == "slurm":
        from hpc_ddp.launch.slurm_state import SlurmJobView

        return follow(SlurmJobView(job.job_id), run, out, poll_s=2.0, cancel_on_failure=False)
    return follow(job, run, out)


if __name__ == "__main__":
    sys.exit(main())
