"""``python -m hpc_ddp.bench [subcommand] [options] [key=value ...]``; ``comm`` by default."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# Subcommand -> module with ``main(argv) -> int``. New benchmarks register here.
SUBCOMMANDS: dict[str, str] = {
    "comm": "hpc_ddp.bench.comm",     # collectives: busbw by size, ratio to raw TCP
    "train": "hpc_ddp.bench.train",   # training throughput against a hand-written DDP loop
    "sweep": "hpc_ddp.bench.sweep",   # submitting a big sweep: arrays vs one sbatch per point
}
DEFAULT = "comm"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        from hpc_ddp import bench

        print(bench.__doc__)
        return 0
    name = args.pop(0) if args and args[0] in SUBCOMMANDS else DEFAULT
    module = importlib.import_module(SUBCOMMANDS[name])
    return int(module.main(args))


if __name__ == "__main__":
    sys.exit(main())
