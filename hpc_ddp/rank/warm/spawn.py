"""A supervisor's training process (rank/supervise/supervisor.py), forked from the node's warm
process instead of started as ``python -m hpc_ddp.rank.main.script_runner ...``: the built-in
trainer, a function entry or a user's script, each generation of it (a restart in place is
warm too). As Popen would have started it: the supervisor's stdout and stdin, a pipe for its
stderr (the supervisor keeps its last lines), a process group of its own, the signals the
supervisor blocks for it blocked, and the signals the supervisor ignores ignored.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from collections.abc import MutableMapping, Sequence

from hpc_ddp.rank.contract import WARM_NOTE_ENV
from hpc_ddp.rank.warm import client
from hpc_ddp.rank.warm.client import WarmProc

# The one program a supervisor runs (supervise/program.py and script.py both start it).
RUNNER = "hpc_ddp.rank.main.script_runner"


def forked_child(argv: Sequence[str], env: MutableMapping[str, str],
                 blocked: frozenset[int]) -> WarmProc | None:
    """The child forked, or None (then ``env`` says why it starts cold)."""
    if list(argv[:3]) != [sys.executable, "-m", RUNNER]:
        env[WARM_NOTE_ENV] = "cold: a command of its own (a container's interpreter)"
        return None
    link = client.this_process(env)
    if isinstance(link, str):
        env[WARM_NOTE_ENV] = link
        return None
    spec = importlib.util.find_spec(RUNNER)
    argv0 = spec.origin if spec is not None and spec.origin else RUNNER
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, []) | set(blocked)
    read, write = os.pipe()
    stderr = os.fdopen(read, "rb")
    try:
        return link.spawn(f"{RUNNER}:main", argv[3:], [argv0, *argv[3:]], env, (0, 1, write),
                          pgid=0, sigmask=sorted(mask), ignored=client.ignored_signals(),
                          stderr=stderr, title=argv)
    except OSError as exc:
        stderr.close()
        env[WARM_NOTE_ENV] = f"cold: the warm process did not fork it: {exc}"
        return None
    finally:
        os.close(write)
