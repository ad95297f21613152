"""A remote run's results on this machine: ``python -m hpc_ddp.collect HANDLE``.

    python -m hpc_ddp.collect outputs/2026-12-04_20-15-02-113               # new results
    python -m hpc_ddp.collect outputs/2026-12-04_20-15-02-113 --checkpoint  # + model.pt
    tensorboard --logdir outputs/2026-12-04_20-15-02-113/tb

HANDLE is the local run dir a submit with ``cluster.remote=HOST`` printed. The run's summary,
events, progress, config, TensorBoard files and every rank's log come into it over the
handle's SSH connection; each collect copies only what is new or has grown since the last
one (run it as often as you like while the run trains). Checkpoints stay on the cluster:
``--checkpoint`` adds one plain file of the latest, ``exported/model.pt``
(docs/remote.md#results-on-your-laptop).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from hpc_ddp.errors import USAGE_EXIT_CODE, UserError


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.collect", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("handle", type=Path, help="the local run dir of a remote run")
    parser.add_argument("--checkpoint", action="store_true",
                        help="also the latest checkpoint as one file (exported/model.pt)")
    args = parser.parse_args(argv)
    from hpc_ddp.remote.results import collect, report  # deferred (start-up): tarfile

    try:
        report(collect(args.handle, args.checkpoint), out)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except KeyboardInterrupt:  # what came in whole is kept; the next collect goes on
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
