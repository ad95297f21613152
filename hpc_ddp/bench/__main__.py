"""``python -m hpc_ddp.bench <benchmark> [options] [key=value ...]``; alone, it lists them."""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Sequence

from hpc_ddp.errors import USAGE_EXIT_CODE, UserError

# Subcommand -> (module with ``main(argv) -> int``, what it measures). New benchmarks register
# here; the listing and the typo hints come from this table.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "comm": ("hpc_ddp.bench.comm", "collectives: busbw by message size, ratio to raw TCP"),
    "train": ("hpc_ddp.bench.train", "training throughput against a hand-written DDP loop"),
    "scaling": ("hpc_ddp.bench.scaling",
                "your training on 1..N nodes: efficiency, what limits it, the sync fix to use"),
    "sweep": ("hpc_ddp.bench.sweep",
              "submitting a big sweep (held jobs): arrays, one sbatch per point, bare sbatch"),
    "search": ("hpc_ddp.bench.search",
               "an adaptive search in batches, asynchronously, pruned: idle node-seconds"),
    "entries": ("hpc_ddp.bench.entries", "your code: what a function entry and a script cost"),
    "data": ("hpc_ddp.bench.data",
             "image loading: folder and shards loaders vs the textbook one; staging rates"),
    "scale": ("hpc_ddp.bench.scale",
              "per-rank cost against world size (8 to 8192 simulated); 10,000-node lists"),
    "logs": ("hpc_ddp.bench.logs",
             "python -m hpc_ddp.logs on a synthetic run of 4,096 ranks: one rank, --grep"),
    "recovery": ("hpc_ddp.bench.recovery",
                 "a killed rank or a lost node: seconds to training again, in place vs requeue"),
    "startup": ("hpc_ddp.bench.first_step",
                "time to the first step on Slurm: script=, the trainer, against salloc+srun"),
    "warm": ("hpc_ddp.bench.warm_start",
                  "what a warm start saves: cold and warm ranks, seconds and CPU-s to step 1"),
    "checkpoint": ("hpc_ddp.bench.checkpoint",
                   "stall per save (full, DCP, DCP async); FSDP against DDP: memory, samples/s"),
}


def listing() -> str:
    """What ``python -m hpc_ddp.bench`` alone prints: every benchmark and what it measures."""
    width = max(map(len, SUBCOMMANDS))
    rows = [f"  {name:<{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items()]
    return "\n".join(["usage: python -m hpc_ddp.bench <benchmark> [options] [key=value ...]",
                      "", "benchmarks:", *rows, "",
                      "python -m hpc_ddp.bench <benchmark> --help says more about one."])


def subcommand(args: Sequence[str]) -> str:
    """The benchmark ``args`` name first; UserError naming the word (with the closest name)
    for a mistyped one, or the first argument when they start with an option or override."""
    first = args[0] if args else ""
    if first in SUBCOMMANDS:
        return first
    names = ", ".join(SUBCOMMANDS)
    if first and "=" not in first and not first.startswith(("-", "~", "+")):
        close = difflib.get_close_matches(first, SUBCOMMANDS, n=1)
        fix = (f"did you mean {close[0]}? The benchmarks are {names}." if close
               else f"use one of {names} (python -m hpc_ddp.bench lists what each measures).")
        raise UserError("subcommand", first, "is not a benchmark.", fix)
    raise UserError("subcommand", "(none)", f"is needed before {first}.",
                    f"name the benchmark first, e.g. python -m hpc_ddp.bench comm {first} "
                    f"(one of {names}).")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(listing())
        return 0
    try:
        name = subcommand(args)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(args[1:]))


if __name__ == "__main__":
    sys.exit(main())
