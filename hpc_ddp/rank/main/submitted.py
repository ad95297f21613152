"""Every task submitit starts, on Slurm and locally: submitit's own ``process_job``, with the
job's pickle loaded only once it and its run dir passed the ownership checks, from the
descriptor they were made on (hpc_ddp/owned.py).

submitit's tasks run ``PYTHON -u -m submitit.core._submit FOLDER``; the executors are given
``python -m hpc_ddp.rank.main.submitted`` as PYTHON (launch/slurm.py, launch/local.py), so a
task runs ``python -m hpc_ddp.rank.main.submitted -u -m submitit.core._submit FOLDER``. The
pickle (``<job>_submitted.pkl``, rewritten by submitit at every requeue) is what every task
of every attempt unpickles: a file planted there by anyone else would be their code, run as
this user on every node.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.rank.services import early_signals

MODULE = "hpc_ddp.rank.main.submitted"


def checked_load(cls: type, filepath: str | Path) -> Any:
    """submitit's ``DelayedSubmission.load``, from an owned file (under ``<run>/submitit/``)."""
    from hpc_ddp.owned import Untrusted, open_owned, run_root_of  # deferred: owned, as in main

    path = Path(filepath)
    with open_owned(path, run_root_of(path)) as handle:
        obj = pickle.load(handle)
    if type(obj).__name__ != cls.__name__:  # submitit's own check
        raise Untrusted(f"{path} holds a {type(obj).__name__}, not a {cls.__name__}.")
    return obj


def main(argv: Sequence[str]) -> int:
    # Slurm's requeue signal or SIGTERM may come while this task starts: recorded, not fatal.
    # Before the imports below (deferred): each is time in which either signal would end
    # the task (rank/services/early_signals.py).
    early_signals.hold(os.environ)
    # deferred: hpc_ddp.owned, rank.warm.client and rank.warm.thin (after hold)
    from hpc_ddp.owned import Untrusted
    from hpc_ddp.rank.warm.client import release
    from hpc_ddp.rank.warm.thin import leave_as, run_forked

    args = list(argv)
    if not args or args[-1].startswith("-"):
        print("error: this module runs a task submitit started (python -m hpc_ddp.submit "
              "does); it takes submitit's arguments ending in the job folder.", file=sys.stderr)
        return 2
    forked = run_forked(f"{MODULE}:main", args, sys.argv)  # rank/warm/: a warm start
    if forked is not None:
        return leave_as(forked)
    if "-u" in args:  # what python -u would have done for submitit's logs
        for stream in (sys.stdout, sys.stderr):
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(write_through=True)
    # deferred: submitit
    from submitit.core import job_environment, submission, utils

    # The one place submitit unpickles a task: ours checks the file first (see above).
    utils.DelayedSubmission.load = classmethod(checked_load)  # type: ignore[method-assign,assignment]
    job_environment.JobEnvironment._handle_signals = held_until_ours  # type: ignore[method-assign,assignment]
    try:
        submission.process_job(args[-1])
    except Untrusted as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if recorded(exc):  # in the rank's log and error file, with the program's traceback
            return 1
        raise
    finally:
        release()  # the node's warm process, if this task started it (rank/warm/client.py)
    return 0


def held_until_ours(env: Any, paths: Any, submission: Any) -> None:
    """In place of submitit's signal handlers, set before the task's program runs: the
    requeue signal and SIGTERM stay recorded (main held them), and the rank's stop request
    acts on them once it is installed (rank/services/stopping.py). submitit's own would take
    a requeue signal that comes while the program starts (a short time limit, a slow start on
    a loaded node) as a time-out "not checkpointable" and end the rank (seen in CI), and its
    SIGCONT handler only logs what the default does."""
    early_signals.hold({early_signals.SIGNAL_ENV: signal.Signals(env._usr_sig()).name})


def recorded(exc: BaseException) -> bool:
    """Whether the rank recorded ``exc`` already (rank/join/joined.py): printing it again
    would bury the program's own traceback under the frames it was called through."""
    from hpc_ddp.rank.join.tracebacks import RECORDED  # deferred (start-up): tracebacks

    return bool(getattr(exc, RECORDED, False))


if __name__ == "__main__":
    from hpc_ddp.rank.services.process_exit import ended

    sys.exit(ended(main(sys.argv[1:])))
