"""An adaptive sweep's study: its settings from the command line, Optuna's storage, the trials.

    python -m hpc_ddp.submit -m hydra/sweeper=optuna 'optim.lr=tag(log, interval(1e-4, 1e-1))' \
        'optim=choice(sgd, adamw)' hydra.sweeper.n_trials=64 hydra.sweeper.n_jobs=8

The keys are the Optuna sweeper plugin's (``hydra.sweeper.*``:
https://hydra.cc/docs/plugins/optuna_sweeper/), plus ``hydra.sweeper.pruner`` (the plugin has
none) and ``sweep.objective``, the metric a trial is judged by. The study lives in Optuna's own
storage: a journal file in the sweep's folder (on the cluster's shared file system) unless
``hydra.sweeper.storage`` names a database URL. Workers (sweep/worker.py) draw trials from
it, each the moment it is free; this module is what they share.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpc_ddp.errors import UserError
from hpc_ddp.sweep import study_parts
from hpc_ddp.sweep.space import Space, search_space

STUDY = "study.json"          # the sweep folder's manifest of an adaptive sweep
JOURNAL = "study.journal"     # Optuna's journal storage, unless an URL is given
_LOCK = "study.lock"          # held while a worker draws a trial (n_trials is never passed)
_SWEEPER = "hydra/sweeper"
# The plugin's keys this sweep reads; any other hydra.sweeper key is refused, not ignored.
_KEYS = ("n_trials", "n_jobs", "direction", "study_name", "storage", "sampler", "pruner",
         "params", "seed")
# What the built-in trainer's summary holds of its last evaluation (eval_metrics).
_EVAL = "eval/"


@dataclass(frozen=True)
class StudySpec:
    n_trials: int = 20
    n_jobs: int = 2
    direction: tuple[str, ...] = ("minimize",)
    sampler: Any = None
    pruner: Any = None
    seed: int | None = None
    study_name: str | None = None
    storage: str | None = None
    objective: tuple[str, ...] = ("eval/loss",)
    params: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StudySpec:
        return cls(**{**data, "direction": tuple(data["direction"]),
                      "objective": tuple(data["objective"])})


def trial_dir(folder: Path, number: int) -> Path:
    """Trial ``number``'s run dir in the sweep's folder."""
    return folder / f"trial-{number}"


def is_adaptive(overrides: Sequence[str]) -> bool:
    """A multirun that asks for the Optuna sweeper (``hydra/sweeper=optuna``)."""
    return any(o.replace(" ", "") in (f"{_SWEEPER}=optuna", f"override{_SWEEPER}=optuna")
               for o in overrides)


def split(overrides: Sequence[str],
          environ: Mapping[str, str] | None = None) -> tuple[StudySpec, list[str]]:
    """The study's settings, and the overrides left for the trials (the space and the fixed
    ones). An ``hparams_search=NAME`` of your config folder (lightning-hydra-template's
    ``hparams_search/*.yaml``) gives its ``hydra.sweeper`` settings first; the command line
    wins. Raises UserError naming a bad key or value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser  # deferred: hydra

    from hpc_ddp.sweep.search_file import search_file  # deferred (start-up): search_file

    overrides = [*search_file(overrides, environ or {}), *overrides]
    settings: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {"sampler": {}, "pruner": {}, "params": {}}
    rest: list[str] = []
    for text in overrides:
        if text.partition("=")[0].strip() == "hparams_search":
            continue
        key, _, raw = text.partition("=")
        key = key.strip().lstrip("+~")
        if key in (_SWEEPER, f"override {_SWEEPER}"):
            if raw.strip() != "optuna":
                raise UserError(_SWEEPER, raw, "is not a sweeper hpc_ddp runs.",
                                "use hydra/sweeper=optuna (or leave it out for a grid).")
            continue
        if key == "sweep.objective":
            settings["objective"] = raw
            continue
        if not key.startswith("hydra.sweeper."):
            rest.append(text)
            continue
        name, _, sub = key.removeprefix("hydra.sweeper.").partition(".")
        if name not in _KEYS:
            raise UserError(key, raw, "is not a key of the Optuna sweeper.",
                            f"use one of hydra.sweeper.{{{','.join(_KEYS)}}} "
                            "(docs/sweeps.md#adaptive-sweeps).")
        if name == "params" and sub:
            nested["params"][sub] = raw  # the space's own syntax, read by search_space
            continue
        value = OverridesParser.create().parse_overrides([f"x={raw}"])[0].value()
        if sub and name in nested:
            nested[name][sub] = value
        elif sub:
            raise UserError(key, raw, f"hydra.sweeper.{name} has no keys of its own.",
                            f"write hydra.sweeper.{name}=<value>.")
        else:
            settings[name] = value
    for name in ("sampler", "pruner"):
        if nested[name]:
            given = settings.get(name)
            base = {"_target_": given} if isinstance(given, str) else dict(given or {})
            settings[name] = {**base, **nested[name]}
    return _spec(settings, nested["params"]), rest


def _spec(settings: dict[str, Any], params: dict[str, Any]) -> StudySpec:
    for name in ("n_trials", "n_jobs"):
        value = settings.get(name, getattr(StudySpec, name))
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"hydra.sweeper.{name}", value, "must be a whole number of 1 or "
                            "more.", f"e.g. hydra.sweeper.{name}=8.")
    direction = tuple(study_parts.directions(settings.get("direction")))
    objective = settings.get("objective") or ",".join(
        "eval/loss" if d == "minimize" else "eval/accuracy" for d in direction)
    names = tuple(n.strip() for n in str(objective).split(",") if n.strip())
    if len(names) != len(direction):
        raise UserError("sweep.objective", objective, f"names {len(names)} metric(s) and "
                        f"hydra.sweeper.direction {len(direction)}.",
                        "give one metric per direction, e.g. sweep.objective=eval/loss.")
    seed = settings.get("seed")
    return StudySpec(settings.get("n_trials", 20), settings.get("n_jobs", 2), direction,
                     settings.get("sampler"), settings.get("pruner"),
                     seed if isinstance(seed, int) else None, settings.get("study_name"),
                     settings.get("storage"), names, params)


def space_of(spec: StudySpec, trial_overrides: Sequence[str]) -> Space:
    return search_space(trial_overrides, spec.params)


def storage_url(spec: StudySpec, folder: Path) -> str:
    """Where the study is: the given URL, else the journal file in the sweep's folder."""
    return spec.storage or f"journal:{folder / JOURNAL}"


def storage(url: str) -> Any:
    """Optuna's storage of ``url``: ``journal:<file>`` (a file on a shared file system, with
    a lock that works over NFS: open(O_EXCL), not symlinks) or a database URL."""
    import optuna  # deferred: optuna

    if url.startswith("journal:"):
        from optuna.storages.journal import (  # deferred: optuna
            JournalFileBackend,
            JournalFileOpenLock,
        )

        path = url.removeprefix("journal:")
        _check_journal(Path(path))
        return optuna.storages.JournalStorage(
            JournalFileBackend(path, lock_obj=JournalFileOpenLock(path)))
    try:  # no heartbeat: Optuna beats only inside optimize(); a worker resumes its own trial
        return optuna.storages.RDBStorage(url)
    except Exception as exc:  # a driver missing, a server not answering: its own words
        raise UserError("hydra.sweeper.storage", url, f"cannot be opened: {exc}",
                        "give a database URL the login node and the nodes can reach (e.g. "
                        "mysql+pymysql://user@host/db?read_default_file=~/.my.cnf: the "
                        "password in your option file, not in the URL), or leave it out for "
                        "a journal file in the sweep's folder.") from None


def _check_journal(path: Path) -> None:
    """An existing journal is this user's, in a folder no one else can write: its records are
    the trials every worker runs (owned.py)."""
    from hpc_ddp.owned import Untrusted, open_owned  # deferred (start-up): owned

    try:
        open_owned(path, path.parent).close()
    except FileNotFoundError:
        return  # a new study: Optuna makes it
    except Untrusted as exc:
        raise UserError("hydra.sweeper.storage", f"journal:{path}", f"is not used: {exc}",
                        "run the sweep in a folder of your own (sweep.dir=...).") from None


def open_study(spec: StudySpec, url: str, name: str, space: Space, create: bool,
               stream: int = 0) -> Any:
    """The study (made when ``create``, else loaded), with its sampler and pruner;
    ``stream``: a worker's own random stream (study_parts.sampler)."""
    import optuna  # deferred: optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = study_parts.sampler(spec.sampler, space, len(spec.direction), spec.seed, stream)
    pruner = study_parts.pruner(spec.pruner, len(spec.direction))
    kwargs = {"study_name": name, "storage": storage(url), "sampler": sampler, "pruner": pruner}
    if create:
        directions: Any = list(spec.direction)  # minimize/maximize, checked (study_parts)
        return optuna.create_study(directions=directions, load_if_exists=True, **kwargs)
    return optuna.load_study(**kwargs)


def read_study(folder: Path) -> dict[str, Any] | None:
    """The sweep's study.json, None where there is none. It names the storage every worker
    and every trial's rank 0 opens, so it is read only as a file of this user's sweep folder
    that no one else can write (owned.py; a shared group folder is refused with the fix)."""
    from hpc_ddp.owned import Untrusted, read_owned  # deferred (start-up): owned

    try:
        data = json.loads(read_owned(folder / STUDY, folder))
    except FileNotFoundError:
        return None
    except Untrusted as exc:
        raise UserError("sweep folder", str(folder), f"is not used: {exc}",
                        "run the sweep in a folder of your own (sweep.dir=...).") from None
    except ValueError as exc:
        raise UserError("sweep folder", str(folder), f"holds a {STUDY} that is not JSON "
                        f"({exc}).", "use a new sweep.dir for a new study.") from None
    return data if isinstance(data, dict) else None


def running_trial(folder: Path, number: int) -> Any:
    """Trial ``number`` of the sweep in ``folder``, to report to and ask its pruner (a rank
    of the trial's run); None when the study is gone."""
    import optuna  # deferred: optuna

    manifest = read_study(folder)
    if manifest is None:
        return None
    spec = StudySpec.from_json(manifest["spec"])
    store = storage(manifest["storage"])
    study = optuna.load_study(
        study_name=manifest["study_name"], storage=store,
        pruner=study_parts.pruner(spec.pruner, len(spec.direction)))
    trial_id = store.get_trial_id_from_study_id_trial_number(
        store.get_study_id_from_name(manifest["study_name"]), number)
    return optuna.trial.Trial(study, trial_id)


def tell(study: Any, number: int, values: Any = None, state: Any = None) -> None:
    """Record a trial's end. Optuna's grid sampler calls ``study.stop()`` once its grid is
    done, which raises outside ``optimize``; the trial is stored by then (Optuna's tell
    stores it in a ``finally``), and workers stop drawing on the grid's end themselves."""
    try:
        study.tell(number, values, state=state)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise


def drawn_all(study: Any, spec: StudySpec, space: Space) -> bool:
    """The study has its trials: ``n_trials``, or as many as a grid has points (a grid's
    end ends the study, as in Optuna's optimize; the grid sampler draws each point once
    while any is left, running trials' points counted as taken)."""
    limit = spec.n_trials
    if type(study.sampler).__name__ == "GridSampler":
        limit = min(limit, math.prod(len(v) for v in study_parts.grid_of(space).values()))
    return len(study.trials) >= limit


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """One worker at a time draws a trial (the count and the ask are one step)."""
    with open(folder / _LOCK, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def objective_values(spec: StudySpec, summary: Mapping[str, Any] | None,
                     result: Any = None) -> tuple[list[float] | None, str]:
    """The trial's values for the study and what was read (or why there is none): the
    built-in trainer's last evaluation (``eval/<name>``), or what an entry returned (a number,
    or a dict with the objective's names)."""
    found: list[float] = []
    for name in spec.objective:
        value = _metric(name, summary or {}, result)
        if value is None:
            offered = sorted(f"{_EVAL}{k}" for k in (summary or {}).get("eval_metrics") or {})
            return None, (f"the run reported no {name} (its evaluations: "
                          f"{', '.join(offered) or 'none'}; an entry returns a number or a "
                          f"dict with {name}, a script writes one to "
                          f"$HPC_DDP_RUN_DIR/objective.json); the trial is FAILED, and the "
                          "study goes on")
        found.append(value)
    return found, ", ".join(f"{n}={v:.6g}" for n, v in zip(spec.objective, found, strict=True))


def _metric(name: str, summary: Mapping[str, Any], result: Any) -> float | None:
    if isinstance(result, int | float) and not isinstance(result, bool) and len(name) > 0:
        value: Any = result
    elif isinstance(result, Mapping) and name in result:
        value = result[name]
    else:
        value = (summary.get("eval_metrics") or {}).get(name.removeprefix(_EVAL))
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
