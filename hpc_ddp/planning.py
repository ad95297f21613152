"""The config pipeline, one line for one run or many: what a submit, a sweep's grid, a
study's trials and a remote submit's laptop-side check all call before anything starts.

    overrides -> checked, a resume's merged -> composed (Hydra once per group choice)
              -> resolved for the target -> a script's arguments -> secrets taken out
                 (one name per value across the runs: a job array shares one environment)
              -> inputs, your code, the run dir checked                            -> Plan

:func:`plan` is ``plan_many([overrides])[0]``; a failing run among many raises
:class:`~hpc_ddp.errors.PointError`, which names it by its index (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hpc_ddp.config import secrets
from hpc_ddp.config.schema import Config
from hpc_ddp.errors import PointError, UserError
from hpc_ddp.launch.control import JOB_FILE, control
from hpc_ddp.rundir import RunDir, read_json


@dataclass(frozen=True)
class Plan:
    """A submission resolved for its target, checked, not yet started."""

    cfg: Config
    overrides: list[str]
    run_dir: RunDir
    # A function entry no node could import by name (a notebook's): pickled into the run
    # dir at submission (hpc_ddp.rank.main.entry.from_pickle runs it).
    entry_callable: Any = None
    # Why the run gets the ranks and devices it gets (the submit command's first line).
    why: str = ""
    # Secret literals taken out of the config (config/secrets.py), for the job's environment.
    secrets: dict[str, str] = field(default_factory=dict)


def as_list(overrides: Sequence[str] | str) -> list[str]:
    """A list of overrides; one string is split as a shell would ("model=x trainer.seed=1")."""
    if isinstance(overrides, str):
        return shlex.split(overrides)
    return list(overrides)


def program_overrides(entry: str | Callable[..., Any] | None = None,
                      config_dir: Path | str | None = None) -> tuple[list[str], Any]:
    """Overrides for the API's ``entry`` and ``config_dir`` arguments, and the callable to
    pickle (a function no node could import by name, such as a notebook's)."""
    from hpc_ddp.config.compose import quoted  # deferred (start-up): config.compose

    extra: list[str] = []
    pickled = None
    if config_dir is not None:
        extra.append(f"config_dir={quoted(str(Path(config_dir).expanduser().absolute()))}")
    if callable(entry):
        # deferred: hostlist; start-up: targets
        from hpc_ddp.rank.main.entry import PICKLED_ENTRY
        from hpc_ddp.targets import TargetError, locate

        name = f"{getattr(entry, '__module__', '')}:{getattr(entry, '__qualname__', '')}"
        try:
            importable = "<" not in name and not name.startswith("__main__:") and (
                locate(name, "entry") is entry)
        except TargetError:
            importable = False
        extra.append(f"entry={name if importable else PICKLED_ENTRY}")
        pickled = None if importable else entry
    elif entry is not None:
        extra.append(f"entry={entry}")
    return extra, pickled


def composed(override_lists: Sequence[Sequence[str] | str]) -> tuple[list[list[str]],
                                                                    list[Config]]:
    """The pipeline's first half, for the remote path's laptop-side check too: each list's
    overrides checked (resume=2 refused as such), a resume's overrides merged, all composed
    at once. Returns the merged lists and their configs; PointError names a bad list."""
    # deferred (start-up): config.compose, launch.resolve
    from hpc_ddp.config.compose import check_overrides, compose_many
    from hpc_ddp.launch import resolve as _resolve

    merged = []
    checked: set[str] = set()  # a sweep's points share most overrides: each checked once
    for index, overrides in enumerate(override_lists):
        try:
            given = as_list(overrides)
            check_overrides([o for o in dict.fromkeys(given) if o not in checked])
            checked.update(given)
            merged.append(_resolve.merge_resume_overrides(given))
        except UserError as exc:
            raise PointError(index, exc) from None
    return merged, compose_many(merged)


def plan_many(override_lists: Sequence[Sequence[str] | str], cwd: Path | None = None,
              environ: Mapping[str, str] | None = None, *,
              config_dir: Path | str | None = None,
              entry: str | Callable[..., Any] | None = None,
              script_args: Sequence[str] | None = None, check: bool = True,
              timed: Callable[[str], Any] | None = None) -> list[Plan]:
    """Plan every run of ``override_lists`` (module doc); touches no existing run.

    ``config_dir``: your config folder; ``entry``: your function ("pkg.module:main", or the
    function itself); ``script_args``: a script's arguments (None: none, or on a resume the
    run's own); ``check`` false: leave your code unchecked (--cfg shows a config whose
    `_target_` fails); ``timed(phase)``: a context manager that times "composition" and
    "planning" (a sweep reports them). Raises PointError (a UserError) on bad input.
    """
    extra, pickled = program_overrides(entry, config_dir)
    lists = [as_list(o) + extra for o in override_lists]
    clock = timed or (lambda phase: contextlib.nullcontext())
    with clock("composition"):
        merged, configs = composed(lists)
    environ = os.environ if environ is None else environ
    cwd = cwd or Path.cwd()
    names = secrets.Names()  # one job array: one environment for every run's secrets
    plans: list[Plan] = []
    auto_kind: str | None = None
    for index, (overrides, cfg) in enumerate(zip(merged, configs, strict=True)):
        names.point = index
        if cfg.cluster.kind == "auto" and auto_kind:  # cluster=auto resolved once, not per run
            cfg = replace(cfg, cluster=replace(cfg.cluster, kind=auto_kind))
        try:
            with clock("planning"):
                plans.append(_plan_one(overrides, cfg, cwd, environ, script_args, check,
                                       names, pickled))
        except UserError as exc:
            raise PointError(index, exc) from None
        auto_kind = plans[-1].cfg.cluster.kind
    return plans


def plan(overrides: Sequence[str] | str = (), cwd: Path | None = None,
         environ: Mapping[str, str] | None = None, *, config_dir: Path | str | None = None,
         entry: str | Callable[..., Any] | None = None,
         script_args: Sequence[str] | None = None, check: bool = True) -> Plan:
    """One run's plan: ``plan_many([overrides])[0]`` (compose, merge a resumed run's
    overrides, resolve the target, check inputs, your code and the run dir)."""
    (one,) = plan_many([overrides], cwd, environ, config_dir=config_dir, entry=entry,
                       script_args=script_args, check=check)
    return one


def _plan_one(merged: list[str], cfg: Config, cwd: Path, environ: Mapping[str, str],
              script_args: Sequence[str] | None, check: bool, names: secrets.Names,
              pickled: Any) -> Plan:
    # deferred (start-up): inputs.command_line, inputs.resume_check, inputs.run_dir,
    # launch.check_code, launch.resolve
    from hpc_ddp.inputs import run_dir as run_inputs
    from hpc_ddp.inputs.command_line import with_script_args
    from hpc_ddp.inputs.resume_check import check_resumable
    from hpc_ddp.launch import resolve as _resolve
    from hpc_ddp.launch.check_code import check_code

    cfg, layout = _resolve.resolve_with_layout(cfg, environ, cwd)
    cfg = with_script_args(cfg, script_args)
    cfg, hidden = secrets.extract(cfg, names)  # literals become references, values apart
    merged = secrets.scrub_overrides(merged, secrets.marks_of(cfg), names)
    with secrets.exported(hidden):  # where the checks build parts, as the ranks will
        if check:
            run_inputs.check_inputs(cfg)
            check_code(cfg, cwd)
        _resolve.check_local_gpus(cfg, environ)
        run_dir = run_inputs.check_run_dir(cfg)
        if cfg.resume:
            _check_not_running(run_dir)
        check_resumable(cfg, run_dir)
    return Plan(cfg, merged, run_dir, pickled, layout.why, hidden)


def _check_not_running(run: RunDir) -> None:
    """A resume while the run's job still runs would train twice into the same files."""
    record = read_json(run.root / JOB_FILE)
    if not record:
        return
    if not control(run.root, record).done():
        raise UserError("run_dir", str(run.root), f"its {record['kind']} job "
                        f"{record['job_id']} is still running; a second one would train "
                        "into the same files.",
                        "wait for it to end, or stop it first: python -m hpc_ddp.status "
                        f"{shlex.quote(str(run.root))} --cancel (it checkpoints), then resume.")
