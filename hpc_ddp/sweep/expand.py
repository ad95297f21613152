"""Expand multirun overrides into sweep points (Hydra's grammar, the basic sweeper's product).

    optim.lr=0.1,0.01 model=tiny_cnn,resnet18  ->  4 points, each a list of plain overrides
"""

from __future__ import annotations

import contextlib
import decimal
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hpc_ddp.config.messages import group_options, user_error
from hpc_ddp.errors import UserError
from hpc_ddp.redact import MASK, Marks, secret_name, secret_value

# One override's values: (key, value, whether swept); a fixed override has one.
Axis = list[tuple[str, str, bool]]


@dataclass(frozen=True)
class Point:
    index: int
    # Every override of this point (the fixed ones and one value of each swept key).
    overrides: tuple[str, ...]
    # key -> value of the swept keys only (for tables and TensorBoard hparams); a secret's
    # value (by its key's name or its shape, hpc_ddp/redact.py) as ****.
    params: tuple[tuple[str, str], ...]

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.params) or "(no swept key)"


def expand(overrides: Sequence[str], limit: int = 100_000) -> list[Point]:
    """The cartesian product of the swept values, in the order the keys were given."""
    parsed, axes = _axes(overrides, limit)
    total = 1
    for axis in axes:
        total *= len(axis)
    if total > limit:
        raise UserError("multirun", f"{total} points", f"is more than {limit}.",
                        "sweep fewer values, or split the sweep.")
    marks = _marks_given(parsed)
    # Each swept value as the tables show it, once (not once a point).
    shown = {(k, v): _shown(k, v, marks) for axis in axes for k, v, swept in axis if swept}
    points = []
    for index, combo in enumerate(itertools.product(*axes)):
        points.append(Point(index, tuple(f"{k}={v}" for k, v, _ in combo),
                            tuple((k, shown[k, v]) for k, v, swept in combo if swept)))
    return points


def first_point(overrides: Sequence[str], limit: int = 100_000) -> list[str]:
    """The overrides of a sweep's first point (what every point shares, checked once before
    anything is sent: a remote sweep's cluster.remote and its kin), split by Hydra's grammar
    as :func:`expand` splits them (``cluster.setup=[a,b]`` is one value, not a sweep)."""
    _, axes = _axes(overrides, limit)
    return [f"{axis[0][0]}={axis[0][1]}" for axis in axes]


def _axes(overrides: Sequence[str], limit: int) -> tuple[list[Any], list[Axis]]:
    """Hydra's parse of ``overrides``, and per override its values: (key, value, swept)."""
    # deferred: hydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:

        raise user_error(exc, overrides) from None
    axes: list[Axis] = []
    for item in parsed:
        key = item.get_key_element()
        if item.is_sweep_override():
            values = _swept_values(item, key, overrides, limit)
            if not values:
                raise UserError(key, (item.input_line or "").partition("=")[2],
                                "sweeps over no value.", "give at least one value.")
            axes.append([(key, v, True) for v in values])
        else:  # kept exactly as typed (its quoting included)
            axes.append([(key, (item.input_line or "").partition("=")[2], False)])
    return parsed, axes


def _marks_given(parsed: list[Any]) -> Marks:
    """secrets.secret / secrets.public as the command line gives them."""
    given = {o.get_key_element(): o.value() for o in parsed if not o.is_sweep_override()}
    found = [given.get(f"secrets.{k}") for k in ("secret", "public")]
    secret, public = (v if isinstance(v, list) else [] for v in found)
    return Marks.of(map(str, secret), map(str, public))


def _shown(key: str, value: str, marks: Marks) -> str:
    """A swept value for tables (the manifest, TensorBoard's hparams, an error's "sweep
    point" label): **** where it holds a secret, by the key's name, its shape, or as the run
    would take one out of it (``cluster.setup=['export HF_TOKEN=x']``)."""
    # deferred (start-up): config.secrets, config.secret_channels
    from hpc_ddp.config.secret_channels import Found
    from hpc_ddp.config.secrets import scrub_override

    if secret_name(key, marks) or secret_value(value):
        return MASK
    found = Found(marks, strict=False)
    with contextlib.suppress(UserError):
        scrub_override(f"{key}={value}", found)
    # Swept values come back from Hydra written as in an override (strings quoted).
    return MASK if found.values else value.strip("'\"")


def range_count(start: Any, stop: Any, step: Any) -> int:
    """How many values range(start, stop, step) gives (Hydra's, floats included), counted
    without making them; ValueError for a step of 0 or a bound that is not a number."""

    try:
        first, last, by = (decimal.Decimal(str(v)) for v in (start, stop, step))
    except (decimal.InvalidOperation, ValueError, TypeError):
        raise ValueError("not numbers") from None
    if not (first.is_finite() and last.is_finite() and by.is_finite()):
        raise ValueError("not finite")
    if by == 0:
        raise ValueError("step 0")
    return max(0, math.ceil((last - first) / by))


def _swept_values(item: Any, key: str, overrides: Sequence[str], limit: int) -> list[str]:
    """The grid values of one swept override, glob() over the group's options included; a
    range is counted before it is made (at most ``limit`` values)."""
    # deferred: hydra
    from hydra.core.override_parser.types import Glob, RangeSweep, ValueType

    typed = (item.input_line or "").partition("=")[2]
    swept = item.value()
    if isinstance(swept, RangeSweep):
        try:
            count = range_count(swept.start, swept.stop, swept.step)
        except ValueError:
            raise UserError(key, typed, "is not a range with a step other than 0.",
                            "give range(start,stop,step) with numbers and a step that is not "
                            "0, e.g. range(0,10,2).") from None
        if count > limit:
            raise UserError(key, typed, f"makes {count} values, more than the {limit} points "
                            "a sweep may have.", "use a larger step or a shorter range.")
    if item.value_type == ValueType.INTERVAL_SWEEP:
        raise UserError(key, typed, "interval() is a continuous range, which a grid sweep "
                        "cannot enumerate.", "list the values, or use range(start,stop,step).")
    if _nested_sweep(getattr(swept, "list", ())):  # Hydra would fail to write it back
        raise UserError(key, typed, "puts a sweep (range(), interval(), glob()) among the "
                        "values of a sweep.", f"sweep one range per key ({key}=range(0,10)), "
                        f"or list the values ({key}=0,1,2).")
    if item.value_type == ValueType.GLOB_CHOICE_SWEEP:
        # deferred (start-up): config.compose
        from hpc_ddp.config.compose import search_folders, user_config_dir

        options = group_options(key, search_folders(user_config_dir(overrides)))
        if not options:
            raise UserError(key, typed, "glob() picks options of a config group, and "
                            f"{key} is not one.", "use glob() on a group, e.g. model=glob(res*).")
        glob: Glob = item.value()
        return list(glob.filter(options))
    return [str(v) for v in item.sweep_string_iterator()]


def _nested_sweep(values: Any) -> bool:
    """Whether a sweep's values hold a sweep or glob(), at any depth (``range(0,3),[range(
    0,3)]``)."""
    # deferred: hydra
    from hydra.core.override_parser.types import Glob, Sweep

    if isinstance(values, Sweep | Glob):
        return True
    if isinstance(values, dict):
        return any(_nested_sweep(v) for v in values.values())
    return isinstance(values, list | tuple) and any(_nested_sweep(v) for v in values)


def chunks(count: int, size: int) -> list[range]:
    """Consecutive index ranges of at most ``size`` (arrays that fit MaxArraySize)."""
    if size < 1:
        raise ValueError("chunk size must be positive")
    return [range(start, min(start + size, count)) for start in range(0, count, size)]
