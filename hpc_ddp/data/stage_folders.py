"""The node-local folders a staged copy lives in, made and checked as this user's own.

The default stage folder is a predictable path under ``/tmp`` (or ``$TMPDIR``): another user
of the node could make it first and leave a "copy" there whose fingerprint and file count
match, and its files would be read as this user's data (CIFAR-10's batches are pickles: their
code would run as this user). So every folder of hpc_ddp's under the stage folder is named
for this user (``hpc_ddp-stage-<uid>``), made with mode 0700, and checked at every start:
a real folder (no symbolic link), owned by this user, writable by nobody else. One that is
not is refused in one line that names it and the fix; nothing in it is read
(docs/security.md#staged-data).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hpc_ddp.errors import UserError

TOP = "hpc_ddp-stage"
NOT_A_FOLDER = "is not a folder"


def top_of(stage_dir: str) -> Path:
    """This user's folder under the stage folder: ``<stage_dir>/hpc_ddp-stage-<uid>``."""
    return Path(stage_dir).expanduser() / f"{TOP}-{os.geteuid()}"


def own_folders(top: Path, home: Path, stage_dir: str, host: str) -> None:
    """Make ``top`` and every folder from it down to ``home`` (0700), then check each is a
    folder of this user's that no one else can write; UserError naming the first that is
    not. ``stage_dir`` (as configured) and ``host`` name where, in the message."""
    chain = [top]
    for part in home.relative_to(top).parts:
        chain.append(chain[-1] / part)
    for folder in chain:
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise UserError("data.stage_dir", stage_dir, f"cannot be made on node {host} "
                            f"({exc.strerror or exc}).", "choose a node-local folder you can "
                            "write (the default is $SLURM_TMPDIR, else $TMPDIR, else /tmp)."
                            ) from None
        problem = _not_mine(folder)
        if problem:
            why = ("no copy can be kept there" if problem == NOT_A_FOLDER else
                   "a copy there could be anyone's, so it is not used")
            raise UserError("data.stage_dir", stage_dir, f"{folder} on node {host} {problem}: "
                            f"{why}.", f"remove {folder} (its owner or root can), or set "
                            "data.stage_dir to a folder of yours.")


def _not_mine(folder: Path) -> str | None:
    """Why ``folder`` is not this user's own private folder (None: it is)."""
    try:
        st = os.lstat(folder)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return NOT_A_FOLDER
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"can be written by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None
