"""A checkpoint is data, never code: what hpc_ddp loads from a run dir, and from whom.

``torch.load(weights_only=False)`` runs whatever a pickle says; a file planted in a
group-writable project folder would be code execution on the next restart, on every rank.
So every checkpoint (and a notebook's pickled entry) is loaded only when

- it, and every folder from it up to the run dir, belongs to this user and is writable by
  no one else (group or others), checked on the descriptor it is then read from, with no
  symbolic link followed below the run dir (hpc_ddp/owned.py), and
- it loads with ``weights_only=True``: tensors, numbers, strings, bytes, None and the
  containers dict/list/tuple/set; torch's own allowlist, plus whatever the program added with
  ``torch.serialization.add_safe_globals`` (https://pytorch.org/docs/stable/notes/serialization.html#weights-only).

Both refusals are :class:`UntrustedCheckpoint`, one sentence with the fix (docs/security.md).
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import IO, Any

from hpc_ddp.owned import Untrusted, open_owned

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")

#: A checkpoint hpc_ddp refuses to load (someone else could have written it, or it holds an
#: object that is not plain data). Never skipped for an older one: it is reported.
UntrustedCheckpoint = Untrusted


def load(path: Path, top: Path, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``path`` loaded as data (weights_only) from the descriptor the ownership checks were
    made on (hpc_ddp/owned.py): no file can be swapped in between."""
    with open_owned(path, top) as handle:
        return load_opened(handle, path, map_location, mmap)


def load_opened(handle: IO[bytes], path: Path, map_location: Any = "cpu",
                mmap: bool = False) -> Any:
    """A checkpoint from an open file, as data. ``mmap``: mapped, not read (torch maps only a
    file it opens by name: /proc/self/fd/N is that same open file, not ``path`` again)."""
    source: Any = handle
    if mmap:
        by_fd = f"/proc/self/fd/{handle.fileno()}"
        source = by_fd if os.path.exists(by_fd) else handle
    return load_data(source, map_location, mmap=mmap and isinstance(source, str), shown=path)


def load_data(path: Any, map_location: Any = "cpu", mmap: bool = False,
              shown: Path | None = None) -> Any:
    """``torch.load(weights_only=True)`` of ``path`` (a file name or an open file); an
    object outside the allowlist is UntrustedCheckpoint naming its type and how to allow it."""

    import torch  # deferred: torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        if not _GLOBAL.search(str(exc)):
            raise  # not a refused object but a damaged file (bad opcodes): the caller's to skip
        raise UntrustedCheckpoint(refusal(shown or path, exc)) from None


def refused_global(exc: BaseException) -> bool:
    """A weights_only refusal of an object (not a damaged file)."""
    return bool(_GLOBAL.search(str(exc)))


def refusal(path: Any, exc: BaseException) -> str:
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
