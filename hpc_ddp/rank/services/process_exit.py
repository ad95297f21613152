"""Leave a process without the interpreter's C++ teardown.

Why: with torch 2.14 a process that used a Gloo process group can die at exit with SIGABRT
("terminate called without an active exception": DDP's reducer, or a checkpoint writer's
pool, keeps the group and its threads alive past ``destroy_process_group``, and a joinable
C++ thread destroyed at interpreter teardown aborts the process). A finished rank must not be
read as a crash, so a rank whose work is done ends here: the normal shutdown steps a program
can observe are taken (non-daemon threads joined, atexit handlers run, open files flushed),
then ``os._exit`` with its code.

A task that leaves through Python's own exit (a supervisor, the task that waits for its warm
fork) calls :func:`ended` on its way out: see there.
"""

from __future__ import annotations

import _io
import atexit
import gc
import os
import signal
import sys
import threading
import warnings


def leave(code: int) -> None:
    """The shutdown a program sees, without the interpreter's own teardown."""
    main_thread = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main_thread and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():  # files a script left open are flushed, as at an exit
            # io's C base type: no ABC __instancecheck__ runs on other objects' classes.
            if isinstance(obj, _io._IOBase):
                try:
                    if not obj.closed and obj.writable():
                        obj.flush()
                except (OSError, ValueError):
                    pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# What a task's program may handle: Slurm's warning ahead of the time limit and a preemption's
# or scancel's SIGTERM (sent to every process of the step), a launcher's or a terminal's.
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


def ended(code: int) -> int:
    """``code``, with each signal this process handles in Python ignored from here to its exit.

    Python's exit puts every signal a Python handler handles back to its default action
    before it frees the interpreter's modules (``_PySignal_Fini`` in ``Py_FinalizeEx``:
    https://github.com/python/cpython/blob/3.11/Python/pylifecycle.c), which takes a while in a
    process that imported much. Slurm's warning or SIGTERM coming then would end a finished
    task killed by that signal, and its job FAILED where it had succeeded (seen in CI: a
    1-minute limit's USR2 1.4 s after a run's last step; both tasks "died by signal: 12").
    The program has ended: ignored, the signal changes nothing. One left at its default
    action (not handled) keeps it."""
    for signum in STOPPING:
        if callable(signal.getsignal(signum)):
            signal.signal(signum, signal.SIG_IGN)
    return code


def exit_code(code: object) -> int:
    """What Python's own exit makes of a SystemExit's code."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
