"""The scaling report: your training on 1, 2, ... N nodes of one job, what limits it, and
which sync setting would help (docs/performance.md#the-scaling-report).

    python -m hpc_ddp.bench scaling cluster=slurm nodes=4 model=resnet18   # your overrides
    python -m hpc_ddp.bench scaling cluster=slurm nodes=4 --nodes-list 1,2,3,4 --steps 60
    python -m hpc_ddp.bench scaling cluster=local nodes=2 cluster.tasks_per_node=1  # 2 simulated

One job of the config's nodes (your model, data and per-rank batch; checkpoints and
evaluation off). For each node count k (default 1, 2, 4, ... doubling, then N) the ranks of
the first k nodes form a process group of their own and train: warm-up steps, then --steps
timed steps in --windows windows, each step split into data wait, compute, exposed gradient
sync, optimizer and the rest (hpc_ddp/trainer/loop_timing.py, as ``bench train`` and a run's
summary split it). On more than one node it also measures the all-reduce bandwidth the steps
achieved (DDP's buckets timed by a communication hook) against the bare all-reduce at DDP's
bucket size (``bench comm``'s measurement). Then a verdict: scales well, a straggler (which
node, how much slower), the loader, the fabric, or the phase that grew most. When it is the
fabric (--fixes auto), each fix runs at the largest node count for the same steps: bf16 /
fp16 compression, PowerSGD, 4x the bucket size, twice the accumulation; the fastest whose
loss stays within the tolerance gives the override line to use. A line is printed as each
stage starts. Writes bench/scaling.json and bench/scaling.png into the run dir.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn, TextIO

from hpc_ddp.bench.scaling_plan import (
    FIX_CHOICES,
    PLOT,
    RESULT,
    ScalingOptions,
    default_sizes,
    parse_sizes,
    said,
)
from hpc_ddp.bench.train import BENCH_OVERRIDES
from hpc_ddp.config.given import text
from hpc_ddp.config.schema import Config
from hpc_ddp.doctor import job
from hpc_ddp.doctor.job import add_job_arguments, check_timeout
from hpc_ddp.errors import USAGE_EXIT_CODE, UserError
from hpc_ddp.rundir import read_json, write_json

NAME = "bench-scaling"
# The job needs every one of its nodes: one that may start smaller (cluster.min_nodes) would
# measure fewer than asked.
JOB_OVERRIDES = ("cluster.min_nodes=null",)


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (an unknown option, a word for a number) in one line, exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (python -m hpc_ddp.bench scaling --help lists the options)",
              file=sys.stderr)
        sys.exit(USAGE_EXIT_CODE)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m hpc_ddp.bench scaling", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes-list", default="", metavar="K,K,...",
                   help="node counts to measure, from 1 to nodes= (default 1, 2, 4, ... "
                   "doubling, then nodes=)")
    p.add_argument("--steps", type=int, default=ScalingOptions.steps,
                   help=f"timed steps per node count and per fix (default {ScalingOptions.steps})")
    p.add_argument("--windows", type=int, default=ScalingOptions.windows,
                   help=f"windows the timed steps are split into, for the medians "
                   f"(default {ScalingOptions.windows})")
    p.add_argument("--warmup-steps", type=int, default=ScalingOptions.warmup_steps,
                   help=f"untimed steps first (default {ScalingOptions.warmup_steps})")
    p.add_argument("--probe-steps", type=int, default=ScalingOptions.probe_steps,
                   help="steps of the all-reduce probe per node count above 1 (default "
                   f"{ScalingOptions.probe_steps})")
    p.add_argument("--fixes", default="auto", metavar="|".join(FIX_CHOICES),
                   help="auto: run the fixes when the verdict is the fabric; all: always; "
                   "none: never (default auto)")
    add_job_arguments(p, plot=str(PLOT))
    return p


def check_config(cfg: Config) -> None:
    """UserError for a config the report cannot compare over node counts."""
    if cfg.nodes < 2:
        raise UserError("nodes", cfg.nodes, "is one node: the scaling report compares 1 to N "
                        "nodes of one job, and has nothing to compare.",
                        "give the nodes to measure, e.g. nodes=4 cluster=slurm (on this "
                        "machine, cluster=local nodes=2 cluster.tasks_per_node=1 simulates 2).")
    if cfg.entry is not None or cfg.script is not None:
        key = "entry" if cfg.entry is not None else "script"
        raise UserError(key, cfg.entry or cfg.script, "is your own loop; the scaling report "
                        "runs hpc_ddp's trainer (its steps are timed from outside the loop).",
                        f"run it with the built-in trainer's settings (drop {key}=), or compare "
                        "the sync share of your runs (docs/performance.md#scaling).")
    if cfg.trainer.strategy != "ddp":
        raise UserError("trainer.strategy", cfg.trainer.strategy, "has no DDP all-reduce to "
                        "measure: the report times DDP's gradient sync.",
                        "run the report with trainer.strategy=ddp.")


def options_from(args: argparse.Namespace, nodes: int) -> ScalingOptions:
    sizes = parse_sizes(args.nodes_list, nodes) if args.nodes_list else default_sizes(nodes)
    for flag, value, least in (("--steps", args.steps, 1), ("--windows", args.windows, 1),
                               ("--warmup-steps", args.warmup_steps, 1),
                               ("--probe-steps", args.probe_steps, 1)):
        if value < least:
            raise UserError(flag, value, f"must be {least} or more.",
                            f"e.g. {flag} {getattr(ScalingOptions, flag[2:].replace('-', '_'))}.")
    if args.fixes not in FIX_CHOICES:
        raise UserError("--fixes", args.fixes, "is not a choice.",
                        f"use one of {', '.join(FIX_CHOICES)}.")
    check_timeout(args.timeout_s)
    return ScalingOptions(sizes, args.steps, args.windows, args.warmup_steps,
                          args.probe_steps, fixes=args.fixes)


class Progress:
    """Prints rank 0's progress lines as they appear, with the seconds since the start."""

    def __init__(self, root: Path, out: TextIO) -> None:
        self.root, self.out = root, out
        self.started = time.monotonic()
        self.seen = 0

    def __call__(self) -> None:
        lines = said(self.root)
        for line in lines[self.seen:]:
            print(f"scaling: {line} ({time.monotonic() - self.started:.0f}s in)",
                  file=self.out, flush=True)
        self.seen = max(self.seen, len(lines))


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout) -> int:
    # deferred (start-up): bench.scaling_rank, bench.scaling_report, config.compose, rank.main.task
    from hpc_ddp.bench import scaling_rank
    from hpc_ddp.bench.scaling_report import combine, table
    from hpc_ddp.config.compose import compose, to_yaml
    from hpc_ddp.rank.main.task import RankProgram

    args = parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    user = [o for o in args.overrides if o.partition("=")[0].lstrip("+~") != "run_dir"]
    given = text(args.overrides, "run_dir")
    root = Path(given) if given else job.default_run_dir(Path.cwd(), NAME)
    try:
        base = compose([*BENCH_OVERRIDES, *user])
        check_config(base)
        options = options_from(args, base.nodes)
        cfg, run = job.prepare([*BENCH_OVERRIDES, *user, *JOB_OVERRIDES, f"run_dir={root}"],
                               NAME, os.environ, Path.cwd())
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    progress = Progress(run.root, out)
    sizes = ", ".join(map(str, options.sizes))
    print(f"scaling: {cfg.model.name}, batch {cfg.trainer.batch_size} per rank, on {sizes} "
          f"node(s); fixes: {options.fixes}", file=out, flush=True)
    job.submit_and_wait(cfg, run, RankProgram(scaling_rank.run, to_yaml(cfg), str(run.root),
                                              options),
                        out, args.timeout_s, on_poll=progress)
    raw = read_json(run.root / RESULT)
    if raw is None:
        return job.did_not_finish(run, out)
    result = combine(raw, user)
    write_json(run.root / RESULT, result)
    print(table(result), file=out)
    if not args.no_plot:
        from hpc_ddp.bench.plot_scaling import plot  # deferred (start-up): bench.plot_scaling

        print(plot(result, run.root / PLOT), file=out)
    print(f"results: {run.root / RESULT}", file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
