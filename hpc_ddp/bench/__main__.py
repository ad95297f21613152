"""``python -m hpc_ddp.bench [subcommand] [options] [key=value ...]``; ``comm`` by default."""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Sequence

from hpc_ddp.errors import USAGE_EXIT_CODE, UserError

# Subcommand -> module with ``main(argv) -> int``. New benchmarks register here.
SUBCOMMANDS: dict[str, str] = {
    "comm": "hpc_ddp.bench.comm",     # collectives: busbw by size, ratio to raw TCP
    "train": "hpc_ddp.bench.train",   # training throughput against a hand-written DDP loop
    "sweep": "hpc_ddp.bench.sweep",   # submitting a big sweep: arrays vs one sbatch per point
    "entries": "hpc_ddp.bench.entries",  # your code: a function entry's and a script's cost
}
DEFAULT = "comm"


def subcommand(args: Sequence[str]) -> str:
    """The subcommand ``args`` start with; the default when they start with an option or an
    override. A first word that is neither (a bare word, no ``=``) is a mistyped subcommand:
    Hydra would only say it cannot parse it."""
    if args and args[0] in SUBCOMMANDS:
        return args[0]
    first = args[0] if args else ""
    if first and "=" not in first and not first.startswith(("-", "~", "+")):
        close = difflib.get_close_matches(first, SUBCOMMANDS, n=1)
        names = ", ".join(SUBCOMMANDS)
        fix = (f"did you mean {close[0]}? The benchmarks are {names}." if close
               else f"use one of {names} (--help says what each measures).")
        raise UserError("subcommand", first, "is not a benchmark.", fix)
    return DEFAULT


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        from hpc_ddp import bench

        print(bench.__doc__)
        return 0
    try:
        name = subcommand(args)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    if args and args[0] == name:
        args.pop(0)
    module = importlib.import_module(SUBCOMMANDS[name])
    return int(module.main(args))


if __name__ == "__main__":
    sys.exit(main())
