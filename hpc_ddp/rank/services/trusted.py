"""A checkpoint is data, never code: what hpc_ddp loads from a run dir, and from whom.

``torch.load(weights_only=False)`` runs whatever a pickle says; a file planted in a
group-writable project folder would be code execution on the next restart, on every rank.
So every checkpoint (and a notebook's pickled entry) is loaded only when

- it, and every folder from it up to the run's checkpoints/ folder, belongs to this user and
  is writable by no one else (group or others), and
- it loads with ``weights_only=True``: tensors, numbers, strings, bytes, None and the
  containers dict/list/tuple/set; torch's own allowlist, plus whatever the program added with
  ``torch.serialization.add_safe_globals`` (https://pytorch.org/docs/stable/notes/serialization.html#weights-only).

Both refusals are :class:`UntrustedCheckpoint`, one sentence with the fix (docs/security.md).
"""

from __future__ import annotations

import os
import pickle
import pwd
import re
import stat
from pathlib import Path
from typing import Any

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


class UntrustedCheckpoint(RuntimeError):
    """A checkpoint hpc_ddp refuses to load (someone else could have written it, or it holds
    an object that is not plain data). Never skipped for an older one: it is reported."""


def _who(uid: int) -> str:
    try:

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def check_owned(path: Path, top: Path) -> None:
    """Refuse ``path`` unless it and every folder up to ``top`` (included) are this user's
    and writable by no one else; a stat per level (three or four for a checkpoint)."""
    me = os.geteuid()
    chain = [path]
    if top in path.parents:
        chain += [p for p in path.parents if p == top or top in p.parents]
    for item in chain:
        info = os.stat(item)
        kind = "folder" if stat.S_ISDIR(info.st_mode) else "file"
        if info.st_uid != me:
            raise UntrustedCheckpoint(
                f"{item} is not yours: the {kind} belongs to {_who(info.st_uid)} and hpc_ddp "
                f"runs as {_who(me)}. What someone else wrote is never loaded from a run dir "
                "(it could run code on every rank). Copy the run dir (`cp -r`: the copy is "
                "yours) and resume the copy, or start a new run_dir.")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            who = "others" if info.st_mode & stat.S_IWOTH else "your group"
            raise UntrustedCheckpoint(
                f"{item} is writable by {who} (mode {stat.S_IMODE(info.st_mode):o}): anyone "
                "who can write there can plant a file that runs code on the next restart, so "
                f"hpc_ddp does not load it. Fix: chmod go-w {item} (hpc_ddp makes run dirs "
                "with cluster.umask, 027 by default: docs/security.md).")


def load(path: Path, top: Path, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``path`` loaded as data (weights_only), after :func:`check_owned`."""
    check_owned(path, top)
    return load_data(path, map_location, mmap)


def load_data(path: Path, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)``; an object outside the allowlist is
    UntrustedCheckpoint naming its type and how to allow it."""

    import torch  # deferred: torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        if not _GLOBAL.search(str(exc)):
            raise  # not a refused object but a damaged file (bad opcodes): the caller's to skip
        raise UntrustedCheckpoint(refusal(path, exc)) from None


def refusal(path: Path, exc: BaseException) -> str:
    """The one sentence for a weights_only refusal of ``path``."""
    found = _GLOBAL.search(str(exc))
    name = found.group(1) if found else "an object that is not plain data"
    name = {"posix.system": "os.system", "builtins.exec": "exec", "builtins.eval": "eval"
            }.get(name, name)
    return (f"{path} holds {name}, which hpc_ddp does not unpickle: checkpoints are loaded "
            "with torch.load(weights_only=True), so nothing in them runs as code. If your own "
            "program saved it, save tensors, numbers, strings, lists and dicts instead "
            "(torch.from_numpy(a) for a numpy array), or allow a type of yours with "
            f"torch.serialization.add_safe_globals([{name}]) on every rank before it saves "
            "and loads (docs/security.md); if it did not, someone planted the file: remove it.")
