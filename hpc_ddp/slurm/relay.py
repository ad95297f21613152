"""Slurm's commands for ranks that cannot run them: inside a container (pyxis, Apptainer,
Podman) the image has no ``scontrol`` or ``squeue``, and Slurm's client libraries and munge
socket are the host's. The part of the job outside the container runs them instead.

The batch script (outside, on the first node) starts :data:`RELAY` in the background before
srun and exports its folder as ``HPC_DDP_SLURM_RELAY``; a step of an allocation does the same
around its srun. A rank that would run ``scontrol requeue`` or ``squeue`` writes the command
as a request file there; the relay runs it and writes its exit code, stdout and stderr back.
Requests are rare (a stop, a failure, a run-dir check: a few per job, by rank 0 mostly), the
relay looks once a second, and it serves only the commands hpc_ddp uses there (a requeue,
squeue, a signal to the rank's own step: rank/services/lost_signal.py).
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpc_ddp.rundir import write_text

log = logging.getLogger(__name__)

RELAY_ENV = "HPC_DDP_SLURM_RELAY"
# sh: the command in "$@", with SIGTERM ignored (inherited across exec).
_NO_TERM = 'trap "" TERM; exec "$@"'
_FIRST_POLL_S = 0.05
_MAX_POLL_S = 1.0

# POSIX sh. $1: the request folder; $2: the pid it serves (the batch shell, or srun): the
# relay ends after it. TERM is ignored: when `scontrol requeue` ends the job, Slurm signals
# the batch script's processes, and the relay must still write the answer the rank waits
# for (SIGKILL follows KillWait seconds later). Only `scontrol requeue`, `squeue` and
# `scancel -s` (a signal, never a cancel) run.
RELAY = r"""hpc_ddp_slurm_relay_one() {
  base=${1%.req}
  set --
  while IFS= read -r arg; do set -- "$@" "$arg"; done < "$base.req"
  case "$1 $2" in
    "scontrol requeue"|"squeue -h"|"scancel -s") "$@" > "$base.out" 2> "$base.err"; rc=$? ;;
    *) echo "hpc_ddp relay: refused: $1 $2" > "$base.err"; : > "$base.out"; rc=2 ;;
  esac
  echo "$rc" > "$base.rc.tmp" && mv "$base.rc.tmp" "$base.rc"
  rm -f "$base.req"
}
hpc_ddp_slurm_relay() {
  trap '' TERM
  mkdir -p "$1" || return
  while kill -0 "$2" 2>/dev/null; do
    for req in "$1"/*.req; do
      [ -f "$req" ] && hpc_ddp_slurm_relay_one "$req"
    done
    sleep 1
  done
}
"""


def run(argv: Sequence[str], environ: Mapping[str, str], timeout_s: float
        ) -> subprocess.CompletedProcess[str]:
    """``argv`` (scontrol/squeue): here, or through the relay when the job has one. Raises
    OSError when the command cannot run and subprocess.TimeoutExpired after ``timeout_s``,
    as subprocess.run does."""
    folder = environ.get(RELAY_ENV)
    if not folder:
        # TERM ignored in the command, as in the relay: the requeue `scontrol requeue` asks
        # for signals every process of the job's steps, this command too, before it has read
        # slurmctld's answer (seen: "exit code -15" for a requeue that took place).
        return subprocess.run(["/bin/sh", "-c", _NO_TERM, "sh", *argv], env=dict(environ),
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    return ask(Path(folder), argv, timeout_s)


def ask(folder: Path, argv: Sequence[str], timeout_s: float
        ) -> subprocess.CompletedProcess[str]:
    """Hand ``argv`` to the relay in ``folder`` and wait for its answer."""
    if any("\n" in arg for arg in argv):
        raise OSError(f"a relayed argument holds a newline: {list(argv)}")
    base = folder / uuid.uuid4().hex
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_text(base.with_suffix(".req"), "".join(f"{arg}\n" for arg in argv))
    except OSError as exc:
        raise OSError(f"cannot write a request for Slurm's relay in {folder}: {exc}") from exc
    deadline = time.monotonic() + timeout_s
    pause = _FIRST_POLL_S
    rc_file = base.with_suffix(".rc")
    while True:
        try:
            # Opening the folder revalidates it on NFS (close-to-open), so the answer another
            # node wrote is seen now, not when the attribute cache expires.
            os.close(os.open(folder, os.O_RDONLY | os.O_DIRECTORY))
            code = rc_file.read_text().strip()
            done = subprocess.CompletedProcess(list(argv), int(code),
                                               _read(base.with_suffix(".out")),
                                               _read(base.with_suffix(".err")))
            for suffix in (".rc", ".out", ".err"):
                base.with_suffix(suffix).unlink(missing_ok=True)
            log.info("relay: %s -> exit %d (run outside the container)", shlex.join(argv),
                     done.returncode)
            return done
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            base.with_suffix(".req").unlink(missing_ok=True)
            raise subprocess.TimeoutExpired(
                list(argv), timeout_s, output=f"no answer from Slurm's relay in {folder}: the "
                "batch script that runs it has ended, or it cannot reach Slurm")
        time.sleep(pause)
        pause = min(_MAX_POLL_S, pause * 1.5)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def start_lines(folder: Path, per_job: bool = True) -> list[str]:
    """Shell lines that start the relay in the background for the shell's life, in
    ``folder``/<job id> (``per_job``: an array's tasks share the script, not the folder)."""
    where = shlex.quote(str(folder)) + ('/"$SLURM_JOB_ID"' if per_job else "")
    return [RELAY.rstrip("\n"), f"export {RELAY_ENV}={where}",
            f'hpc_ddp_slurm_relay "${RELAY_ENV}" $$ &']
