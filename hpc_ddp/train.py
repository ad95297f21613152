"""The per-task entry: ``srun python -m hpc_ddp.train [key=value ...]`` (see jobs/train.sbatch).

Every task composes the same config from the same overrides, derives its rank from Slurm
(or torchrun), and runs the same code a ``python -m hpc_ddp.submit`` job runs. Without
run_dir, the run goes to outputs/job-<SLURM_JOB_ID> under the submission folder, the same for
every task; a requeued job finds its checkpoints there and resumes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from hpc_ddp.errors import USAGE_EXIT_CODE, UserError


def main(argv: Sequence[str] | None = None) -> int:
    from hpc_ddp.config.compose import compose
    from hpc_ddp.distenv import LaunchError, detect
    from hpc_ddp.launch.resolve import check_inputs, write_run_config
    from hpc_ddp.rundir import RunDir, default_root
    from hpc_ddp.task import resume_cause, run

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    try:
        cfg = compose(args)
        env = detect(os.environ, cfg.cluster.tasks_per_node)
        job = os.environ.get("SLURM_JOB_ID")
        root = Path(cfg.run_dir) if cfg.run_dir else default_root(Path.cwd() / "outputs",
                                                                   job_id=job or "local")
        run_dir = RunDir(root.absolute())
        check_inputs(cfg)
        if env.is_master and resume_cause(cfg, run_dir, env) is None:
            # A fresh run: record its config and overrides (submit resume=true can go on
            # from them). A resumed or requeued run keeps what it was started with.
            write_run_config(run_dir, cfg, args)
        summary = run(cfg, run_dir, os.environ)
    except (UserError, LaunchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE_EXIT_CODE
    if summary is not None:
        print(f"hpc_ddp: done, step {summary['global_step']}, eval accuracy "
              f"{summary['eval_accuracy']:.4f}, run dir {run_dir.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
