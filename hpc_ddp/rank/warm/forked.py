"""A process just forked from a node's warm process: made into the process its client would
have started as a fresh interpreter, then its program run, then its exit.

What a fresh ``python -m ...`` of the client would have had, this process gets from the
request: its standard streams (the client's own descriptors), environment (rank variables,
CUDA_VISIBLE_DEVICES: set before anything touches CUDA, which the warm process never does),
working folder, umask, CPU affinity (Slurm binds each task to its own CPUs), signal mask and
ignored signals (a local rank ignores Ctrl-C as its launcher set up), its process group, its
``sys.argv`` and ``sys.path[0]``, and intra-op threads for its own CPUs (OMP_NUM_THREADS when
set, as torch reads it at its start). Seeds that a fresh interpreter draws anew (Python's
``random`` does at fork by itself; NumPy's global generator) are drawn anew.
https://man7.org/linux/man-pages/man2/fork.2.html
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hpc_ddp.rank.contract import WARM_NOTE_ENV, WARM_SOCKET_ENV
from hpc_ddp.rank.services.process_exit import exit_code, leave

# What CPython itself sets at its start (Python/pylifecycle.c): SIGPIPE and SIGXFSZ ignored,
# SIGINT raising KeyboardInterrupt unless it was ignored when the process started.
_PYTHON_IGNORES = (signal.SIGPIPE, signal.SIGXFSZ)


def become(request: dict[str, Any], fds: Sequence[int], close: Iterable[int],
           note: str) -> None:
    """Never returns: set this process up as ``request`` says, run its target, exit."""
    code = 1
    gc.enable()  # off in the warm process (server.preload): on in a rank, as in a fresh one
    try:
        for fd in close:  # the warm process's listening socket and its other clients
            try:
                os.close(fd)
            except OSError:
                pass
        _process_group(int(request.get("pgid", 0)))
        _streams(fds, bool(request.get("unbuffered")))
        _signals(request.get("ignored", []), request.get("sigmask", []))
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in request["environ"].items()})
        os.environ[WARM_SOCKET_ENV] = str(request["socket"])
        os.environ[WARM_NOTE_ENV] = note
        os.chdir(request["cwd"])
        os.umask(int(request["umask"]))
        cpus = {int(c) for c in request.get("affinity", [])}
        if cpus:
            os.sched_setaffinity(0, cpus)
        sys.argv = [str(a) for a in request["argv"]]
        _title([str(a) for a in request.get("title", [])])
        _path_zero(str(request["cwd"]), bool(request.get("safe_path")))
        _fresh_state(cpus)
        target = _target(str(request["target"]))
    except BaseException:  # noqa: B036 (nothing of the warm process's may run on)
        traceback.print_exc()
        os._exit(code)
    _run(target, [str(a) for a in request.get("args", [])])


def _title(words: list[str]) -> None:
    """The command line ps and pgrep show (/proc/PID/cmdline): the one the client would
    have started, not the warm process's (https://github.com/dvarrazzo/py-setproctitle)."""
    if words:
        # deferred: setproctitle (the warm process, server.py, imported it already)
        import setproctitle

        setproctitle.setproctitle(" ".join(words))


def _path_zero(cwd: str, safe_path: bool) -> None:
    """``sys.path[0]`` as the client's ``python -m`` had it: its folder, or nothing with -P."""
    if not sys.flags.safe_path and sys.path:
        del sys.path[0]  # the warm process's own folder
    if not safe_path:
        sys.path.insert(0, cwd)


def _process_group(pgid: int) -> None:
    """0: a group of its own (a supervisor stops its child's whole group); else the client's
    group, where that is in this session (a local rank stays in its launcher's group)."""
    if pgid > 0:
        try:
            os.setpgid(0, pgid)
            return
        except OSError:
            pass
    os.setpgid(0, 0)


def _streams(fds: Sequence[int], unbuffered: bool) -> None:
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    for number, stream in ((1, sys.stdout), (2, sys.stderr)):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:  # as CPython chooses at its start, for the new stream
            reconfigure(line_buffering=number == 2 or os.isatty(number),
                        write_through=unbuffered)


def _signals(ignored: Iterable[int], mask: Iterable[int]) -> None:
    signal.set_wakeup_fd(-1)
    ignore = {int(s) for s in ignored}
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        if signum in ignore or signum in _PYTHON_IGNORES:
            handler: Any = signal.SIG_IGN
        elif signum == signal.SIGINT:
            handler = signal.default_int_handler
        else:
            handler = signal.SIG_DFL
        try:
            signal.signal(signum, handler)
        except (OSError, ValueError):
            pass  # a real-time signal Python does not let one set
    signal.pthread_sigmask(signal.SIG_SETMASK, {int(s) for s in mask})


def _fresh_state(cpus: set[int]) -> None:
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # from the OS's entropy, as a fresh import seeds it
    torch = sys.modules.get("torch")
    if torch is not None:
        wanted = os.environ.get("OMP_NUM_THREADS", "")
        threads = int(wanted) if wanted.isdigit() and int(wanted) > 0 else len(cpus)
        if threads:
            torch.set_num_threads(threads)


def _target(name: str) -> Callable[[list[str]], Any]:
    module, _, function = name.partition(":")
    found = getattr(importlib.import_module(module), function)
    if not callable(found):
        raise TypeError(f"{name} is not callable")
    return found  # type: ignore[no-any-return]


def _run(target: Callable[[list[str]], Any], args: list[str]) -> None:
    """The target's return value or SystemExit is the exit code; an exception is printed as
    Python prints it (from the target's frames on) and exits 1; an unhandled Ctrl-C ends the
    process by SIGINT, as Python does."""
    try:
        code = exit_code(target(args))
    except SystemExit as exc:
        code = exit_code(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException as exc:  # noqa: B036 (Python's own top level)
        tb = exc.__traceback__
        traceback.print_exception(type(exc), exc, tb.tb_next if tb is not None else None)
        code = 1
    leave(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
