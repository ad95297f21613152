"""A remote run's results on the laptop: ``python -m hpc_ddp.collect HANDLE [--checkpoint]``.

The laptop sends what it has (each file's size and time) on the connection's standard input;
hpc_ddp on the login node answers with a tar stream of what is new or has grown since (one
round trip over the handle's SSH connection): the summary, the events, progress, config,
TensorBoard files, every rank's log and its mapping, into the handle's own folder. A second
collect copies only what changed, so it can run again and again while the run trains.
Checkpoints stay on the cluster; ``--checkpoint`` adds one plain file of the latest
(``exported/model.pt``, hpc_ddp/checkpoint.py), made there again only when a newer
checkpoint exists.

Both sides are here: :func:`collect` (:func:`receive`) on the laptop, :func:`main`
(:func:`send`) on the login node (``python -m hpc_ddp.remote.results RUN_DIR``). Neither trusts
the other's folder: the login node sends only this user's files that no one else can write (a
shared runs/ folder may hold anyone's), and the laptop writes only what that side sends, never
through a link and never its own records (``remote.json`` says which host the next command
connects to, with which ssh_config), docs/security.md.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import shlex
import shutil
import stat
import sys
import tarfile
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TextIO

from hpc_ddp.errors import USAGE_EXIT_CODE, UserError
from hpc_ddp.owned import Untrusted, check_folder, check_stat, open_owned, who
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
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def _skipped_dir(name: str) -> bool:
    return name in SKIPPED_DIRS or name.startswith(".")


def _skipped_file(name: str) -> bool:
    return name in SKIPPED_FILES or name.startswith(".") or name.endswith(SKIPPED_SUFFIXES)


def skipped(rel: str) -> bool:
    """Whether ``rel`` (a "/"-separated path in a run dir) is one a collect never copies: the
    one rule of both sides, the login node as it sends and the laptop as it receives (a
    ``remote.json`` or a pickle at any depth)."""
    *dirs, name = rel.split("/")
    return any(map(_skipped_dir, dirs)) or _skipped_file(name)


def _why_not(info: os.stat_result, path: Path) -> str | None:
    """Why the login node does not send ``path`` (None: it does): someone else's, or writable
    by someone else (hpc_ddp/owned.py's rule)."""
    try:
        check_stat(info, path)
    except Untrusted:
        return "not yours" if info.st_uid != os.geteuid() else "writable by others"
    return None


def results(root: Path, left_out: Counter[str] | None = None) -> Iterator[Path]:
    """The files of a run (or of every point of a sweep) that a collect copies. With
    ``left_out`` (the login node's side): only this user's, writable by no one else, in folders
    alike (a folder that is not is never entered); what is passed over is counted there."""
    for folder, dirs, files in os.walk(root):  # links to folders are never entered
        kept = []
        for name in sorted(d for d in dirs if not _skipped_dir(d)):
            try:
                info = os.lstat(Path(folder) / name)
            except FileNotFoundError:
                continue  # gone since the listing
            if stat.S_ISLNK(info.st_mode):
                continue
            if left_out is not None and (why := _why_not(info, Path(folder) / name)):
                left_out[f"folder(s) {why}"] += 1
                continue
            kept.append(name)
        dirs[:] = kept
        for name in sorted(files):
            path = Path(folder) / name
            if _skipped_file(name):
                continue
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                continue  # gone since the listing
            if not stat.S_ISREG(info.st_mode):
                continue  # a link or a FIFO is no result
            if left_out is not None and (why := _why_not(info, path)):
                left_out[f"file(s) {why}"] += 1
                continue
            yield path


def manifest(root: Path, left_out: Counter[str] | None = None) -> Manifest:
    """What a folder holds: each result's size and modification time (whole seconds, as a
    tar member keeps it)."""
    if not root.is_dir():
        return {}
    found: Manifest = {}
    for path in results(root, left_out):
        info = os.lstat(path)
        found[path.relative_to(root).as_posix()] = (info.st_size, int(info.st_mtime))
    return found


def changed(root: Path, have: Mapping[str, Sequence[int]],
            left_out: Counter[str] | None = None) -> list[Path]:
    """The results under ``root`` that ``have`` (the laptop's manifest) lacks or has older;
    with ``left_out``, only those :func:`results` sends (counted there, what it does not)."""
    now = manifest(root, left_out)
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


def send(root: Path, have: Mapping[str, Sequence[int]], stream: IO[bytes],
         left_out: Counter[str] | None = None) -> int:
    """The login node's side: a tar stream of the changed results of this user (what is left
    out is counted in ``left_out``); returns how many. Each file is read from the descriptor
    :func:`hpc_ddp.owned.open_owned` checked, so no other file takes its place in between."""
    left_out = Counter() if left_out is None else left_out
    sent = 0
    with tarfile.open(fileobj=stream, mode="w|") as tar:
        for path in changed(root, have, left_out):
            try:
                with open_owned(path, root) as data:
                    info = tar.gettarinfo(arcname=path.relative_to(root).as_posix(),
                                          fileobj=data)
                    tar.addfile(info, data)
            except FileNotFoundError:
                continue  # gone since the listing
            except Untrusted:
                left_out["file(s) changed hands since the listing"] += 1
                continue
            sent += 1
    return sent


def left_out_line(root: Path, left_out: Counter[str]) -> str:
    """The one line the login node writes (the laptop shows it) when it left files out."""
    counts = ", ".join(f"{n} {what}" for what, n in sorted(left_out.items()))
    return (f"hpc_ddp: collect left out of {root}: {counts}. Only your own files, writable by "
            "no one else, are sent (a shared runs/ folder may hold others'; docs/security.md).")


def _run_dir_checked(run_dir: Path) -> None:
    """UserError unless ``run_dir`` is a folder of this user's that no one else can write: its
    files could be anyone's otherwise, and none is sent."""
    if not run_dir.is_dir():
        raise UserError("run_dir", str(run_dir), "there is no such folder on the cluster.",
                        "check the handle's remote_dir (remote.json).")
    try:
        check_folder(run_dir)
    except Untrusted:
        info = os.stat(run_dir)
        whose = (f"is not yours (it belongs to {who(info.st_uid)})"
                 if info.st_uid != os.geteuid() else
                 f"is writable by others (mode {stat.S_IMODE(info.st_mode):o})")
        raise UserError("run_dir", str(run_dir), f"{whose}: its files could be anyone's, so "
                        "none is sent.", "collect only a run you made; if it is yours, chmod "
                        f"go-w {shlex.quote(str(run_dir))} there (docs/security.md).") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.remote.results",
                                     description="(run by collect over SSH) " + __doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--checkpoint", action="store_true")
    args = parser.parse_args(argv)
    try:
        _run_dir_checked(args.run_dir)
        if args.checkpoint:
            export_latest(args.run_dir)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    have = json.loads(sys.stdin.read() or "{}")
    left_out: Counter[str] = Counter()
    send(args.run_dir, have, sys.stdout.buffer, left_out)
    sys.stdout.buffer.flush()
    if left_out:
        print(left_out_line(args.run_dir, left_out), file=sys.stderr)
    return 0


@dataclass(frozen=True)
class Received:
    files: int = 0
    bytes: int = 0
    passed_over: list[str] = field(default_factory=list)  # names the login node never sends


def _refused(folder: Path, name: str, why: str) -> UserError:
    return UserError("HANDLE", str(folder), f"the cluster's results stream holds {name!r}, "
                     f"{why}; the stream was refused there (nothing outside the folder was "
                     "written).", "a collect never sends such a name: check the login node "
                     "and the run dir there (remote.json's host and remote_dir).")


def receive(stream: IO[bytes], folder: Path) -> Received:
    """The laptop's side: the files of a results stream into ``folder``. A name out of the
    folder refuses the stream (UserError); a name the login node never sends (:func:`skipped`:
    the handle's own remote.json among them) is passed over; a link already in the folder is
    never written through (tarfile's "data" filter follows one that stays inside it)."""
    count = size = 0
    passed_over: list[str] = []
    top = os.open(folder, _FOLDER)
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                name = member.name
                if name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")):
                    raise _refused(folder, name, "a path out of the folder or not plain")
                try:
                    tarfile.data_filter(member, str(folder))
                except tarfile.FilterError as exc:
                    raise _refused(folder, name, str(exc)) from None
                if not member.isfile():
                    continue
                if skipped(name):
                    passed_over.append(name)
                    continue
                data = tar.extractfile(member)
                assert data is not None  # a regular file's
                try:
                    _write(top, folder, name, data, member.mtime)
                except OSError as exc:  # a folder of that name, a full disk
                    raise UserError("HANDLE", str(folder), f"cannot write {name!r} there "
                                    f"({exc.strerror}).", "make room for it (a folder of "
                                    "that name? a full disk?), and collect again.") from None
                count, size = count + 1, size + member.size
    except tarfile.ReadError:
        pass  # no stream (the remote command failed before it wrote one), or its end lost
    finally:
        os.close(top)
    return Received(count, size, passed_over)


def _write(top: int, folder: Path, rel: str, data: IO[bytes], mtime: float) -> None:
    """``rel`` below the folder open as ``top``, each folder on the way opened without
    following a link (``O_NOFOLLOW``), the file written aside and renamed into place: a link
    of that name is replaced, never followed."""
    *dirs, name = rel.split("/")
    fd = os.dup(top)
    try:
        for below in dirs:
            with contextlib.suppress(FileExistsError):
                os.mkdir(below, 0o750, dir_fd=fd)
            try:
                opened = os.open(below, _FOLDER | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise UserError("HANDLE", str(folder), f"{rel}: {below} here is a link or not "
                                "a folder, and a collect writes through none.", "remove it, "
                                "and collect again.") from None
            os.close(fd)
            fd = opened
        aside = f".{name}.{os.getpid()}.tmp"  # a dotfile: never a result itself
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside, dir_fd=fd)
        out = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                      | os.O_CLOEXEC, 0o640, dir_fd=fd)
        try:
            with os.fdopen(out, "wb") as written:
                shutil.copyfileobj(data, written)
                written.flush()
                os.utime(written.fileno(), (mtime, mtime))  # the manifest compares it
            os.replace(aside, name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:  # a stream cut short: no half file left behind
            with contextlib.suppress(OSError):
                os.unlink(aside, dir_fd=fd)
            raise
    finally:
        os.close(fd)


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
    with ssh.opened(line, have) as (proc, err):
        assert proc.stdout is not None
        got = receive(proc.stdout, folder)
        code, text = proc.wait(), said(err)
    if code == SSH_FAILED:
        raise failure(record.host, text)
    if code != 0:
        last = text.strip().splitlines()[-1:] or [f"exit {code}"]
        raise UserError("HANDLE", str(folder), f"the cluster could not send the results "
                        f"({last[0].removeprefix('error: ')}).",
                        "check the run there: python -m hpc_ddp.status "
                        f"{shlex.quote(str(folder))}.")
    sys.stderr.write(text)  # the login node's own line: what it left out, and why
    if got.passed_over:
        print(f"hpc_ddp: collect passed over {len(got.passed_over)} file(s) the cluster sent "
              f"that a collect never writes ({', '.join(map(repr, got.passed_over[:3]))}): "
              "check the login node (remote.json's host).", file=sys.stderr)
    return Collected(got.files, got.bytes, folder)


def report(done: Collected, out: TextIO) -> None:
    tb = done.folder / "tb"
    print(f"collected {done.files} new or grown file(s) ({done.bytes / 1024:.0f} KiB) into "
          f"{done.folder}" + (f"; tensorboard --logdir {tb}" if tb.is_dir() else ""), file=out)


if __name__ == "__main__":
    sys.exit(main())
