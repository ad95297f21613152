"""Leave a process without the interpreter's C++ teardown.

Why: with torch 2.14 a process that used a Gloo process group can die at exit with SIGABRT
("terminate called without an active exception": DDP's reducer, or a checkpoint writer's
pool, keeps the group and its threads alive past ``destroy_process_group``, and a joinable
C++ thread destroyed at interpreter teardown aborts the process). A finished rank must not be
read as a crash, so a rank whose work is done ends here: the normal shutdown steps a program
can observe are taken (non-daemon threads joined, atexit handlers run, open files flushed),
then ``os._exit`` with its code.
"""

from __future__ import annotations

import _io
import atexit
import gc
import os
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


def exit_code(code: object) -> int:
    """What Python's own exit makes of a SystemExit's code."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
