"""Files that can run code, read only if no one but this user could have written them.

A run dir often lives in a folder a whole group shares, and every restart reads it again on
every rank. Some of its files are code, or become code when read: checkpoints and
submitit's, a step's and a notebook's pickles (unpickling runs what the pickle says), and
config.yaml / overrides.yaml, whose ``_target_`` names are imported and called. Before any of
them is read, :func:`open_owned` opens the run dir and walks down to the file one name at a
time (``openat`` with ``O_NOFOLLOW``: no symbolic link below the run dir is followed), and
checks the run dir, every folder on the way and the file itself on the descriptor it opened
(``fstat``): this user's, writable by nobody else. The caller reads from that descriptor, so
no other file can take the checked one's place between the check and the read
(docs/security.md).

The files a run appends to (a rank's log and stacks, events.jsonl) are opened by
:func:`open_append`: never through a symbolic link, and only a regular file of this user's
(a link planted at the name would have the run's lines written wherever it points).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import stat
from pathlib import Path
from typing import BinaryIO

_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# O_NONBLOCK: a FIFO put there would otherwise block the open until someone writes to it.
_FILE = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW

# O_NOFOLLOW: a link at the name is refused (ELOOP), not written through; O_NONBLOCK: a FIFO
# put there fails the open (ENXIO) instead of blocking it until someone reads.
_APPEND = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW |
           os.O_NONBLOCK)

_FOREIGN_FIX = (
    "resume only runs you made yourself. To start from someone else's weights, start a new "
    "run_dir and load their checkpoint as data only in your code, "
    "torch.load(path, map_location='cpu', weights_only=True) (docs/security.md); copying "
    "their run dir would make their pickles and config yours without checking them.")


class Untrusted(RuntimeError):
    """A file or folder someone other than this user could have written: never read (a
    checkpoint refused for this is never skipped for an older one: it is reported)."""


def who(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_stat(info: os.stat_result, shown: Path | str) -> None:
    """Untrusted unless ``info`` (of ``shown``) is this user's and writable by no one else."""
    me = os.geteuid()
    kind = "folder" if stat.S_ISDIR(info.st_mode) else "file"
    if info.st_uid != me:
        raise Untrusted(
            f"{shown} is not yours: the {kind} belongs to {who(info.st_uid)} and hpc_ddp runs "
            f"as {who(me)}. What someone else wrote is never loaded from a run dir (it could "
            f"run code on every rank). Fix: {_FOREIGN_FIX}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        whom = "others" if info.st_mode & stat.S_IWOTH else "your group"
        raise Untrusted(
            f"{shown} is writable by {whom} (mode {stat.S_IMODE(info.st_mode):o}): anyone who "
            "can write there can plant a file that runs code on the next restart, so hpc_ddp "
            f"does not load from it. Fix: chmod go-w {shown} (hpc_ddp makes run dirs with "
            "cluster.umask, 027 by default: docs/security.md).")


def check_folder(folder: Path) -> None:
    """A run dir (or a sweep's dir) that exists: this user's, writable by no one else."""
    fd = os.open(folder, _FOLDER)
    try:
        check_stat(os.fstat(fd), folder)
    finally:
        os.close(fd)


def _open_below(fd: int, name: str, flags: int, shown: Path) -> int:
    try:
        return os.open(name, flags, dir_fd=fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise
        try:  # O_NOFOLLOW refused a symbolic link (ELOOP; ENOTDIR for a folder's link)
            linked = stat.S_ISLNK(os.lstat(name, dir_fd=fd).st_mode)
        except OSError:
            linked = False
        if not linked:
            raise
        raise Untrusted(
            f"{shown} is a symbolic link: hpc_ddp follows none inside a run dir (one swapped "
            "in would load a file from elsewhere). Fix: put the file itself there, or remove "
            "the link.") from None


def open_owned(path: Path, top: Path) -> BinaryIO:
    """``path``, a file inside the folder ``top`` (a run dir), open for reading once ``top``,
    every folder between them and the file passed :func:`check_stat` on the descriptors
    opened here. Untrusted (with the fix) otherwise; FileNotFoundError when it is missing.
    A symbolic link above ``top`` is followed (a run dir on a linked scratch folder)."""
    path, top = Path(os.path.abspath(path)), Path(os.path.abspath(top))
    if top not in path.parents:
        raise Untrusted(f"{path} is not inside {top}: hpc_ddp loads nothing from outside the "
                        "run dir. Fix: keep the run's files in its run dir.")
    fd = os.open(top, _FOLDER)
    try:
        check_stat(os.fstat(fd), top)
        where = top
        for name in path.relative_to(top).parts[:-1]:
            where = where / name
            below = _open_below(fd, name, _FOLDER | os.O_NOFOLLOW, where)
            os.close(fd)
            fd = below
            check_stat(os.fstat(fd), where)
        handle = _open_below(fd, path.name, _FILE, path)
    finally:
        os.close(fd)
    try:
        info = os.fstat(handle)
        if not stat.S_ISREG(info.st_mode):
            raise Untrusted(f"{path} is not a regular file. Fix: remove it.")
        check_stat(info, path)
        os.set_blocking(handle, True)
        return os.fdopen(handle, "rb")
    except BaseException:
        os.close(handle)
        raise


def read_owned(path: Path, top: Path) -> bytes:
    """The bytes of ``path`` as :func:`open_owned` opened it."""
    with open_owned(path, top) as handle:
        return handle.read()


def run_root_of(path: Path) -> Path:
    """The run dir (or sweep dir) a file under its ``submitit/`` folder belongs to."""
    for parent in Path(os.path.abspath(path)).parents:
        if parent.name == "submitit":
            return parent.parent
    return Path(os.path.abspath(path)).parent


def check_appendable(info: os.stat_result, shown: Path | str) -> None:
    """Untrusted unless ``info`` (an lstat or fstat of ``shown``) is a regular file of this
    user's: what :func:`open_append` writes to. Group-writable is let through: nothing is
    loaded from these files, and what someone else could append there was theirs to write."""
    if stat.S_ISLNK(info.st_mode):
        raise Untrusted(
            f"{shown} is a symbolic link: hpc_ddp writes through none in a run dir (one planted "
            f"there would have the run's lines written wherever it points). Fix: remove {shown}, "
            "and check who else can write in the run dir (docs/security.md).")
    if not stat.S_ISREG(info.st_mode):
        raise Untrusted(f"{shown} is not a regular file, so hpc_ddp does not write to it. "
                        f"Fix: remove {shown}.")
    if info.st_uid != os.geteuid():
        raise Untrusted(
            f"{shown} is not yours: the file belongs to {who(info.st_uid)} and hpc_ddp runs as "
            f"{who(os.geteuid())}, so what the run wrote there would be theirs to read and "
            f"change. Fix: remove {shown} (it is in your folder: you can), and check who else "
            "can write in the run dir (docs/security.md).")


def open_append(path: Path | str) -> int:
    """A descriptor of ``path`` (a run dir's file: a rank's log, its stacks, events.jsonl)
    open to append, made if missing with the process's umask (cluster.umask: every rank sets
    it). Untrusted (with the fix) for a symbolic link, anything but a regular file, or a file
    of someone else's, checked on the descriptor opened (fstat), so nothing can take the
    checked file's place before the write. Only the name itself is not followed: the folders
    above it are checked before any rank starts (inputs/run_dir.check_run_files)."""
    try:
        fd = os.open(path, _APPEND, 0o666)
    except OSError as exc:
        # ELOOP: a link (O_NOFOLLOW); ENXIO: a FIFO with no reader or a socket; EISDIR.
        if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise
        check_appendable(os.lstat(path), path)
        raise
    try:
        check_appendable(os.fstat(fd), path)
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def private(folder: Path, parent: bool = False) -> bool:
    """``folder`` (made, mode 0700, when missing; its ``parent`` too when asked) is a folder,
    not a link, of this user, that no one else can enter, in a folder where no one else can
    rename it: its owner's (or root's) and writable by no one else, or sticky (/tmp)."""
    for made in [folder.parent] * parent + [folder]:
        with contextlib.suppress(OSError):  # there already, or cannot be: checked below
            os.mkdir(made, 0o700)
    try:
        info = os.lstat(folder)  # lstat: a link is refused, never followed
        above = os.stat(folder.parent)  # a linked ~/.ssh is fine when it is ours
    except OSError:
        return False
    me = os.geteuid()
    return (stat.S_ISDIR(info.st_mode) and info.st_uid == me and not info.st_mode & 0o077
            and (above.st_uid in (me, 0) and not above.st_mode & 0o022
                 or bool(above.st_mode & stat.S_ISVTX)))
