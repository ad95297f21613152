"""A rank's stderr without the one line torch prints on every Slurm rank for nothing.

When a TCPStore client connects, torch (c10d socket.cpp, 2.14) formats the socket's address
for a log line and asks the resolver for its name (getnameinfo); the address it passes is not
the IPv4 address the socket uses (the log line itself shows it garbled, e.g.
``[100::e073:819f:7a7f:0]``), so on nodes whose names live in /etc/hosts, or whose resolver
does not answer, the lookup fails and torch warns on stderr::

    [W... socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3

The connection is fine; nothing can be done about it from Python, and silencing torch's C++
warnings altogether (TORCH_CPP_LOG_LEVEL=ERROR) would hide the ones that matter. So that line,
and only that line, is filtered: fd 2 of the rank becomes a pipe into ``grep -v`` of it,
which writes everything else to where stderr went. The filter ignores the signals a stop sends
(SIGTERM, the requeue signal): it ends when the last writer has closed the pipe, so a dying
rank's last words still come through.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

NOISE = "The hostname of the client socket cannot be retrieved"
_installed: list[int] = []  # the pid whose stderr is filtered (once per process, not in a fork)


# The filter must outlive a stop: ignored dispositions survive exec (trap "" in sh).
_IGNORED = "TERM INT HUP USR1 USR2 CONT"
_processes: list[subprocess.Popen[bytes]] = []


def filter_stderr() -> bool:
    """Route this process's fd 2 through the filter; False where it cannot (no grep, no fd 2)."""
    if os.getpid() in _installed:
        return True
    grep = shutil.which("grep")
    if grep is None:
        return False
    try:
        target = os.dup(2)
    except OSError:
        return False
    read, write = os.pipe()
    # Blocked while the filter starts: a stop signal in that moment waits for this process
    # (delivered right after), and cannot kill the filter before its trap ignores it.
    stops = {getattr(signal, f"SIG{name}") for name in _IGNORED.split()}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    try:
        _processes.append(subprocess.Popen(
            ["sh", "-c", f'trap "" {_IGNORED}; exec "$0" --line-buffered -v -F -e "$1"', grep,
             NOISE], stdin=read, stdout=target, stderr=target, close_fds=True))
    except OSError:
        os.close(read)
        os.close(write)
        os.close(target)
        return False
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.dup2(write, 2)  # Python's sys.stderr writes to fd 2 too
    for fd in (read, write, target):
        os.close(fd)
    _installed.append(os.getpid())
    return True
