"""Every task of a step that ``submit`` started inside an allocation (hpc_ddp/launch/step.py):
``srun ... python -m hpc_ddp.rank.main.step`` runs the pickled task named in its environment
(the same callable a submitit job runs), once the file and its run dir passed the ownership
checks, from the descriptor they were made on (hpc_ddp/owned.py)."""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path

from hpc_ddp.rank.services import early_signals


def main(argv: Sequence[str] = ()) -> int:
    # Slurm's requeue signal or SIGTERM may come while this task starts: recorded, not fatal
    # (rank/services/early_signals.py). Before the imports below (deferred): each is time in
    # which either signal would end the task.
    early_signals.hold(os.environ)
    # deferred: hpc_ddp.owned, rank.contract, rank.warm.client and rank.warm.thin (after hold)
    from hpc_ddp.owned import Untrusted, open_owned, run_root_of
    from hpc_ddp.rank.contract import TASK_ENV
    from hpc_ddp.rank.warm.client import release
    from hpc_ddp.rank.warm.thin import leave_as, run_forked

    forked = run_forked("hpc_ddp.rank.main.step:main", argv, sys.argv)  # rank/warm/
    if forked is not None:
        return leave_as(forked)
    path = os.environ.pop(TASK_ENV, "")
    if not path:
        print(f"error: {TASK_ENV} is not set: this module runs the tasks of a step that "
              "`python -m hpc_ddp.submit` started; run that instead.", file=sys.stderr)
        return 2
    try:  # written by this user's submit under the run's submitit/; code by design
        with open_owned(Path(path), run_root_of(Path(path))) as handle:
            task = pickle.load(handle)
    except Untrusted as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        task()
    finally:
        release()  # the node's warm process, if this task started it (rank/warm/client.py)
    return 0


if __name__ == "__main__":
    from hpc_ddp.rank.services.process_exit import ended

    sys.exit(ended(main()))
