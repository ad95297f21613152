"""Training throughput: hpc_ddp's trainer side by side with a hand-written DDP loop.

    python -m hpc_ddp.bench.train                        # null, tiny_cnn, resnet18; 2 ranks
    python -m hpc_ddp.bench.train --models tiny_cnn --budget-s 120 --rounds 40
    python -m hpc_ddp.bench.train --ablate               # also: tuned minus each default
    python -m hpc_ddp.bench.train --variant "fp32:tuned trainer.precision=fp32"
    python -m hpc_ddp.bench.train --world-sizes 1,2 trainer.batch_size=32
    python -m hpc_ddp.bench.train cluster=slurm nodes=4 --startup   # + submit-to-first-step

In one job per world size, every rank builds, for each model, the hand-written loop
(``hpc_ddp/bench/baseline.py``: DDP + DistributedSampler + default DataLoader, fp32) and
hpc_ddp's Trainer once per setting — ``exact`` (every knob as the baseline has it) and
``tuned`` (the defaults) — on the same model, data, batch and world size. They then run in
rounds of timed windows, the order rotating every round, so a machine's changing load falls
on all of them alike; a figure is the median over rounds, a ratio the median of the per-round
ratios against the baseline's window of the same round. A window's time is its slowest
rank's. Each step is split into data wait, forward+backward, communication wait, optimizer
and the rest (``hpc_ddp/trainer/loop_timing.py``). With the ``null`` model (it does almost nothing)
the difference between ``exact`` and the baseline is the framework's per-step overhead.
Checkpoints and evaluations are off in the timed windows (the baseline has neither).
A line is printed as each model's measurement starts. Writes bench/train.json and
bench/train.png into the run dir.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp.bench.train_plan import (
    EXACT,
    MODELS,
    PLAIN,
    RESULT,
    TrainOptions,
    Variant,
    with_overrides,
)
from hpc_ddp.config.given import text
from hpc_ddp.doctor import job
from hpc_ddp.doctor.job import add_job_arguments, check_timeout
from hpc_ddp.errors import USAGE_EXIT_CODE, UserError
from hpc_ddp.rundir import read_json, write_json

PLOT = Path("bench") / "train.png"
BASELINE = "baseline"
PRESETS: dict[str, tuple[str, ...]] = {"plain": PLAIN, "exact": EXACT, "tuned": ()}
# --ablate: the tuned defaults minus one each (what that default buys, in context).
ABLATIONS = {"tuned-bf16": "trainer.precision=fp32",
             "tuned-channels_last": "trainer.channels_last=false",
             "tuned-fused": "trainer.fused_optimizer=false",
             "tuned-batched": "data.batched=false",
             "tuned-bucket_view": "trainer.ddp_gradient_as_bucket_view=false",
             "tuned+static_graph": "trainer.ddp_static_graph=true"}
# The bench's own settings, before the user's overrides: no checkpoints, no evaluation.
BENCH_OVERRIDES = ("trainer.checkpoint_interval=1000000000",
                   "trainer.eval_interval=1000000000")
CKPT_SYNC, CKPT_BACKGROUND = "ckpt-sync", "ckpt-background"


def variants_from(settings: str, extra: Sequence[str], ablate: bool) -> tuple[Variant, ...]:
    """The variants to run besides the baseline, from --settings, --variant and --ablate."""
    out = []
    for name in (s.strip() for s in settings.split(",") if s.strip()):
        if name not in PRESETS:
            raise UserError("--settings", settings, f"{name!r} is not a preset.",
                            f"use a comma list of {', '.join(PRESETS)}, or --variant.")
        out.append(Variant(name, PRESETS[name]))
    if ablate:
        out += [Variant(name, (override,)) for name, override in ABLATIONS.items()]
    for spec in extra:
        name, _, rest = spec.partition(":")
        base, *overrides = rest.split() or [""]
        if not name or base not in PRESETS or any("=" not in o for o in overrides):
            raise UserError("--variant", spec, "is not NAME:PRESET KEY=VALUE ...",
                            "e.g. --variant 'fp32:tuned trainer.precision=fp32'.")
        out.append(Variant(name, (*PRESETS[base], *overrides)))
    names = [v.name for v in out]
    if BASELINE in names or len(set(names)) != len(names):
        raise UserError("--variant", ",".join(names), "names must be unique and not "
                        f"{BASELINE!r}.", "rename the variant.")
    return tuple(out)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpc_ddp.bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS),
                   help="comma list of null, tiny_cnn, resnet18, resnet50")
    p.add_argument("--settings", default="exact,tuned",
                   help="comma list of plain, exact, tuned (default exact,tuned; plain runs "
                   "with the null model always, for the overhead figure)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:PRESET K=V ...",
                   help="another setting: a preset plus overrides (repeatable)")
    p.add_argument("--ablate", action="store_true",
                   help="add the tuned defaults minus each one (what each default buys)")
    p.add_argument("--rounds", type=int, default=TrainOptions.rounds,
                   help=f"most rounds per model (default {TrainOptions.rounds})")
    p.add_argument("--min-rounds", type=int, default=TrainOptions.min_rounds)
    p.add_argument("--budget-s", type=float, default=TrainOptions.budget_s,
                   help="seconds of timed rounds per model and world size, about "
                   f"(default {TrainOptions.budget_s:g})")
    p.add_argument("--window-s", type=float, default=TrainOptions.window_s,
                   help=f"seconds of baseline steps per window (default {TrainOptions.window_s:g})")
    p.add_argument("--min-steps", type=int, default=TrainOptions.min_steps,
                   help="fewest steps per window, and the steps of each contender's pace "
                   f"probe (default {TrainOptions.min_steps})")
    p.add_argument("--warmup-steps", type=int, default=TrainOptions.warmup_steps,
                   help=f"untimed steps per contender first (default {TrainOptions.warmup_steps})")
    p.add_argument("--world-sizes", default="",
                   help="comma list of total ranks, one job each (default: the config's)")
    p.add_argument("--startup", action="store_true",
                   help="on Slurm: also time submit-to-first-step against a bare srun")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="also time tuned with a checkpoint every N steps, written "
                   "synchronously and in the background: the stall per checkpoint")
    add_job_arguments(p, plot=str(PLOT), per=", per world size")
    return p


def options_from(args: argparse.Namespace) -> TrainOptions:
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    known = (*MODELS, "resnet50")
    if not models or any(m not in known for m in models):
        raise UserError("--models", args.models, "names an unknown model.",
                        f"use a comma list of {', '.join(known)}.")
    try:
        sizes = tuple(int(w) for w in args.world_sizes.split(",") if w.strip())
    except ValueError:
        sizes = (0,)
    if any(w < 1 for w in sizes):
        raise UserError("--world-sizes", args.world_sizes, "needs positive integers.",
                        "e.g. --world-sizes 1,2.")
    if min(args.rounds, args.min_rounds, args.min_steps, args.warmup_steps) < 1 or min(
            args.window_s, args.budget_s) <= 0:
        raise UserError("--rounds/--min-rounds/--budget-s/--window-s/--min-steps/--warmup-steps",
                        f"{args.rounds}/{args.min_rounds}/{args.budget_s}/{args.window_s}/"
                        f"{args.min_steps}/{args.warmup_steps}", "must be positive.",
                        "e.g. --rounds 15 --budget-s 30 --window-s 1.")

    check_timeout(args.timeout_s)
    variants = variants_from(args.settings, args.variant, args.ablate)
    if args.checkpoint_every < 0:
        raise UserError("--checkpoint-every", args.checkpoint_every, "must be 0 or more.",
                        "e.g. --checkpoint-every 5.")
    if args.checkpoint_every:
        variants = (*variants, *checkpoint_variants(args.checkpoint_every, variants))
    return TrainOptions(models, variants, args.rounds, min(args.min_rounds, args.rounds),
                        args.budget_s, args.window_s, args.min_steps, args.warmup_steps, sizes,
                        args.startup, args.checkpoint_every)


def checkpoint_variants(every: int, given: Sequence[Variant]) -> tuple[Variant, ...]:
    """tuned (if not there already) and tuned checkpointing every ``every`` steps, written
    synchronously and in the background."""
    tuned = () if any(v.name == "tuned" for v in given) else (Variant("tuned", ()),)
    interval = f"trainer.checkpoint_interval={every}"
    return (*tuned, Variant(CKPT_SYNC, (interval, "trainer.checkpoint_background=false")),
            Variant(CKPT_BACKGROUND, (interval, "trainer.checkpoint_background=true")))


def job_overrides(user: Sequence[str], root: Path, world: int | None,
                  nodes: int) -> list[str]:
    """The overrides of the job for ``world`` ranks (None: the config's own)."""
    out = [*BENCH_OVERRIDES, *user]
    if world is not None:
        if world % nodes:
            raise UserError("--world-sizes", world, f"does not divide over nodes={nodes}.",
                            "choose multiples of the node count.")
        out.append(f"cluster.tasks_per_node={world // nodes}")
    out.append(f"run_dir={root / (f'ws{world}' if world is not None else 'job')}")
    return out


class ModelProgress:
    """Prints a line as each model's measurement starts (its Trainers' folders appear under
    variants/ of the job's run dir), then one when the job is over."""

    def __init__(self, variants: Path, models: Sequence[str], label: str, out: TextIO) -> None:
        self.variants, self.models, self.label, self.out = variants, list(models), label, out
        self.started = time.monotonic()
        self.seen = 0

    def __call__(self) -> None:
        try:
            names = [p.name for p in self.variants.iterdir()]
        except OSError:
            return  # not made yet
        # Models are measured in order: a later one started means the earlier ones did too.
        started = [i for i, m in enumerate(self.models) if any(n.startswith(f"{m}-")
                                                                for n in names)]
        while started and self.seen <= max(started):
            self.seen += 1
            self.say(f"measuring {self.models[self.seen - 1]} "
                     f"({self.seen} of {len(self.models)})")

    def say(self, what: str, clock: bool = True) -> None:
        since = f", {time.monotonic() - self.started:.0f}s in" if clock else ""
        print(f"bench train: {self.label}{what}{since}", file=self.out, flush=True)


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout) -> int:
    # deferred (start-up): bench.train_rank, bench.train_report, config.compose, rank.main.task
    from hpc_ddp.bench import train_rank
    from hpc_ddp.bench.train_report import combine, table
    from hpc_ddp.config.compose import compose, to_yaml
    from hpc_ddp.rank.main.task import RankProgram

    args = parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    user = [o for o in args.overrides if o.partition("=")[0].lstrip("+~") != "run_dir"]
    given = text(args.overrides, "run_dir")
    root = Path(given) if given else job.default_run_dir(Path.cwd(), "bench-train")
    results: list[dict[str, Any]] = []
    try:
        options = options_from(args)
        base = compose([*BENCH_OVERRIDES, *user])
        for variant in options.variants:  # refuse a bad --variant before anything starts
            with_overrides(base, variant.overrides)
        for world in options.world_sizes or (None,):
            cfg, run = job.prepare(job_overrides(user, root, world, base.nodes), "bench-train",
                                   os.environ, Path.cwd())
            progress = ModelProgress(run.root / "variants", options.models,
                                     f"{world} ranks: " if world is not None else "", out)
            progress.say(f"{len(options.models)} model(s), each built, warmed up, then timed "
                         f"for about {options.budget_s:g}s", clock=False)
            job.submit_and_wait(cfg, run, RankProgram(train_rank.run, to_yaml(cfg),
                                                      str(run.root), options),
                                out, args.timeout_s, on_poll=progress)
            result = read_json(run.root / RESULT)
            if result is None:
                return job.did_not_finish(run, out)
            progress.say("done")
            results.append(result)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    combined = combine(results, asdict(options))
    if options.startup:
        from hpc_ddp.bench.startup import measure_startup  # deferred (start-up): bench.startup

        combined["startup"] = measure_startup(base, user, root, out)
    write_json(root / RESULT, combined)
    print(table(combined), file=out)
    if not args.no_plot:
        from hpc_ddp.bench.plot_train import plot  # deferred (start-up): bench.plot_train

        print(plot(combined, root / PLOT), file=out)
    print(f"results: {root / RESULT}", file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
