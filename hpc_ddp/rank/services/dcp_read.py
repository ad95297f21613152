"""A sharded checkpoint (dcp_files.py) read back as data only, from files only this user
could have written.

torch.distributed.checkpoint's own reader unpickles its ``.metadata`` file with
``pickle.load`` and a pickled value with ``torch.load(weights_only=False)``: a planted file
would run code on every rank at the next restart. So nothing here goes through them:

- ``.metadata`` is unpickled by :class:`_MetadataUnpickler`, which builds only the classes a
  DCP index is made of (torch.distributed.checkpoint.metadata's dataclasses, torch.Size,
  dtypes, layouts, memory formats, a path) and refuses any other global, the way Python's
  documentation restricts an unpickler
  (https://docs.python.org/3/library/pickle.html#restricting-globals); a file it refers to
  must be one of the ranks' ``__<rank>_<n>.distcp`` files beside it;
- every file is opened through hpc_ddp/owned.py (this user's, writable by no one else, from
  the run dir down, no symbolic link) and read from that descriptor;
- tensors are read with ``torch.load(weights_only=True)`` (DCP's own choice for them); a
  pickled value, which hpc_ddp never writes in this format, is refused;
- everything that is not a tensor is rank 0's ``state.pt``, loaded like any checkpoint
  (trusted.py).

Refusals are UntrustedCheckpoint (never skipped for an older checkpoint); a damaged file is
an ordinary error, so the resume falls back to the one before (checkpoint.load_usable).
"""

from __future__ import annotations

import functools
import io
import pickle
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hpc_ddp.owned import open_owned
from hpc_ddp.rank.services import tensor_tree, trusted
from hpc_ddp.rank.services.trusted import UntrustedCheckpoint

METADATA = ".metadata"
STATE = "state.pt"  # rank 0's values that are not tensors, tensors marked (tensor_tree.py)
_SHARD = re.compile(r"^__\d+_\d+\.distcp$")
_DCP = "torch.distributed.checkpoint"
_ALLOWED = {
    *((f"{_DCP}.metadata", name) for name in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds a DCP index and nothing else (see the module docstring)."""

    def __init__(self, handle: Any, shown: Path) -> None:
        super().__init__(handle)
        self.shown = shown

    def find_class(self, module: str, name: str) -> Any:
        import torch  # deferred: torch

        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            torch.dtype | torch.layout | torch.memory_format):
            return getattr(torch, name)
        raise UntrustedCheckpoint(
            f"{self.shown} holds {module}.{name}, which is not part of a "
            "torch.distributed.checkpoint index and which hpc_ddp does not unpickle (it "
            "could run code). hpc_ddp did not write it: someone planted the file. Fix: remove "
            f"the checkpoint folder {self.shown.parent} (docs/security.md).")


def read_metadata(path: Path, top: Path) -> Any:
    """The DCP index ``path`` (a ``.metadata`` file inside the run dir ``top``), checked:
    UntrustedCheckpoint for a global it may not hold or a file it may not name; ValueError
    for a damaged one."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # deferred: torch
    from torch.distributed.checkpoint.metadata import Metadata

    with open_owned(path, top) as handle:
        data = handle.read()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), path).load()
    except UntrustedCheckpoint:
        raise
    except Exception as exc:  # truncated, bad opcodes
        raise ValueError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise ValueError(f"{path} is not a torch.distributed.checkpoint index")
    for info in metadata.storage_data.values():
        if (not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str)
                or not _SHARD.match(info.relative_path) or info.transform_descriptors):
            raise UntrustedCheckpoint(
                f"{path} names {getattr(info, 'relative_path', info)!r}, which is not a "
                "rank's file of the checkpoint (__<rank>_<n>.distcp, untransformed): hpc_ddp "
                f"did not write it. Fix: remove the checkpoint folder {path.parent}.")
    return metadata


def read(path: Path, top: Path, templates: dict[str, Any] | None = None) -> dict[str, Any]:
    """The state of the sharded checkpoint ``path`` (a folder inside the run dir ``top``):
    rank 0's plain values with every tensor put back. A tensor whose name is in
    ``templates`` is loaded into that tensor (in place: a DTensor gets this rank's shard of
    it, whatever the world size that saved it); any other in full, on the CPU. Each rank
    reads on its own (no collective: a failure on one rank never leaves another waiting)."""
    import torch  # deferred: torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    plain = trusted.load(path / STATE, top)
    if not isinstance(plain, dict):
        raise ValueError(f"{path / STATE} is not a checkpoint's state")
    metadata = read_metadata(path / METADATA, top)
    wanted: dict[str, Any] = {}
    for name in tensor_tree.names(plain):
        if templates is not None and name in templates:
            wanted[name] = templates[name]
            continue
        meta = metadata.state_dict_metadata.get(name)
        if not isinstance(meta, TensorStorageMetadata):
            raise ValueError(f"{path} has no tensor {name!r}: the checkpoint is incomplete")
        wanted[name] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if wanted:
        try:
            made = _torch_classes()
            with warnings.catch_warnings():  # "assuming ... a single process": it is one
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(wanted, storage_reader=made["reader"](path, top, metadata),
                         planner=made["planner"](), no_dist=True)
        except BaseException as exc:
            raise _cause(exc) from None
    state: dict[str, Any] = tensor_tree.merge(plain, wanted)
    return state


def _cause(exc: BaseException) -> BaseException:
    """What to raise for a failed dcp.load: a refusal as it is; another error as an
    Exception (DCP's CheckpointException is a BaseException, which the fallback to an older
    checkpoint would not catch)."""
    from torch.distributed.checkpoint.api import CheckpointException  # deferred: torch

    if not isinstance(exc, CheckpointException):
        return exc
    errors = [failure[0] for failure in exc.failures.values()]
    for error in errors:
        if isinstance(error, UntrustedCheckpoint):
            return error
    first = errors[0] if errors else exc
    return RuntimeError(f"{type(first).__name__}: {str(first).splitlines()[0][:300]}"
                        if str(first) else type(first).__name__)


@functools.cache
def _torch_classes() -> dict[str, Any]:
    """DCP's reader, file access and load planner, subclassed as the module docstring says
    (made on first use: torch.distributed.checkpoint stays off this module's import)."""
    # deferred: torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader

    class _OwnedFileSystem(FileSystem):  # type: ignore[valid-type,misc]
        """DCP's file access, every file opened through hpc_ddp/owned.py, for reading only."""

        def __init__(self, top: Path) -> None:
            super().__init__()
            self.top = top

        @contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            if mode != "rb":
                raise PermissionError(f"{path}: a checkpoint is only read here")
            with open_owned(Path(path), self.top) as handle:
                yield handle

    class _OwnedReader(FileSystemReader):  # type: ignore[valid-type,misc]
        """FileSystemReader on the checked index, through _OwnedFileSystem; a tensor file
        holding a pickled object is refused, not skipped."""

        def __init__(self, path: Path, top: Path, metadata: Any) -> None:
            super().__init__(path)
            self.fs = _OwnedFileSystem(top)
            self._metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta  # deferred: torch

            if getattr(self._metadata, "storage_meta", None) is None:
                self._metadata.storage_meta = StorageMeta()
            self._metadata.storage_meta.load_id = self.load_id
            return self._metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            try:
                return super().read_data(plan, planner)
            except pickle.UnpicklingError as exc:
                if not trusted.refused_global(exc):
                    raise
                raise UntrustedCheckpoint(trusted.refusal(Path(self.path), exc)) from None

    class _DataOnlyPlanner(DefaultLoadPlanner):  # type: ignore[valid-type,misc]
        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise UntrustedCheckpoint(
                f"the checkpoint holds a pickled object at {read_item.dest_index.fqn!r}; "
                "hpc_ddp writes only tensors there and does not unpickle it (it could run "
                "code): someone planted the file. Fix: remove the checkpoint folder.")

    return {"reader": _OwnedReader, "planner": _DataOnlyPlanner}


def check(path: Path, top: Path) -> dict[str, Any]:
    """A sharded checkpoint looked at before a resume is submitted, without reading its
    tensors: its plain values (as data), its index (restricted), and every file in it passes
    the ownership checks. Returns rank 0's plain values (tensors marked)."""
    for entry in sorted(path.iterdir()):
        with open_owned(entry, top):  # this user's, writable by no one else, not a link
            pass
    read_metadata(path / METADATA, top)
    plain: dict[str, Any] = trusted.load(path / STATE, top)
    return plain
