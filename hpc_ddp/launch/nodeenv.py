"""Activate ``cluster.venv`` or ``cluster.conda_env`` on every node, right before the task.

``cluster.setup`` lines run once, in the batch script on the first node; an environment made
there reaches the other nodes only as exported variables, and a node where it does not exist
fails with a bare "execve: No such file". Here every task starts as ``sh -c SCRIPT`` on its
own node (inside the container, when there is one): the script activates the environment
and execs the task, or exits 2 with one line naming the node, also written as the rank's
error file, which ``follow`` and ``status`` show.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from hpc_ddp.config.schema import ClusterConfig

# $0 of the wrapper, as `ps` shows it.
NAME = "hpc_ddp-env"

# POSIX sh (dash, busybox): `fail` says what is wrong and where, and exits 2 (bad input).
_FAIL = r"""node=${SLURMD_NODENAME:-$(uname -n)}
fail() {
  msg="$1 on node $node."
  echo "hpc_ddp: $msg Fix: $2" >&2
  if [ -n "$errors" ] && mkdir -p "$errors" 2>/dev/null; then
    printf "rank %s on %s: %s Fix: %s\n" "${SLURM_PROCID:-0}" "$node" "$msg" "$2" \
      > "$errors/rank${SLURM_PROCID:-0}.error"
  fi
  exit 2
}
"""

_VENV = r"""[ -f "$env/bin/activate" ] || fail \
  "cluster.venv=$env: no virtual environment there (no bin/activate)" \
  "create it there (python -m hpc_ddp.env venv $env), or give the right folder."
. "$env/bin/activate" || fail "cluster.venv=$env: its bin/activate failed" \
  "recreate it (python -m hpc_ddp.env venv $env)."
"""

# conda's own activation (https://docs.conda.io/projects/conda/en/latest/dev-guide/deep-dives/activation.html):
# the shell function from `conda shell.posix hook`, then `conda activate`, in this shell.
_CONDA = r"""conda=${CONDA_EXE:-conda}
command -v "$conda" >/dev/null 2>&1 || fail \
  "cluster.conda_env=$env: no conda (not on PATH, CONDA_EXE unset)" \
  "install conda there, or make it reachable (e.g. module load in cluster.setup)."
hook=$("$conda" shell.posix hook) || fail \
  "cluster.conda_env=$env: 'conda shell.posix hook' failed" "check conda's installation there."
eval "$hook"
conda activate "$env" 2>/dev/null || fail \
  "cluster.conda_env=$env: conda has no such environment there" \
  "create it there (python -m hpc_ddp.env conda $env), or give the right name or folder."
"""


def wanted(c: ClusterConfig) -> bool:
    return c.venv is not None or c.conda_env is not None


def script(c: ClusterConfig, errors: Path | None) -> str:
    """The wrapper's text: activate, then ``exec "$@"`` (the task's own command line)."""
    env = c.venv if c.venv is not None else c.conda_env
    assert env is not None
    body = _VENV if c.venv is not None else _CONDA
    return (f"env={shlex.quote(env)}\nerrors={shlex.quote(str(errors) if errors else '')}\n"
            f"{_FAIL}{body}exec \"$@\"\n")


def wrapper(c: ClusterConfig, errors: Path | None) -> list[str]:
    """The argv before the task's command (``[]`` when no environment is asked for).
    ``errors``: the run's logs folder, where a failed activation leaves rank<N>.error."""
    if not wanted(c):
        return []
    return ["/bin/sh", "-c", script(c, errors), NAME]
