"""Sharded models and checkpoints (docs/performance.md#sharded-models-and-checkpoints):

    python -m hpc_ddp.bench checkpoint                       # ~1 GB of state, 4 ranks, CPU
    python -m hpc_ddp.bench checkpoint --state-mb 200 --ranks 2 --json out.json

In one run, on local ranks (gloo, CPU; each phase in fresh processes, forked from a
forkserver that imported torch once):

- **stall per save** of one model's state (a stack of linear blocks sharded with FSDP2, its
  AdamW state: parameters x 3 = ``--state-mb``), through the checkpoint implementation the
  trainer and ``ctx.save`` share: ``full`` (gathered whole, rank 0 writes one file; in the
  foreground, and in the background as the trainer's default), ``dcp`` (every rank writes its
  own shards, in the foreground) and ``dcp async`` (staged to host memory, written in the
  background). The stall is what the step waits for (the slowest rank's); "on disk" is until
  the set is the latest, which the next save would wait for.
- **peak memory per rank**, DDP against FSDP, training the same model (resident memory above
  the process's own before the model was built).
- **samples/s**, FSDP against DDP on a model both fit, side by side: the ratio is against the
  DDP run of the same invocation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.errors import USAGE_EXIT_CODE, UserError

FORMATS = (("full", "fsdp", "full", False), ("full, background", "fsdp", "full", True),
           ("dcp", "fsdp", "dcp", False), ("dcp async", "fsdp", "dcp", True))


def shape_for(state_mb: float, dim: int) -> int:
    """Blocks of Linear(dim, dim) whose parameters and AdamW's two moments weigh
    ``state_mb`` MB in fp32."""
    per_block = (dim * dim + dim) * 4 * 3 / 1e6
    return max(1, round(state_mb / per_block))


def measure(args: argparse.Namespace, root: Path, say: Any) -> dict[str, Any]:
    from hpc_ddp.bench.checkpoint_rank import run_phase  # deferred: torch (checkpoint_rank)

    blocks = shape_for(args.state_mb, args.dim)
    state_mb = shape_for_mb(blocks, args.dim)
    result: dict[str, Any] = {"ranks": args.ranks, "dim": args.dim, "blocks": blocks,
                              "state_mb": state_mb, "saves": {}, "train": {}}
    say(f"state: {blocks} x Linear({args.dim}, {args.dim}) + AdamW = {state_mb:.0f} MB, "
        f"{args.ranks} ranks (gloo, CPU)")
    for label, strategy, fmt, background in FORMATS:
        spec = {"name": label.replace(", ", "-").replace(" ", "-"), "strategy": strategy,
                "format": fmt, "background": background, "dim": args.dim, "blocks": blocks,
                "saves": args.saves}
        found = run_phase("saves", args.ranks, root, spec)
        result["saves"][label] = found
        say(f"  {label:<17} stall {statistics.median(found['stall_s']):7.3f} s   on disk "
            f"{statistics.median(found['total_s']):7.3f} s")
    small = args.train_blocks
    for strategy in ("ddp", "fsdp"):
        for name, model_blocks in (("memory", blocks), ("speed", small)):
            spec = {"name": f"{strategy}-{name}", "strategy": strategy, "dim": args.dim,
                    "blocks": model_blocks, "batch": args.batch, "memory": name == "memory",
                    "warmup": 1 if name == "memory" else 3,
                    "steps": 2 if name == "memory" else args.steps}
            result["train"][f"{strategy} {name}"] = run_phase("train", args.ranks, root, spec)
    for strategy in ("ddp", "fsdp"):
        peaks = result["train"][f"{strategy} memory"]["peak_mb"]
        say(f"  {strategy} peak per rank: {max(peaks):7.0f} MB (ranks {min(peaks):.0f}-"
            f"{max(peaks):.0f})")
    ddp, fsdp = (result["train"][f"{s} speed"]["samples_per_s"] for s in ("ddp", "fsdp"))
    result["fsdp_over_ddp"] = fsdp / ddp
    say(f"  samples/s ({small} blocks, batch {args.batch}/rank): ddp {ddp:.0f}, fsdp {fsdp:.0f}"
        f" (ratio {fsdp / ddp:.3f})")
    return result


def shape_for_mb(blocks: int, dim: int) -> float:
    return blocks * (dim * dim + dim) * 4 * 3 / 1e6


def check_args(args: argparse.Namespace) -> None:
    for key, value in (("--ranks", args.ranks), ("--saves", args.saves),
                       ("--steps", args.steps), ("--dim", args.dim),
                       ("--train-blocks", args.train_blocks), ("--batch", args.batch)):
        if value < 1:
            raise UserError(key, value, "must be 1 or more.", f"give {key} a positive number.")
    if args.state_mb <= 0:
        raise UserError("--state-mb", args.state_mb, "must be above 0.", "e.g. --state-mb 1000.")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.bench checkpoint",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--state-mb", type=float, default=1000.0,
                        help="parameters + AdamW state, MB (default 1000)")
    parser.add_argument("--dim", type=int, default=2048, help="the blocks' width")
    parser.add_argument("--saves", type=int, default=3, help="timed saves per format")
    parser.add_argument("--train-blocks", type=int, default=4,
                        help="blocks of the model samples/s is measured on")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps")
    parser.add_argument("--dir", type=Path, help="where the checkpoints go (default: a "
                        "temporary folder under /tmp, removed after)")
    parser.add_argument("--json", type=Path, help="write the figures there too")
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="hpc_ddp-bench-ckpt-", dir=args.dir) as tmp:
        result = measure(args, Path(tmp), print)
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
