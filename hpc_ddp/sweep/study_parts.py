"""An adaptive sweep's sampler, pruner and directions, from the Optuna sweeper plugin's keys.

The plugin (https://hydra.cc/docs/plugins/optuna_sweeper/) takes ``hydra.sweeper.sampler`` as
an object config, ``{_target_: optuna.samplers.TPESampler, seed: 123, n_startup_trials: 10}``,
which lightning-hydra-template's ``hparams_search/*.yaml`` files use as they are; a short name
(``tpe``) is taken too. ``hydra.sweeper.direction`` is ``minimize``, ``maximize`` or a list of
them (several objectives). The pruner is ours (the plugin has none): ``median``,
``successive_halving``, ``hyperband`` or an object config of any of Optuna's pruners.
Each bad value is refused with one line that names it and the fix, before anything is sent.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from hpc_ddp.errors import UserError
from hpc_ddp.sweep.space import Space

# Short names -> Optuna's classes (optuna.samplers / optuna.pruners).
SAMPLERS = {"tpe": "TPESampler", "random": "RandomSampler", "cmaes": "CmaEsSampler",
            "grid": "GridSampler", "nsgaii": "NSGAIISampler", "nsgaiii": "NSGAIIISampler",
            "qmc": "QMCSampler", "gp": "GPSampler", "bruteforce": "BruteForceSampler"}
PRUNERS = {"none": "NopPruner", "median": "MedianPruner", "percentile": "PercentilePruner",
           "successive_halving": "SuccessiveHalvingPruner", "hyperband": "HyperbandPruner",
           "threshold": "ThresholdPruner", "patient": "PatientPruner",
           "wilcoxon": "WilcoxonPruner"}
# Samplers that draw for several objectives at once (Optuna's docs, "multi-objective").
MULTI_OBJECTIVE = {"TPESampler", "RandomSampler", "NSGAIISampler", "NSGAIIISampler",
                   "QMCSampler", "GPSampler", "GridSampler", "BruteForceSampler"}


def directions(given: str | Sequence[str] | None) -> list[str]:
    """``minimize``/``maximize`` (or a list of them: several objectives); minimize unset."""
    items = [given] if isinstance(given, str) or given is None else list(given)
    items = [("minimize" if d is None else str(d).lower()) for d in items]
    for item in items:
        if item not in ("minimize", "maximize"):
            raise UserError("hydra.sweeper.direction", item, "is not a direction.",
                            "use minimize or maximize (a list of them for several "
                            "objectives: [minimize, maximize]).")
    if not items:
        raise UserError("hydra.sweeper.direction", "[]", "names no objective.",
                        "use minimize or maximize.")
    return items


def _spec(kind: str, spec: Mapping[str, Any] | str | None, default: str,
          names: Mapping[str, str]) -> tuple[str, dict[str, Any]]:
    """(class name in optuna.<kind>s, its arguments) of a short name or an object config."""
    key = f"hydra.sweeper.{kind}"
    if spec is None:
        return names[default], {}
    if isinstance(spec, str):
        args: dict[str, Any] = {}
        target = spec
    else:
        args = {k: v for k, v in spec.items() if k != "_target_"}
        target = str(spec.get("_target_", ""))
        if not target and kind == "sampler":  # the plugin's default: TPE, its keys given
            target = names[default]
        if not target:
            raise UserError(key, dict(spec), "has no _target_.",
                            f"give one, e.g. {key}._target_=optuna.{kind}s."
                            f"{names[default]}, or a short name: {key}={default}.")
    name = names.get(target.lower(), target.removeprefix(f"optuna.{kind}s."))
    if name not in names.values():
        shown = ", ".join(f"{short} ({cls})" for short, cls in names.items())
        raise UserError(key, target, f"is not one of Optuna's {kind}s this sweep takes.",
                        f"use one of: {shown}.")
    return name, args


def _make(kind: str, name: str, args: dict[str, Any]) -> Any:
    import optuna  # deferred: optuna

    cls = getattr(getattr(optuna, f"{kind}s"), name)
    accepted = inspect.signature(cls).parameters
    unknown = [a for a in args if a not in accepted]
    if unknown:
        raise UserError(f"hydra.sweeper.{kind}.{unknown[0]}", args[unknown[0]],
                        f"is not an argument of {name}.",
                        f"use its arguments: {', '.join(accepted)}.")
    try:
        return cls(**args)
    except (TypeError, ValueError) as exc:
        raise UserError(f"hydra.sweeper.{kind}", args, f"is refused by {name}: {exc}",
                        f"see optuna.{kind}s.{name} in Optuna's docs.") from None


def sampler(spec: Mapping[str, Any] | str | None, space: Space, objectives: int = 1,
            seed: int | None = None, stream: int = 0) -> Any:
    """The study's sampler (TPE unset); ``seed``: the plugin's own seed key, when the sampler
    config gives none. ``stream``: the worker's own (its index and start): workers seeded
    alike would draw the same values side by side (not a grid's: see below). A grid sampler
    draws from the space's choices and stepped ranges."""
    name, args = _spec("sampler", spec, "tpe", SAMPLERS)
    if objectives > 1 and name not in MULTI_OBJECTIVE:
        raise UserError("hydra.sweeper.sampler", name, f"draws for one objective, and "
                        f"hydra.sweeper.direction names {objectives}.",
                        "use tpe or nsgaii for several objectives.")
    if seed is not None and "seed" in inspect.signature(_class("sampler", name)).parameters:
        args.setdefault("seed", seed)
    # A grid sampler's seed orders its grid, and trial n takes point n of that order: every
    # worker must order it alike, so it keeps the one seed.
    if stream and isinstance(args.get("seed"), int) and name != "GridSampler":
        args["seed"] += 7919 * stream
    if name == "GridSampler" and "search_space" not in args:
        args["search_space"] = grid_of(space)
    return _make("sampler", name, args)


def _class(kind: str, name: str) -> Any:
    import optuna  # deferred: optuna

    return getattr(getattr(optuna, f"{kind}s"), name)


def grid_of(space: Space) -> dict[str, list[Any]]:
    """Every value of each parameter, for the grid sampler: choices and stepped ranges."""
    from optuna.distributions import CategoricalDistribution  # deferred: optuna

    grid: dict[str, list[Any]] = {}
    for key, dist in space.params.items():
        if isinstance(dist, CategoricalDistribution):
            grid[key] = list(dist.choices)
        elif getattr(dist, "step", None) and not getattr(dist, "log", False):
            count = round((dist.high - dist.low) / dist.step) + 1
            grid[key] = [dist.low + i * dist.step for i in range(count)]
        else:
            raise UserError(key, f"{type(dist).__name__}({dist.low}, {dist.high})",
                            "is a continuous range, which a grid cannot enumerate.",
                            f"use choice(...) or range(start, stop, step) for {key}, or "
                            "another sampler (tpe).")
    return grid


def pruner(spec: Mapping[str, Any] | str | None, objectives: int = 1) -> Any:
    """The study's pruner; none unset. Optuna prunes single-objective studies only."""
    name, args = _spec("pruner", spec, "none", PRUNERS)
    if objectives > 1 and name != "NopPruner":
        raise UserError("hydra.sweeper.pruner", name, "cannot prune a study of several "
                        "objectives (Optuna reports one value a step).",
                        "leave the pruner out, or sweep one objective.")
    if name == "PatientPruner" and "wrapped_pruner" in args:
        args["wrapped_pruner"] = pruner(args["wrapped_pruner"])
    return _make("pruner", name, args)
