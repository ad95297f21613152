"""The command line of a run: a script's arguments after ``--``, ``--config-dir``, the script
path made absolute, the script's arguments kept across a resume."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_ddp.errors import UserError

if TYPE_CHECKING:  # the type only: the schema's dataclasses take ~0.1 s to build
    from hpc_ddp.config.schema import Config


def split_script_args(args: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """(the command's own arguments, a script's arguments after ``--``; None without ``--``)."""
    args = list(args)
    if "--" not in args:
        return args, None
    cut = args.index("--")
    return args[:cut], args[cut + 1:]


def take_config_dir(args: Sequence[str]) -> list[str]:
    """``--config-dir DIR`` / ``--config-dir=DIR`` / ``-cd DIR`` (Hydra's spelling) as the
    override ``config_dir=<absolute DIR>``, which the run saves (a resume finds it again)."""

    # deferred: the typed schemas
    from hpc_ddp.config.compose import quoted

    kept: list[str] = []
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        name, eq, value = arg.partition("=")
        if name not in ("--config-dir", "-cd"):
            kept.append(arg)
            continue
        if not eq:
            if not rest or rest[0].startswith("-"):
                raise UserError("option", name, "needs a folder.",
                                f"write {name} DIR, e.g. {name} conf.")
            value = rest.pop(0)
        kept.append(f"config_dir={quoted(str(Path(value).expanduser().absolute()))}")
    return kept


def absolute_script(script: str | None, cwd: Path) -> str | None:
    """A script path made absolute (the ranks and a later resume may start elsewhere); a
    module (``-m pkg.train``) as it is."""
    if script is None or script.startswith("-m"):
        return script
    return str((cwd / Path(script).expanduser()).absolute())


def with_script_args(cfg: Config, script_args: Sequence[str] | None) -> Config:
    """The script's arguments: those given, else on a resume the run's own (they are not
    overrides, so overrides.yaml does not hold them)."""
    # deferred: the typed schemas
    from hpc_ddp.config.validate import validate_entry

    if script_args is None and cfg.resume and cfg.run_dir:
        # deferred (start-up): config.yaml_guard, inputs.run_dir
        from hpc_ddp.config import yaml_guard
        from hpc_ddp.inputs.run_dir import read_saved

        text = read_saved(Path(cfg.run_dir), "config.yaml", cfg.run_dir)
        data = yaml_guard.load(text, f"{cfg.run_dir}/config.yaml") if text else None
        if isinstance(data, dict):
            old = data.get("script_args") or []
            script_args = [str(a) for a in old] if cfg.script else None
    if script_args is None:
        return cfg
    return validate_entry(dataclasses.replace(cfg, script_args=list(script_args)))
