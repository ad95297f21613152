"""The supervised child (hpc_ddp/rank/supervise/program.py): this rank's training, as in-process.

Started by the supervisor with the config and run dir in its environment; the torchrun
variables it also sets make this process a client of the supervisor's store.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main() -> int:
    # deferred: hostlist, the typed schemas; start-up: rank.contract, rundir,
    # rank.main.submitted
    from hpc_ddp.config.compose import from_yaml
    from hpc_ddp.rank.contract import PROGRAM_CONFIG_ENV, PROGRAM_RUN_DIR_ENV
    from hpc_ddp.rank.main.submitted import recorded
    from hpc_ddp.rank.main.task import run
    from hpc_ddp.rundir import RunDir

    cfg = from_yaml(os.environ[PROGRAM_CONFIG_ENV])
    try:
        run(cfg, RunDir(Path(os.environ[PROGRAM_RUN_DIR_ENV])), os.environ)
    except Exception as exc:
        if recorded(exc):  # in this rank's log and error file already
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
