"""The supervised child (hpc_ddp/rank/supervise/program.py): this rank's training, as in-process.

Started by the supervisor with the config and run dir in its environment; the torchrun
variables it also sets make this process a client of the supervisor's store.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hpc_ddp.rank.services.process_exit import ended


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
            code = exit_code(exc)
            if code != 1:  # its supervisor's report names the cause from what it printed
                # deferred (start-up): rank.join.ranklog
                from hpc_ddp.rank.join.ranklog import masked

                print(masked(f"{type(exc).__name__}: {exc}"), file=sys.stderr, flush=True)
            return code
        raise
    return 0


def exit_code(exc: Exception) -> int:
    """The code for a failure that reached this far: one while joining (a failure in
    training is decided by outcome.fail, which exits itself). The network's (Gloo's full
    mesh closed by a peer, a store connection lost) is one a new start may get past: its
    supervisors start every rank again in place; anything else is final."""
    # deferred (start-up): rank.contract, rank.supervise.diagnose
    from hpc_ddp.rank.contract import RESTART_EXIT_CODE
    from hpc_ddp.rank.supervise.diagnose import is_comm_failure  # deferred (start-up): diagnose

    return RESTART_EXIT_CODE if is_comm_failure(exc) else 1


if __name__ == "__main__":
    sys.exit(ended(main()))
