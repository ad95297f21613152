"""An adaptive sweep's search space: Hydra's sweep syntax as Optuna distributions.

The syntax is the one the Optuna sweeper plugin (hydra-optuna-sweeper) reads, on the
command line or under ``hydra.sweeper.params`` in a config file
(https://hydra.cc/docs/plugins/optuna_sweeper/):

    optim.lr=tag(log, interval(1e-4, 1e-1))   FloatDistribution(0.0001, 0.1, log=True)
    trainer.batch_size=int(interval(32, 256)) IntDistribution(32, 256)
    optim=choice(sgd, adamw)   optim=sgd,adamw CategoricalDistribution(("sgd", "adamw"))
    model.width=range(64, 512, 64)            IntDistribution(64, 448, step=64)
    shuffle(range(1, 4))                      CategoricalDistribution((1, 2, 3))
    trainer.max_steps=500                     fixed: the same in every trial

One difference from the plugin: ``range(start, stop, step)`` means the values Python's range
gives (Hydra's grid sweeps read it so: ``stop`` is not among them); the plugin handed
``stop`` to Optuna as an inclusive bound, so its trials could use a value the grid never
would. Here ``range(64, 512, 64)`` tops out at 448 in both.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpc_ddp.errors import UserError

# The categories Optuna stores as they are; any other value (a list, a dict) goes in as the
# text of its override.
_PLAIN = (str, int, float, bool, type(None))
_BARE = re.compile(r"[\w.:/+-]+")


@dataclass(frozen=True)
class Space:
    # key -> Optuna distribution, in the order the keys were given.
    params: dict[str, Any] = field(default_factory=dict)
    # The overrides every trial gets as they are (nothing swept in them).
    fixed: tuple[str, ...] = ()


def search_space(overrides: Sequence[str], params: Mapping[str, Any] | None = None) -> Space:
    """The space of ``overrides`` and of the config's ``hydra.sweeper.params`` (key -> the
    same syntax); a key given on the command line wins over the config's. Hydra's own keys
    (``hydra.*``, ``hydra/...``) are the sweeper's settings, not the space: left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser  # deferred: hydra

    parser = OverridesParser.create()
    given = [f"{key}={value}" for key, value in (params or {}).items()]
    texts = [*given, *overrides]
    parsed = _parse(parser, texts)
    on_line = {_key(o) for o in parsed[len(given):]}
    found: dict[str, Any] = {}
    fixed: list[str] = []
    for index, (text, override) in enumerate(zip(texts, parsed, strict=True)):
        key = _key(override)
        if override.is_hydra_override() or key.startswith("hydra"):
            continue
        if index < len(given) and key in on_line:
            continue
        if not override.is_sweep_override():
            fixed.append(text)
            continue
        found.pop(key, None)
        found[key] = distribution(key, override)
    return Space(found, tuple(fixed))


def _parse(parser: Any, overrides: Sequence[str]) -> list[Any]:
    from hydra.errors import OverrideParseException  # deferred: hydra

    parsed = []
    for text in overrides:
        try:
            parsed.extend(parser.parse_overrides([text]))
        except OverrideParseException as exc:
            key = text.partition("=")[0]
            raise UserError(key, text, f"is not Hydra's override syntax: {exc.message}",
                            "write key=value, key=interval(low, high), key=choice(a, b) or "
                            "key=range(start, stop, step) (docs/sweeps.md).") from None
    return parsed


def _key(override: Any) -> str:
    return str(override.key_or_group)


def distribution(key: str, override: Any) -> Any:
    """The Optuna distribution of one swept override (its key names it in errors)."""
    from hydra.core.override_parser.types import (  # deferred: hydra
        ChoiceSweep,
        IntervalSweep,
        RangeSweep,
    )
    from optuna.distributions import (  # deferred: optuna
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    value = override.value()
    shown = (override.input_line or "").partition("=")[2] or str(value)
    tags = set(getattr(value, "tags", set()))
    if tags - {"log"}:
        raise UserError(key, shown, f"has the tag(s) {sorted(tags - {'log'})}; the only tag an "
                        "adaptive sweep reads is log.", f"write {key}=tag(log, interval(...)).")
    log = "log" in tags
    if isinstance(value, ChoiceSweep) or (isinstance(value, RangeSweep) and value.shuffle):
        if log:
            raise UserError(key, shown, "puts a log scale on a list of choices.",
                            "use tag(log, interval(low, high)) for a log-scaled range.")
        choices = [c if isinstance(c, _PLAIN) else value_text(c) for c in _values(value)]
        if not choices:
            raise UserError(key, shown, "has no values.", f"give at least one: {key}=a,b.")
        return CategoricalDistribution(tuple(choices))
    if isinstance(value, IntervalSweep):
        low: Any = value.start
        high: Any = value.end
        _check_bounds(key, shown, low, high, log)
        if isinstance(low, int) and isinstance(high, int):
            return IntDistribution(low, high, log=log)
        return FloatDistribution(float(low), float(high), log=log)
    if isinstance(value, RangeSweep):
        values = list(_values(value))
        if not values:
            raise UserError(key, shown, "gives no values (its stop is not past its start in "
                            "the step's direction).", f"write e.g. {key}=range(1, 10, 1).")
        step, low, high = value.step, min(values), max(values)
        _check_bounds(key, shown, low, high, log)
        if log and len(values) > 1:
            raise UserError(key, shown, "puts a log scale on a stepped range (Optuna takes a "
                            "step or a log scale, not both).",
                            f"write {key}=tag(log, int(interval({low}, {high}))).")
        if all(isinstance(v, int) for v in (low, high, step)):
            return IntDistribution(int(low), int(high), step=abs(int(step)), log=log)
        return FloatDistribution(float(low), float(high), step=abs(float(step)), log=log)
    raise UserError(key, shown, "is a sweep an adaptive sweep cannot draw from.",
                    "use interval(...), choice(...), range(...) or a list a,b,c.")


def _values(value: Any) -> list[Any]:
    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep  # deferred: hydra

    if isinstance(value, ChoiceSweep):
        return list(value.list)
    assert isinstance(value, RangeSweep)
    start: Any = value.start
    stop: Any = value.stop
    step: Any = value.step
    if not step or start is None or stop is None:
        return []
    out, current, index = [], start, 0
    while (current < stop) if step > 0 else (current > stop):
        out.append(current)
        index += 1
        current = start + index * step  # no drift from adding a float step again and again
        if len(out) > 1_000_000:
            break
    return out


def _check_bounds(key: str, shown: str, low: Any, high: Any, log: bool) -> None:
    if not all(isinstance(b, int | float) and math.isfinite(b) for b in (low, high)):
        raise UserError(key, shown, "needs two finite numbers as its bounds.",
                        f"write e.g. {key}=interval(0.001, 0.1).")
    if low > high:
        raise UserError(key, shown, f"has its low ({low}) above its high ({high}).",
                        f"swap them: {key}=interval({high}, {low}).")
    if log and low <= 0:
        bounds = f"interval({_above(high)}, {high})"
        if isinstance(low, int) and isinstance(high, int):
            bounds = f"int({bounds})"
        raise UserError(key, shown, f"puts a log scale on a range that reaches {low}: a log "
                        "scale needs both bounds above 0.",
                        f"start it above 0, e.g. {key}=tag(log, {bounds}).")


def _above(high: Any) -> str:
    return str(max(1, high // 1000)) if isinstance(high, int) else f"{high / 1000:g}"


def value_text(value: Any) -> str:
    """A value as an override writes it: true/false, null, numbers as Python prints them,
    a string bare when Hydra reads it back unchanged, else quoted."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        if _BARE.fullmatch(value) and not _reads_as_other(value):
            return value
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, list | tuple):
        return "[" + ",".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{value_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def _reads_as_other(text: str) -> bool:
    """Whether Hydra would read this bare word as something other than a string."""
    if text.lower() in ("true", "false", "null"):
        return True
    try:
        float(text)
    except ValueError:
        return False
    return True


def trial_overrides(space: Space, values: Mapping[str, Any]) -> list[str]:
    """A trial's overrides: the fixed ones, then each sampled value (pure)."""
    return [*space.fixed, *(f"{key}={value_text(values[key])}" for key in space.params)]
