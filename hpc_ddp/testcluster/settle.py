"""Back to an empty queue and idle nodes between two tests, and what it took to get there.

A test that leaves a job behind (a requeued job waits about two minutes for its begin time,
then runs again) or a node drained or down makes every later test wait for nodes it cannot
have, and fail for a reason that is not its own. ``settle`` gives the running jobs a grace
period to end by themselves, then cancels what is left, resumes nodes that are drained or
down, and says what it found, so that the test that left it is the one that fails.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping, Sequence

from hpc_ddp.testcluster import daemons

# sinfo %t states that pass by themselves once the queue is empty (``comp``: an epilogue);
# any state but ``idle`` and these (drain, down, ...) needs a hand.
_BUSY = {"alloc", "mix", "comp"}


def _slurm(args: list[str], env: Mapping[str, str]) -> str:
    """What a Slurm client prints; nothing when it fails or cannot be reached."""
    try:
        done = daemons.run(args, env, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
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


def _wait(done: Callable[[], bool], timeout_s: float) -> bool:
    try:
        daemons.wait_until(done, timeout_s, "the cluster to settle", every=0.5)
    except daemons.DaemonError:
        return False
    return True


def settle(env: Mapping[str, str], nodes: Sequence[str], grace_s: float = 30.0) -> list[str]:
    """Empty the queue and idle ``nodes``; returns what had to be done (empty: nothing)."""
    found: list[str] = []
    if not _wait(lambda: not jobs(env), grace_s):
        left = jobs(env)
        found.append(f"jobs still queued {grace_s:.0f}s after the test: {'; '.join(left)} "
                     "(cancelled)")
        ids = sorted({entry.split()[0].split("_")[0] for entry in left})
        _slurm(["scancel", *ids], env)
        _wait(lambda: not jobs(env), grace_s)

    def odd() -> dict[str, tuple[str, str]]:
        states = node_states(env)
        return {n: states.get(n, ("missing", "")) for n in nodes
                if states.get(n, ("missing", ""))[0] != "idle"}

    # A node finishing a job's epilogue is idle in a moment; one drained or down is not.
    _wait(lambda: not any(state in _BUSY for state, _ in odd().values()), grace_s)
    bad = odd()
    if bad:
        found.append("nodes not idle: " + ", ".join(
            f"{n} {state}" + (f" ({reason})" if reason and reason != "none" else "")
            for n, (state, reason) in sorted(bad.items())) + " (resumed)")
        for node in bad:
            _slurm(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env)
        _wait(lambda: not odd(), grace_s)
    return found
