"""The two shapes of a part (model, data, loss, optim, scheduler, metrics).

In YAML and on the command line a part is either one of hpc_ddp's own (``name`` and typed
keys) or a Hydra ``_target_`` node (``_target_`` plus the callable's keyword arguments). In
:class:`~hpc_ddp.config.schema.Config` both are one dataclass: the built-in's typed fields,
and ``target`` / ``kwargs`` for a ``_target_`` node. ``to_typed`` and ``to_plain`` convert
between the two; overrides of part keys are widened here so that ``model._target_=pkg.Net``
and ``model.width=256`` work without Hydra's ``+``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from hpc_ddp.config.schema import FREE_FORM, PARTS
from hpc_ddp.errors import UserError, shown

TARGET = "_target_"
# Keys Hydra's instantiate reads itself (they stay in kwargs and reach instantiate).
HYDRA_KEYS = ("_partial_", "_args_", "_recursive_", "_convert_")
# Keys of a `_target_` part that remain hpc_ddp's own (typed, never passed to the callable).
OWN_KEYS: dict[str, tuple[str, ...]] = {
    "data": ("num_workers", "batched", "pin_memory", "persistent_workers", "prefetch_factor",
             "stage", "stage_dir"),
}
# Keys that moved, and where to: a user's old override gets the new spelling.
MOVED = {"optim.schedule": "scheduler=<cosine|linear|constant>",
         "optim.warmup_steps": "scheduler.warmup_steps=<steps>",
         "optim.min_lr_ratio": "scheduler.min_lr_ratio=<fraction>"}
_INTERNAL = ("target", "kwargs")


def typed_fields(part: str) -> list[str]:
    """The keys a built-in ``part`` node may hold."""
    return [f.name for f in dataclasses.fields(PARTS[part]) if f.name not in _INTERNAL]


def to_typed_dict(part: str, node: Mapping[str, Any] | None) -> dict[str, Any]:
    """A part's YAML node -> the keys of its dataclass (``target``/``kwargs`` for a target).

    A built-in node may hold only its typed keys: anything else is a typo (UserError with the
    closest key). A ``_target_`` node's other keys are the callable's arguments.
    """
    node = dict(node or {})
    if TARGET in node:
        target = node.pop(TARGET)
        if not isinstance(target, str) or not target.strip():
            raise UserError(f"{part}.{TARGET}", shown(target), "is not an import path.",
                            f"give the callable's full name, e.g. {part}._target_="
                            "my_pkg.module.Name.")
        own = {k: node.pop(k) for k in OWN_KEYS.get(part, ()) if k in node}
        return {**own, "name": None, "target": target.strip(), "kwargs": node}
    known = typed_fields(part)
    for key, value in node.items():
        if key not in known:
            raise _unknown(part, key, value, known)
    return node


def _unknown(part: str, key: str, value: Any, known: list[str]) -> UserError:
    full = f"{part}.{key}"
    if full in MOVED:
        return UserError(full, shown(value), "has moved.", f"use {MOVED[full]}.")
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {part}.{close[0]}? " if close else ""
    return UserError(full, shown(value), f"no such key of the built-in {part}.",
                     f"{hint}Keys: {', '.join(known)}; or build the {part} with your own "
                     f"callable ({part}._target_=my_pkg.Name, docs/your-code.md).")


def to_plain(part: str, value: Any) -> dict[str, Any]:
    """A part dataclass -> its YAML node (what config.yaml shows, and --cfg prints)."""
    data = dataclasses.asdict(value)
    target, kwargs = data.pop("target"), data.pop("kwargs")
    if target is None:
        return data
    own = {k: data[k] for k in OWN_KEYS.get(part, ())}
    return {TARGET: target, **own, **kwargs}


@functools.lru_cache(maxsize=4096)
def _typed_cached(part: str, frozen: str) -> Any:
    from omegaconf import OmegaConf  # deferred: omegaconf

    holder = _holder(part)
    node = OmegaConf.merge(OmegaConf.structured(holder), {part: json.loads(frozen)})
    return getattr(OmegaConf.to_object(node), part)


@functools.cache
def _holder(part: str) -> type:
    """A dataclass with the one field ``part``, so OmegaConf's errors name ``part.key``."""
    return dataclasses.make_dataclass(f"_{part}_holder", [
        (part, PARTS[part], dataclasses.field(default_factory=PARTS[part]))])


def to_typed(part: str, node: Mapping[str, Any] | None) -> Any:
    """A part's YAML node -> its checked dataclass. OmegaConf errors pass through (compose
    turns them into one-line UserErrors naming ``part.key``)."""

    typed = to_typed_dict(part, node)
    try:
        frozen = json.dumps(typed, sort_keys=True)
    except (TypeError, ValueError):  # not JSON-able (rare): no cache
        return _typed_cached.__wrapped__(part, json.dumps(typed, default=str))
    # Sweep points mostly share their parts: each distinct one is typed once.
    return copy.deepcopy(_typed_cached(part, frozen))


def is_plus_target(item: str) -> bool:
    """``+model._target_=...`` or ``++model._target_=...`` (a part's `_target_` with Hydra's
    "add" prefix): read as ``model._target_=...``, which starts the part afresh."""
    key = item.partition("=")[0]
    group, _, rest = key.lstrip("+").partition(".")
    return key.startswith("+") and group in PARTS and rest == TARGET


def widen_overrides(overrides: Sequence[str]) -> list[str]:
    """Part and free-form keys as Hydra needs them to accept new keys.

    ``model.width=256`` -> ``++model.width=256`` (set or add: a `_target_`'s arguments are
    not in the option's YAML); ``model._target_=pkg.Net`` without a ``model=<option>``
    choice -> ``~model`` first, so the target starts from an empty node, not from the default
    option's keys. Explicit ``+``/``++``/``~`` are left as typed, but for a part's
    ``_target_``, where ``+model._target_=pkg.Net`` means the same as without the ``+``.
    """
    chosen = {o.partition("=")[0] for o in overrides if "." not in o.partition("=")[0]}
    widened: list[str] = []
    fresh: list[str] = []
    for item in overrides:
        if is_plus_target(item):  # Hydra's habit, +model._target_=...: the same meaning
            item = item.lstrip("+")
        key, eq, _ = item.partition("=")
        group, dot, _ = key.partition(".")
        if not eq or not dot or key.startswith(("+", "~")) or not (
                group in PARTS or group in FREE_FORM):
            widened.append(item)
            continue
        if key == f"{group}.{TARGET}" and group not in chosen and f"~{group}" not in fresh:
            fresh.append(f"~{group}")
        widened.append(f"++{item}")
    return fresh + widened
