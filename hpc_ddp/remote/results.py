"""A remote run's results on the laptop: ``python -m hpc_ddp.collect HANDLE [--checkpoint]``.

The laptop sends what it has (each file's size and time) on the connection's standard input;
hpc_ddp on the login node answers with a tar stream of what is new or has grown since (one
round trip over the handle's SSH connection): the summary, the events, progress, config,
TensorBoard files, every rank's log and its mapping, into the handle's own folder. A second
collect copies only what changed, so it can run again and again while the run trains.
Checkpoints stay on the cluster; ``--checkpoint`` adds one plain file of the latest
(``exported/model.pt``, hpc_ddp/checkpoint.py), made there again only when a newer
checkpoint exists.

Both sides are here: :func:`collect` on the laptop, :func:`main` on the login node
(``python -m hpc_ddp.remote.results RUN_DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TextIO

from hpc_ddp.errors import UserError
from hpc_ddp.remote import handle as handles
from hpc_ddp.remote.ssh import SSH_FAILED, Ssh, command_line, control_dir, failure, said
from hpc_ddp.rundir import RunDir

# Never copied: checkpoints (large; --checkpoint exports one file), submitit's pickles, the
# rendezvous files, and the records --stop/--cancel act on (job.json, sweep.json: on the
# laptop, the handle stands for them).
SKIPPED_DIRS = frozenset({"checkpoints", "submitit", "rendezvous", "__pycache__"})
SKIPPED_FILES = frozenset({"job.json", "sweep.json", handles.FILE})
SKIPPED_SUFFIXES = (".pkl", ".pickle", ".tmp", ".lock")
EXPORTED = Path("exported") / "model.pt"

Manifest = dict[str, tuple[int, int]]  # relative path -> (size, whole seconds of its mtime)


def results(root: Path) -> Iterator[Path]:
    """The files of a run (or of every point of a sweep) that a collect copies."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(files):
            path = Path(folder) / name
            if (name in SKIPPED_FILES or name.startswith(".") or name.endswith(SKIPPED_SUFFIXES)
                    or not path.is_file() or path.is_symlink()):
                continue
            yield path


def manifest(root: Path) -> Manifest:
    """What a folder holds: each result's size and modification time (whole seconds, as a
    tar member keeps it)."""
    if not root.is_dir():
        return {}
    found: Manifest = {}
    for path in results(root):
        stat = path.stat()
        found[path.relative_to(root).as_posix()] = (stat.st_size, int(stat.st_mtime))
    return found


def changed(root: Path, have: Mapping[str, Sequence[int]]) -> list[Path]:
    """The results under ``root`` that ``have`` (the laptop's manifest) lacks or has older."""
    now = manifest(root)
    return [root / rel for rel, seen in now.items() if tuple(have.get(rel, ())) != seen]


def export_latest(root: Path) -> None:
    """``exported/model.pt`` from the newest checkpoint, unless it is from that one already."""
    from hpc_ddp.checkpoint import chosen, export  # deferred (start-up): checkpoint

    source = chosen(RunDir(root.absolute()), None)
    out = root / EXPORTED
    if out.is_file() and out.stat().st_mtime >= source.stat().st_mtime:
        return
    out.parent.mkdir(exist_ok=True)
    export(root, out, force=True)


def send(root: Path, have: Mapping[str, Sequence[int]], stream: IO[bytes]) -> int:
    """The login node's side: a tar stream of the changed results; returns how many."""
    files = changed(root, have)
    with tarfile.open(fileobj=stream, mode="w|") as tar:
        for path in files:
            tar.add(path, arcname=path.relative_to(root).as_posix(), recursive=False)
    return len(files)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.remote.results",
                                     description="(run by collect over SSH) " + __doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--checkpoint", action="store_true")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"error: run_dir={args.run_dir}: there is no such folder on the cluster. Fix: "
              "check the handle's remote_dir (remote.json).", file=sys.stderr)
        return 2
    try:
        if args.checkpoint:
            export_latest(args.run_dir)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    have = json.loads(sys.stdin.read() or "{}")
    send(args.run_dir, have, sys.stdout.buffer)
    sys.stdout.buffer.flush()
    return 0


@dataclass(frozen=True)
class Collected:
    files: int
    bytes: int
    folder: Path


def collect(folder: Path, checkpoint: bool = False,
            environ: Mapping[str, str] = os.environ) -> Collected:
    """The laptop's side: the remote run's new results into ``folder`` (its handle)."""
    record = handles.read(folder)
    if record is None:
        raise UserError("HANDLE", str(folder), f"is not a remote run's handle (no "
                        f"{handles.FILE}).", "pass the local run dir a remote submit printed.")
    ssh = Ssh(record.host, control_dir(environ), record.ssh_config)
    have = json.dumps(manifest(folder)).encode()
    line = command_line([*record.python, "-m", "hpc_ddp.remote.results", record.remote_dir,
                         *(["--checkpoint"] if checkpoint else [])])
    count = size = 0
    with ssh.opened(line, have) as (proc, err):
        assert proc.stdout is not None
        try:
            with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    # the data filter refuses absolute paths, "..", links out of the folder
                    tar.extract(member, folder, filter="data")
                    count, size = count + 1, size + member.size
        except tarfile.ReadError:
            pass  # no stream: the remote command failed before it wrote one (said below)
        code, text = proc.wait(), said(err)
    if code == SSH_FAILED:
        raise failure(record.host, text)
    if code != 0:
        last = text.strip().splitlines()[-1:] or [f"exit {code}"]
        raise UserError("HANDLE", str(folder), f"the cluster could not send the results "
                        f"({last[0].removeprefix('error: ')}).",
                        "check the run there: python -m hpc_ddp.status "
                        f"{folder}.")
    return Collected(count, size, folder)


def report(done: Collected, out: TextIO) -> None:
    tb = done.folder / "tb"
    print(f"collected {done.files} new or grown file(s) ({done.bytes / 1024:.0f} KiB) into "
          f"{done.folder}" + (f"; tensorboard --logdir {tb}" if tb.is_dir() else ""), file=out)


if __name__ == "__main__":
    sys.exit(main())
