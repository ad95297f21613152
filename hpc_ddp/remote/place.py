"""The login node's side of a remote submit: the folders a run's code and records go in,
checked before anything there is used (``python -P -m hpc_ddp.remote.place ...``, over SSH).

A remote root may sit in a folder a whole group shares (``/srv/project``, mode 1777). What
another user could write on the way to your code would run as you: a ``code/<digest>`` she
made ahead of you (a public tree's digest is predictable), a ``code/`` of hers in which she
swaps your copy for hers, a link where a snapshot should be. So, on every submit and resume:

- the remote root, ``code/``, ``runs/`` and the snapshot are this user's and writable by no
  one else (hpc_ddp/owned.py's rule); ``code/``, ``runs/`` and the snapshot are never
  entered through a link (``O_NOFOLLOW``), the root may be a link to such a folder;
- a snapshot is reused only when its marker (``.complete``: its digest and this user's uid)
  says this user made it whole; a copy is unpacked in a private folder, its archive's
  digest recomputed, and renamed into place; a rename that fails is an error, never a copy
  taken on trust;
- a run's ``job.json`` (which says whether a submit went out) is read only if it is ours.

Run with ``-P`` (no current folder on ``sys.path``): a planted ``hpc_ddp/`` beside it is never
imported. Each command prints one JSON line; bad input is ``{"error": ...}`` and exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import io
import json
import os
import shutil
import stat
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.errors import USAGE_EXIT_CODE, UserError
from hpc_ddp.owned import Untrusted, check_stat, read_owned

MARKER = ".complete"
DIGEST_CHARS = 16  # as hpc_ddp/remote/snapshot.py names a tree
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_SHARED_FIX = ("use a folder of your own: cluster.remote_root=<a folder only you can write>, "
               "e.g. ~/hpc_ddp, or a subfolder of the shared one that you create with "
               "mkdir -m 700 (docs/security.md#the-remote-path).")


def _refused(key: str, value: str, exc: Untrusted | OSError) -> UserError:
    text = str(exc) if isinstance(exc, Untrusted) else (exc.strerror or str(exc))
    problem, _, fix = text.partition(" Fix: ")
    return UserError(key, value, problem, _SHARED_FIX if isinstance(exc, Untrusted) else fix)


def _opened(parent: int, name: str, shown: Path, create: bool) -> int:
    """The folder ``name`` under the descriptor ``parent``, opened without following a link
    (made, mode 0700, when ``create`` and missing) and checked as ours."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent)
    try:
        fd = os.open(name, _FOLDER | os.O_NOFOLLOW, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(
                os.lstat(name, dir_fd=parent).st_mode):
            raise Untrusted(f"{shown} is a symbolic link: hpc_ddp enters no snapshot or run "
                            "folder through one (it could lead to another user's files).") from None
        raise
    try:
        check_stat(os.fstat(fd), shown)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_root(root: str) -> int:
    """The remote root, made (0700) when missing, checked as ours; its descriptor."""
    path = Path(root).expanduser()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, _FOLDER)
    except OSError as exc:
        raise _refused("cluster.remote_root", root, exc) from None
    try:
        check_stat(os.fstat(fd), path)
    except Untrusted as exc:
        os.close(fd)
        raise _refused("cluster.remote_root", root, exc) from None
    return fd


def _sub(root: str, fd: int, name: str, create: bool = True) -> int:
    try:
        return _opened(fd, name, Path(root).expanduser() / name, create)
    except (Untrusted, OSError) as exc:
        raise _refused("cluster.remote_root", root, exc) from None


def _marker(digest: str) -> bytes:
    return json.dumps({"digest": digest, "uid": os.geteuid()}).encode()


def _whole(code: int, digest: str, root: str) -> bool:
    """Is ``code/<digest>`` a copy this user made whole? False when it is missing or was cut
    short (no marker); UserError when it is a link or someone else's."""
    try:
        fd = _opened(code, digest, Path(root).expanduser() / "code" / digest, create=False)
    except FileNotFoundError:
        return False
    except (Untrusted, OSError) as exc:
        raise _refused("cluster.remote_root", root, exc) from None
    try:
        where = Path(root).expanduser() / "code" / digest
        data = read_owned(where / MARKER, where)
    except FileNotFoundError:
        return False
    except Untrusted as exc:
        raise _refused("cluster.remote_root", root, exc) from None
    finally:
        os.close(fd)
    try:
        said = json.loads(data)
    except ValueError:
        return False
    return bool(said == {"digest": digest, "uid": os.geteuid()})


def check(root: str, digest: str) -> dict[str, Any]:
    """The chain to ``code/<digest>`` and ``runs/`` made and checked; is the snapshot there."""
    if len(digest) != DIGEST_CHARS or any(c not in "0123456789abcdef" for c in digest):
        raise UserError("snapshot", digest, "is not a snapshot's digest.",
                        "submit again from the project (a handle's snapshot is written by "
                        "hpc_ddp).")
    fd = open_root(root)
    try:
        os.close(_sub(root, fd, "runs"))
        code = _sub(root, fd, "code")
        try:
            present = _whole(code, digest, root)
        finally:
            os.close(code)
    finally:
        os.close(fd)
    return {"home": str(Path.home()), "present": present,
            "root": str(Path(root).expanduser().absolute())}


def unpack(root: str, digest: str, archive: bytes) -> dict[str, Any]:
    """The archive as ``code/<digest>``: its digest recomputed, unpacked in a private folder
    of ``code/``, the marker written, renamed into place. Two submits of one tree at once
    both end with one whole copy."""
    if hashlib.sha256(archive).hexdigest()[:DIGEST_CHARS] != digest:
        raise UserError("snapshot", digest, "the archive sent is not that snapshot (it was cut "
                        "short or changed on the way).", "submit again.")
    fd = open_root(root)
    try:
        os.close(_sub(root, fd, "runs"))
        code = _sub(root, fd, "code")
        try:
            if _whole(code, digest, root):
                return {"present": True}
            folder = Path(root).expanduser().absolute() / "code"
            incoming = Path(tempfile.mkdtemp(prefix=".incoming.", dir=folder))
            try:
                with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
                    # the data filter: no absolute paths, no "..", no link out of the folder
                    tar.extractall(incoming, filter="data")
                (incoming / MARKER).write_bytes(_marker(digest))
                os.chmod(incoming, 0o750)
                _into_place(code, incoming, digest, root)
            finally:
                shutil.rmtree(incoming, ignore_errors=True)
        finally:
            os.close(code)
    finally:
        os.close(fd)
    return {"present": True}


def _into_place(code: int, incoming: Path, digest: str, root: str) -> None:
    """Rename ``incoming`` to ``code/<digest>``; a copy cut short there (ours, no marker) is
    replaced; anything else that fails is an error."""
    for _ in range(2):
        try:
            os.rename(incoming.name, digest, src_dir_fd=code, dst_dir_fd=code)
            return
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise UserError("cluster.remote_root", root, f"the copy of the code could not "
                                f"be put in place ({exc.strerror}).", _SHARED_FIX) from None
        if _whole(code, digest, root):
            return  # another submit of the same tree put the same copy there first
        stale = tempfile.mkdtemp(prefix=".stale.", dir=incoming.parent)
        os.rename(digest, Path(stale).name + "/x", src_dir_fd=code, dst_dir_fd=code)
        shutil.rmtree(stale, ignore_errors=True)
    raise UserError("cluster.remote_root", root, "the copy of the code could not be put in "
                    "place (something else keeps taking its name).", _SHARED_FIX)


def job_id(run_dir: str) -> str | None:
    """The job a run dir's ``job.json`` names, when the run dir and the file are ours."""
    top = Path(run_dir).expanduser()
    try:
        said = json.loads(read_owned(top / "job.json", top))
    except (OSError, Untrusted, ValueError):
        return None
    value = said.get("job_id") if isinstance(said, dict) else None
    return str(value) if value else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -P -m hpc_ddp.remote.place",
                                     description="(run by a remote submit over SSH) " +
                                     (__doc__ or "").split("\n\n")[0])
    parser.add_argument("command", choices=("check", "unpack", "job"))
    parser.add_argument("path", help="the remote root (check, unpack) or a run dir (job)")
    parser.add_argument("digest", nargs="?", default="")
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            said: dict[str, Any] = check(args.path, args.digest)
        elif args.command == "unpack":
            said = unpack(args.path, args.digest, sys.stdin.buffer.read())
        else:
            said = {"job_id": job_id(args.path)}
    except UserError as exc:
        print(json.dumps({"error": {"key": exc.key, "value": str(exc.value),
                                    "problem": exc.problem, "fix": exc.fix}}))
        return USAGE_EXIT_CODE
    print(json.dumps(said))
    return 0


def answer(stdout: bytes) -> dict[str, Any]:
    """The laptop's reading of a command's JSON line (its last line that is one); a refusal
    there raised here as the same one line."""
    for line in reversed(stdout.decode(errors="replace").splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                said = json.loads(line)
                if isinstance(said, dict):
                    if isinstance(said.get("error"), dict):
                        e = said["error"]
                        raise UserError(str(e.get("key")), str(e.get("value")),
                                        str(e.get("problem")), str(e.get("fix")))
                    return said
    return {}


if __name__ == "__main__":
    sys.exit(main())
