"""Expand multirun overrides into sweep points (Hydra's grammar, the basic sweeper's product).

    optim.lr=0.1,0.01 model=tiny_cnn,resnet18  ->  4 points, each a list of plain overrides
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hpc_ddp.config.messages import group_options, user_error
from hpc_ddp.errors import UserError


@dataclass(frozen=True)
class Point:
    index: int
    # Every override of this point (the fixed ones and one value of each swept key).
    overrides: tuple[str, ...]
    # key -> value of the swept keys only (for tables and TensorBoard hparams).
    params: tuple[tuple[str, str], ...]

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.params) or "(no swept key)"


def expand(overrides: Sequence[str], limit: int = 100_000) -> list[Point]:
    """The cartesian product of the swept values, in the order the keys were given."""
    # deferred: hydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:

        raise user_error(exc, overrides) from None
    axes: list[list[tuple[str, str, bool]]] = []
    for item in parsed:
        key = item.get_key_element()
        if item.is_sweep_override():
            values = _swept_values(item, key, overrides)
            if not values:
                raise UserError(key, (item.input_line or "").partition("=")[2],
                                "sweeps over no value.", "give at least one value.")
            axes.append([(key, v, True) for v in values])
        else:  # kept exactly as typed (its quoting included)
            axes.append([(key, (item.input_line or "").partition("=")[2], False)])
    total = 1
    for axis in axes:
        total *= len(axis)
    if total > limit:
        raise UserError("multirun", f"{total} points", f"is more than {limit}.",
                        "sweep fewer values, or split the sweep.")
    points = []
    for index, combo in enumerate(itertools.product(*axes)):
        # Swept values come back from Hydra written as in an override (strings quoted).
        points.append(Point(index, tuple(f"{k}={v}" for k, v, _ in combo),
                            tuple((k, v.strip("'\"")) for k, v, swept in combo if swept)))
    return points


def _swept_values(item: Any, key: str, overrides: Sequence[str]) -> list[str]:
    """The grid values of one swept override, glob() over the group's options included."""
    from hydra.core.override_parser.types import Glob, ValueType  # deferred: hydra

    typed = (item.input_line or "").partition("=")[2]
    if item.value_type == ValueType.INTERVAL_SWEEP:
        raise UserError(key, typed, "interval() is a continuous range, which a grid sweep "
                        "cannot enumerate.", "list the values, or use range(start,stop,step).")
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


def chunks(count: int, size: int) -> list[range]:
    """Consecutive index ranges of at most ``size`` (arrays that fit MaxArraySize)."""
    if size < 1:
        raise ValueError("chunk size must be positive")
    return [range(start, min(start + size, count)) for start in range(0, count, size)]
