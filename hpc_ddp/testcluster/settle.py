"""Back to an empty queue and idle nodes between two tests, and what it took to get there.

A test that leaves a job behind (a requeued job waits about two minutes for its begin time,
then runs again) or a node drained or down makes every later test wait for nodes it cannot
have, and fail for a reason that is not its own. ``settle`` gives the running jobs a grace
period to end by themselves, then cancels what is left, resumes nodes that are drained or
down, and says what it found, so that the test that left it is the one that fails.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

# sinfo %t states a node is usable in once the queue is empty (``comp``: a job's epilogue).
_SETTLED = {"idle"}
_BUSY = {"alloc", "mix", "comp"}


def _slurm(args: Sequence[str], env: Mapping[str, str]) -> str:
    done = subprocess.run(list(args), env=dict(env), capture_output=True, text=True, timeout=30)
    return done.stdout if done.returncode == 0 else ""


def jobs(env: Mapping[str, str]) -> list[str]:
    """``JOBID STATE REASON`` of every job in the queue, one string each."""
    out = _slurm(["squeue", "-h", "-o", "%i %T %r"], env)
    return [line.strip() for line in out.splitlines() if line.strip()]


def node_states(env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """node -> (sinfo %t without its flag characters, the reason Slurm gives, if any)."""
    out = _slurm(["sinfo", "-h", "-N", "-o", "%N|%t|%E"], env)
    found = {}
    for line in out.splitlines():
        name, _, rest = line.partition("|")
        state, _, reason = rest.partition("|")
        found[name] = (state.strip().rstrip("*~#!%$@^-"), reason.strip())
    return found


def _wait(done: Callable[[], bool], timeout_s: float, every_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True


def settle(env: Mapping[str, str], nodes: Sequence[str], grace_s: float = 30.0) -> list[str]:
    """Empty the queue and idle ``nodes``; returns what had to be done (empty: nothing)."""
    found: list[str] = []
    if not _wait(lambda: not jobs(env), grace_s):
        left = jobs(env)
        found.append(f"jobs still queued {grace_s:.0f}s after the test: {'; '.join(left)} "
                     "(cancelled)")
        ids = sorted({entry.split()[0].split("_")[0] for entry in left})
        subprocess.run(["scancel", *ids], env=dict(env), capture_output=True, timeout=30)
        _wait(lambda: not jobs(env), grace_s)

    def odd() -> dict[str, tuple[str, str]]:
        states = node_states(env)
        return {n: states.get(n, ("missing", "")) for n in nodes
                if states.get(n, ("missing", ""))[0] not in _SETTLED}

    # A node finishing a job's epilogue is idle in a moment; one drained or down is not.
    _wait(lambda: not any(state in _BUSY for state, _ in odd().values()), grace_s)
    bad = odd()
    if bad:
        found.append("nodes not idle: " + ", ".join(
            f"{n} {state}" + (f" ({reason})" if reason and reason != "none" else "")
            for n, (state, reason) in sorted(bad.items())) + " (resumed)")
        for node in bad:
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"],
                           env=dict(env), capture_output=True, timeout=30)
        _wait(lambda: not odd(), grace_s)
    return found
