"""A state as two parts: its tensors by name, and everything else with the tensors' places
marked. The sharded checkpoint format (dcp_files.py) writes the tensors with
torch.distributed.checkpoint, every rank its own, and the rest as rank 0's plain file, so
that a value that is not a tensor comes back as rank 0 saved it, as in the full format.

A tensor's name is the path of keys to it joined by dots (``model.encoder.0.weight``,
``optimizer.state.fc.weight.exp_avg``): the names torch.distributed.checkpoint itself gives a
nested state dict, stable from one save to the next and from one world size to another.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# A tensor's place in the plain part: {MARK: its name}.
MARK = "__hpc_ddp_tensor__"


def split(tree: Any) -> tuple[Any, dict[str, Any]]:
    """(``tree`` with each tensor replaced by its mark, {name: tensor}); ValueError when two
    paths give one name (a key with a dot in it beside the keys it spells)."""
    tensors: dict[str, Any] = {}
    return _split(tree, (), tensors), tensors


def _split(value: Any, path: tuple[Any, ...], tensors: dict[str, Any]) -> Any:
    import torch  # deferred: torch

    if isinstance(value, torch.Tensor):
        name = ".".join(map(str, path))
        if name in tensors:
            raise ValueError(f"two tensors of the state would both be saved as {name!r}: "
                             "rename a key that holds a dot")
        tensors[name] = value
        return {MARK: name}
    if isinstance(value, dict):
        if MARK in value:
            raise ValueError(f"a checkpointed state may not use the key {MARK!r}")
        return {k: _split(v, (*path, k), tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_split(v, (*path, i), tensors) for i, v in enumerate(value)]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_split(v, (*path, i), tensors) for i, v in enumerate(value))
    return value


def merge(plain: Any, tensors: dict[str, Any]) -> Any:
    """``plain`` with each mark replaced by its tensor (KeyError for one that is missing)."""
    if _mark(plain) is not None:
        return tensors[plain[MARK]]
    if isinstance(plain, dict):
        return {k: merge(v, tensors) for k, v in plain.items()}
    if isinstance(plain, list):
        return [merge(v, tensors) for v in plain]
    if isinstance(plain, tuple):
        return tuple(merge(v, tensors) for v in plain)
    return plain


def names(plain: Any) -> Iterator[str]:
    """The names of the tensors ``plain`` marks."""
    name = _mark(plain)
    if name is not None:
        yield name
    elif isinstance(plain, dict):
        for value in plain.values():
            yield from names(value)
    elif isinstance(plain, list | tuple):
        for value in plain:
            yield from names(value)


def _mark(value: Any) -> str | None:
    if isinstance(value, dict) and len(value) == 1 and isinstance(value.get(MARK), str):
        name: str = value[MARK]
        return name
    return None


def has_dtensor(tree: Any) -> bool:
    """Whether ``tree`` holds a sharded tensor (torch.distributed's DTensor). Only looks:
    a state in the full format may use any keys."""
    from torch.distributed.tensor import DTensor  # deferred: torch

    if isinstance(tree, DTensor):
        return True
    if isinstance(tree, dict):
        return any(has_dtensor(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return any(has_dtensor(v) for v in tree)
    return False


def gathered(tree: Any) -> Any:
    """``tree`` with every DTensor gathered whole (``full_tensor``: a collective, every rank
    calls it with the same tree)."""
    from torch.distributed.tensor import DTensor  # deferred: torch

    plain, tensors = split(tree)
    return merge(plain, {name: t.full_tensor() if isinstance(t, DTensor) else t
                         for name, t in tensors.items()})
