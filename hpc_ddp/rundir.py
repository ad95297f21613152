"""The run directory: one place for config, logs, TensorBoard, checkpoints and results.

    run_dir/
      config.yaml        the resolved config;  overrides.yaml  the command-line overrides
      logs/rank<N>.log   one log per rank;  logs/rank<N>.error  the failure of a rank, if any
      tb/                TensorBoard events (rank 0)
      checkpoints/       step_*.pt and the `latest` pointer (rank 0)
      ranks/rank<N>.json each rank's mapping, host, addresses and NCCL/torch environment
      progress.json      the latest step, loss and speed (rank 0), for `wait` and status
      summary.json       results at the end (rank 0)
      rendezvous/        rank 0's published address and port per job attempt
      submitit/          submitit's job folder (pickles, stdout/stderr)

Made with ``cluster.umask`` (027 by default: group-readable, never writable by anyone else):
checkpoints and pickles in it are loaded only if no one else could have written them
(hpc_ddp/rank/services/trusted.py, docs/run-directory.md).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def overrides(self) -> Path:
        return self.root / "overrides.yaml"

    @property
    def hparams(self) -> Path:
        # A sweep point's swept values, written before the point starts.
        return self.root / "hparams.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def tb(self) -> Path:
        return self.root / "tb"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def ranks(self) -> Path:
        return self.root / "ranks"

    @property
    def progress(self) -> Path:
        return self.root / "progress.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def rendezvous(self) -> Path:
        return self.root / "rendezvous"

    @property
    def submitit(self) -> Path:
        return self.root / "submitit"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def rank_error(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.error"

    def rank_usage(self, rank: int) -> Path:
        """The CPU time a rank used, written at its exit (hpc_ddp/watch/runcost.py reads it)."""
        return self.ranks / f"rank{rank}{USAGE_SUFFIX}"


USAGE_SUFFIX = ".usage.json"


def rank_records(ranks_dir: Path) -> list[Path]:
    """Every rank's record (``rank<N>.json``, rank order) in a run's ranks folder; not the
    usage files beside them."""
    found = []
    for path in ranks_dir.glob("rank*.json"):
        number = path.name[len("rank"):-len(".json")]
        if number.isdigit():
            found.append((int(number), path))
    return [path for _, path in sorted(found)]


def resume_command(root: Path | str) -> str:
    """The command that continues the run in ``root``, quoted for a shell."""
    return f"python -m hpc_ddp.submit {shlex.quote(f'run_dir={root}')} resume=true"


def default_root(base: Path, now: _dt.datetime | None = None, job_id: str | None = None) -> Path:
    """outputs/<date>_<time> for a submission; outputs/job-<id> for a task started by sbatch."""
    if job_id:
        return base / f"job-{job_id}"
    stamp = (now or _dt.datetime.now()).strftime("%Y-%m-%d_%H-%M-%S-%f")[:-3]
    return base / stamp


def parse_umask(value: str | int) -> int:
    """``cluster.umask`` as a number: "027", "27", "0o027" and 27 (as YAML reads 027) are the
    same; ValueError for one that is not octal, that lets group or others write (0o022 must
    be in it), or that takes the owner's own rights away."""
    text = str(value).strip().lower().removeprefix("0o")
    mask = int(text, 8)  # ValueError for 8, 9 and letters
    if not 0 <= mask <= 0o777 or mask & 0o022 != 0o022 or mask & 0o700:
        raise ValueError(f"umask {value}")
    return mask


@contextmanager
def created_with(umask: str | int) -> Iterator[None]:
    """Files and folders made meanwhile get ``umask`` (cluster.umask); the process's own is
    put back after. Processes started meanwhile inherit it: the local ranks, and sbatch,
    which hands it to the job (SLURM_UMASK, https://slurm.schedmd.com/sbatch.html)."""
    previous = os.umask(parse_umask(umask))
    try:
        yield
    finally:
        os.umask(previous)


def fsync_dir(folder: Path) -> None:
    """Make a rename or creation in ``folder`` durable (its entry list on disk)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[Any], None],
                 check: Callable[[Path], None] | None = None, durable: bool = True,
                 private: bool = False) -> None:
    """``write(fileobj)`` into a temp file beside ``path``, fsync, ``check(temp path)``, then
    rename onto it (atomic on POSIX: a reader sees the old file or the new one, never half).
    ``durable`` false: no fsync (a file rewritten every second, whose loss in a crash costs
    nothing). (Through a Python file object: a write error is the OSError that says why,
    ENOSPC or EACCES, which torch's own file writer does not keep.) ``private``: readable by
    this user alone (mode 600) from the moment the file exists, whatever the umask."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)  # a crashed writer's, whose mode would be kept
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        with open(os.open(tmp, flags, 0o600 if private else 0o666), "wb") as handle:
            write(handle)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        if check is not None:
            check(tmp)
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str, durable: bool = False, private: bool = False) -> None:
    """Atomically replace ``path`` with ``text`` (write_atomic)."""
    write_atomic(path, lambda handle: handle.write(text.encode()), durable=durable,
                 private=private)


def write_json(path: Path, data: Any) -> None:
    """Atomically replace ``path`` with ``data`` as JSON (readers never see half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
