"""``python -m hpc_ddp.rank.main.script_runner SCRIPT [args]`` (or ``-m MODULE [args]``): run a
script as ``python SCRIPT args`` would, then leave without the interpreter's C++ teardown.

Why: with torch 2.14 a DDP script that ends normally can die at exit with SIGABRT
(rank/services/process_exit.py); seen here in 2 to 3 of 10 plain torchrun runs of a two-rank
script. The supervisor must read such a death as a crash (an NCCL watchdog abort looks the
same), so a finished run would be reported failed. Here the script runs as ``__main__``
(runpy: ``sys.argv``, ``sys.path[0]`` and multiprocessing's spawn as under ``python``), then
the process leaves with the script's code through process_exit.leave.

Its ``init_process_group()`` (env://) joins the supervisor's store as a client that knows the
store's key (rank/join/job_store.py): the store lets in no one else. A secret
argument arrives as ``${oc.env:NAME}`` and is read from the environment into ``sys.argv``
here, so no command line holds it.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.config import secrets
from hpc_ddp.rank.contract import STOP_FILE_ENV, SYNC_PROBE_ENV, SYNC_SUFFIX
from hpc_ddp.rank.join import job_store
from hpc_ddp.rank.services.process_exit import exit_code, leave
from hpc_ddp.rundir import write_json


def main(argv: Sequence[str]) -> int:
    """Run the script; its exit code (0, its SystemExit code, or 1 after an exception)."""
    args = list(argv)
    job_store.use_job_store(os.environ)  # init_process_group() joins its supervisor's store
    # A secret argument is ${oc.env:NAME} on the command line (ps shows that, not it): the
    # value is read here, into the script's own argv (config/secrets.py).
    for i, arg in enumerate(args):
        value = secrets.resolve(arg, os.environ)
        if value is None:
            print(f"error: the script's argument {arg} names a variable this task's "
                  "environment does not have: export it where you submit (a resume too: its "
                  "value is kept nowhere).", file=sys.stderr)
            return 2
        args[i] = value
    probe = _sync_probe()
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]  # runpy puts the module's path in argv[0]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = args
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))  # as `python SCRIPT`
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        return exit_code(exc.code)
    except BaseException as exc:
        # The traceback as `python SCRIPT` prints it: from the script's frames on.
        tb = exc.__traceback__
        while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__,)
                                  or tb.tb_frame.f_code.co_filename.startswith("<frozen")):
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        return 1
    finally:
        _leave_figures(probe)
    return 0


def _sync_probe() -> Any:
    """How much of the script's steps wait on gradient sync (trainer/sync_probe.LoopProbe),
    where the supervisor asks for it (several ranks, DDP)."""
    if os.environ.get(SYNC_PROBE_ENV) != "1":
        return None
    from hpc_ddp.trainer import sync_probe  # deferred (start-up): trainer.sync_probe

    return sync_probe.LoopProbe()


def _leave_figures(probe: Any) -> None:
    """Rank 0's figures beside the stop file, which the supervisor adds to summary.json."""
    if probe is None:
        return
    probe.close()
    stop_file = os.environ.get(STOP_FILE_ENV)
    if os.environ.get("RANK") == "0" and stop_file:
        from hpc_ddp.trainer import sync_probe  # deferred (start-up): trainer.sync_probe

        write_json(Path(stop_file).with_suffix(SYNC_SUFFIX), sync_probe.summary_of(probe))


if __name__ == "__main__":
    leave(main(sys.argv[1:]))
