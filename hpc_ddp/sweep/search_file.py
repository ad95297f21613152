"""An ``hparams_search/<name>.yaml`` of your config folder, used unchanged.

lightning-hydra-template ships its searches as such files (``# @package _global_``, an
``override /hydra/sweeper: optuna`` default, ``optimized_metric``, and the plugin's
``hydra.sweeper`` block). ``-m hparams_search=NAME`` reads the file's ``hydra.sweeper``
settings and ``optimized_metric`` (the objective: what your entry returns under that name)
as the overrides they stand for, ahead of the command line's, which win.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.errors import UserError

GROUP = "hparams_search"
_TOP = {"defaults", "hydra", "optimized_metric"}
_PLUGIN = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"


def search_file(overrides: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """The overrides an ``hparams_search=NAME`` among ``overrides`` stands for; none
    without one."""
    names = [o.partition("=")[2].strip() for o in overrides
             if o.partition("=")[0].strip() == GROUP]
    if not names:
        return []
    folder = _config_dir(overrides, environ)
    path = folder / GROUP / f"{names[-1]}.yaml" if folder else None
    if path is None or not path.is_file():
        raise UserError(GROUP, names[-1], f"is not a file {GROUP}/{names[-1]}.yaml of your "
                        f"config folder ({folder or 'none given'}).",
                        "pass --config-dir DIR (the folder that holds hparams_search/), or "
                        "name a file that is there.")
    from hpc_ddp.config import yaml_guard  # deferred (start-up): config.yaml_guard

    data = yaml_guard.load(path.read_text(), str(path)) or {}
    if not isinstance(data, dict):
        raise UserError(GROUP, names[-1], f"{path} is not a mapping.", "see docs/sweeps.md.")
    other = sorted(set(data) - _TOP)
    if other:
        raise UserError(GROUP, names[-1], f"{path} sets {', '.join(other)}, which an "
                        "adaptive sweep does not read from it.",
                        f"give them as overrides, or in your primary config ({path.name} may "
                        "hold defaults, optimized_metric and hydra.sweeper).")
    sweeper = ((data.get("hydra") or {}).get("sweeper") or {})
    target = sweeper.get("_target_")
    if target not in (None, _PLUGIN):
        raise UserError(f"{GROUP} hydra.sweeper._target_", target, "is not the Optuna "
                        "sweeper.", f"use {_PLUGIN} (or leave it out).")
    found = [f"hydra.sweeper.{k}={_text(v)}" for k, v in sweeper.items()
             if k not in ("_target_", "sampler", "params", "pruner") and v is not None]
    for group in ("sampler", "pruner"):
        for key, value in (sweeper.get(group) or {}).items():
            found.append(f"hydra.sweeper.{group}.{key}={_text(value)}")
    for key, value in (sweeper.get("params") or {}).items():
        found.append(f"hydra.sweeper.params.{key}={value}")
    if data.get("optimized_metric"):
        found.append(f"sweep.objective={data['optimized_metric']}")
    return found


def _text(value: Any) -> str:
    from hpc_ddp.sweep.space import value_text  # deferred (start-up): sweep.space

    return value_text(value)


def _config_dir(overrides: Sequence[str], environ: Mapping[str, str]) -> Path | None:
    given = [o.partition("=")[2].strip().strip("'\"") for o in overrides
             if o.partition("=")[0].strip() == "config_dir"]
    folder = given[-1] if given else environ.get("HPC_DDP_CONFIG_DIR")
    return Path(folder) if folder else None
