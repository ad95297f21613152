"""The Python API: compose, submit, watch and collect runs from a notebook or a script.

    import hpc_ddp
    cfg = hpc_ddp.compose(["model=resnet18", "trainer.max_steps=200"])
    run = hpc_ddp.submit(["model=resnet18", "trainer.max_steps=200", "run_dir=/tmp/r1"])
    run.wait()                      # progress, then the summary as a dict
    run.scalars()["train/loss"]     # [(step, value), ...]
    run = hpc_ddp.Run.from_dir("/tmp/r1")   # after a kernel restart: the same run

``python -m hpc_ddp.submit`` is a thin layer over :func:`plan` and :func:`submit`, so both
accept the same overrides and refuse bad ones with the same :class:`~hpc_ddp.errors.UserError`.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from hpc_ddp.config import secrets
from hpc_ddp.config.schema import Config
from hpc_ddp.errors import UserError
from hpc_ddp.launch.control import JOB_FILE as JOB_FILE  # job.json: its readers name it here
from hpc_ddp.launch.control import JobControl, control
from hpc_ddp.launch.target import LaunchTarget
from hpc_ddp.launch.target import target as launch_target
from hpc_ddp.rundir import RunDir, created_with, read_json, write_json

if TYPE_CHECKING:
    from hpc_ddp.slurm.reasons import Pending
    from hpc_ddp.slurm.state import JobState



class RunFailed(RuntimeError):
    """The run ended without completing; the message has the failing rank's last lines."""


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


def compose(overrides: Sequence[str] | str = (), config_dir: Path | str | None = None) -> Config:
    """The checked config for these overrides (same grammar and errors as the CLI);
    ``config_dir``: your config folder, searched before hpc_ddp's conf/."""
    from hpc_ddp.config.compose import compose as _compose  # deferred (start-up): config.compose

    return _compose(_as_list(overrides), config_dir)


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


def _as_list(overrides: Sequence[str] | str) -> list[str]:
    """A list of overrides; one string is split as a shell would ("model=x trainer.seed=1")."""
    if isinstance(overrides, str):
        return shlex.split(overrides)
    return list(overrides)


def plan(overrides: Sequence[str] | str = (), cwd: Path | None = None,
         environ: Mapping[str, str] | None = None, composed: Config | None = None, *,
         config_dir: Path | str | None = None, entry: str | Callable[..., Any] | None = None,
         script_args: Sequence[str] | None = None, check: bool = True) -> Plan:
    """Compose, merge a resumed run's overrides, resolve the target, check inputs, your code
    and the run dir.

    ``composed``: the config of ``overrides`` when the caller composed it already (a sweep
    composes all its points at once). ``config_dir``: your config folder; ``entry``: your
    function ("pkg.module:main", or the function itself); ``script_args``: a script's
    arguments (None: none, or on a resume the run's own); ``check`` false: leave your code
    unchecked (--cfg shows a config whose `_target_` fails). Raises UserError on bad input;
    touches no existing run.
    """
    # deferred (start-up): config.compose, inputs.command_line, inputs.resume_check, inputs.run_dir,
    # launch.check_code, launch.resolve
    from hpc_ddp.config.compose import check_overrides
    from hpc_ddp.inputs import run_dir as run_inputs
    from hpc_ddp.inputs.command_line import with_script_args
    from hpc_ddp.inputs.resume_check import check_resumable
    from hpc_ddp.launch import resolve as _resolve
    from hpc_ddp.launch.check_code import check_code

    extra, pickled = program_overrides(entry, config_dir)
    given = _as_list(overrides) + extra
    if composed is None:  # resume=2 must be refused as such, not read as resume=true here
        check_overrides(given)
    merged = _resolve.merge_resume_overrides(given)
    environ = os.environ if environ is None else environ
    cwd = cwd or Path.cwd()
    cfg, layout = _resolve.resolve_with_layout(composed or compose(merged), environ, cwd)
    cfg = with_script_args(cfg, script_args)
    cfg, hidden = secrets.extract(cfg)  # literal secrets become references, values travel apart
    merged = secrets.scrub_overrides(merged, secrets.marks_of(cfg))
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
    current = Run(run.root, record)
    if not current.done():

        raise UserError("run_dir", str(run.root), f"its {current.kind} job {current.job_id} is "
                        "still running; a second one would train into the same files.",
                        "wait for it to end, or stop it first: python -m hpc_ddp.status "
                        f"{shlex.quote(str(run.root))} --cancel (it checkpoints), then resume.")


def target(cfg: Config) -> LaunchTarget:
    """The launch target for cfg's cluster kind (launch/target.py)."""
    return launch_target(cfg.cluster.kind)


def submit(overrides: Sequence[str] | str | Plan = (), cwd: Path | None = None, *,
           config_dir: Path | str | None = None, entry: str | Callable[..., Any] | None = None,
           script_args: Sequence[str] | None = None) -> Run:
    """Submit a run (local or Slurm, as the config says) and return its handle at once.

    ``entry``: your own function run on every rank with a Context ("pkg.module:main" or the
    function; one defined in a notebook is pickled into the run dir); ``config_dir``: your
    config folder; ``script_args``: the arguments of a ``script=`` (docs/your-code.md).
    """
    from hpc_ddp.inputs.run_dir import write_run_config  # deferred (start-up): inputs.run_dir

    chosen = overrides if isinstance(overrides, Plan) else plan(
        overrides, cwd, config_dir=config_dir, entry=entry, script_args=script_args)
    with created_with(chosen.cfg.cluster.umask), _undone_on_failure(chosen.run_dir):
        write_run_config(chosen.run_dir, chosen.cfg, chosen.overrides)
        if chosen.entry_callable is not None:
            _pickle_entry(chosen.run_dir, chosen.entry_callable)
        with secrets.exported(chosen.secrets):  # sbatch's (or the local ranks') environment
            job = target(chosen.cfg).submit(chosen.cfg, chosen.run_dir)
    record = {"kind": chosen.cfg.cluster.kind, "job_id": str(job.job_id),
              "submitted": time.time()}
    if chosen.cfg.cluster.kind != "slurm":  # a process of this machine: submitit's or srun
        record["controller_pid"] = job.pid
        record["controller_start"] = job.started
    history = (read_json(chosen.run_dir.root / JOB_FILE) or {}).get("history", [])
    write_json(chosen.run_dir.root / JOB_FILE, {**record, "history": [*history, record]})
    return Run(chosen.run_dir.root, record, job)


def _pickle_entry(run: RunDir, fn: Callable[..., Any]) -> None:
    import cloudpickle  # deferred: cloudpickle, hostlist

    from hpc_ddp.rank.main.entry import PICKLED

    with open(run.root / PICKLED, "wb") as handle:
        cloudpickle.dump(fn, handle)


@contextlib.contextmanager
def _undone_on_failure(run: RunDir) -> Iterator[None]:
    """A submission that fails leaves the run dir as it found it: a new one is removed (so
    the same run_dir can be used again), a resumed run gets its config files back."""
    existed = run.root.exists()
    entries = set(run.root.iterdir()) if existed else set()
    made = [p for p in (run.root, *run.root.parents) if not p.exists()]  # outputs/, too
    saved = {p: p.read_bytes() for p in (run.config, run.overrides) if p.is_file()}
    try:
        yield
    except BaseException:
        if not existed:
            shutil.rmtree(run.root, ignore_errors=True)
            for parent in made[1:]:  # the folders made above it, while they are empty
                with contextlib.suppress(OSError):
                    parent.rmdir()
        else:
            for path in set(run.root.iterdir()) - entries:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
            for path, data in saved.items():
                path.write_bytes(data)
        raise


class Run:
    """A submitted run: its job, its files, its results. Cheap to re-create from a run dir."""

    def __init__(self, run_dir: Path | str, job: Mapping[str, Any], handle: Any = None) -> None:
        # Absolute: a handle outlives a chdir (a notebook's), and its files are named in full.
        self.run_dir = Path(run_dir).expanduser().absolute()
        self.kind: str = str(job["kind"])
        self.job_id: str = str(job["job_id"])
        self._record = dict(job)
        # How its kind is watched and ended (launch/control.py); submitit's job object
        # when submitted from this process.
        self.job: JobControl = control(self.run_dir, self._record, handle)

    @classmethod
    def from_dir(cls, run_dir: Path | str) -> Run:
        """The handle of the run in ``run_dir`` (its latest submission)."""
        record = read_json(Path(run_dir) / JOB_FILE)
        if record is None and (Path(run_dir) / "remote.json").is_file():
            raise UserError("run_dir", str(run_dir), "is a remote run's local handle.",
                            "open it with hpc_ddp.open_run(run_dir): docs/remote.md.")
        if record is None:
            raise UserError("run_dir", str(run_dir), "holds no submitted run (no job.json).",
                            "pass the run_dir a submission printed.")
        return cls(run_dir, record)

    def __repr__(self) -> str:
        return f"Run({str(self.run_dir)!r}, {self.kind} job {self.job_id}, {self.state})"

    @property
    def files(self) -> RunDir:
        return RunDir(self.run_dir)

    @property
    def job_ids(self) -> list[str]:
        """Every job id this run was submitted as (a resume is a new submission)."""
        history = self._record.get("history") or [self._record]
        return [str(h["job_id"]) for h in history]

    # -- state -------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """One word, the same for local runs and Slurm (docs/api.md#states): PENDING,
        RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, REQUEUED, ...; Slurm's own text
        ("CANCELLED by 1000") is ``job_state().raw``."""
        return self.job_state().state

    def job_state(self) -> JobState:
        """The state now: ``.state`` (one word), ``.raw`` (Slurm's text), ``.exit_code``,
        ``.reason`` (Slurm's pending reason); one squeue call (sacct once it has ended)."""
        return self.job.state()

    def pending_reason(self) -> Pending | None:
        """Why a PENDING Slurm job waits, in words, and whether it can ever start
        (``.never``, with ``.fix``); None when it is not pending."""
        # deferred (start-up): slurm.fit, slurm.reasons
        from hpc_ddp.slurm.fit import lazy_partitions
        from hpc_ddp.slurm.reasons import pending_of

        return pending_of(self.job_state(), self.run_dir, lazy_partitions())

    def done(self) -> bool:
        return self.job.done()

    def cancel(self, check: bool = False, grace_s: float = 60.0) -> bool:
        """Cancel the run if it has not ended; True when something was cancelled.

        Slurm: scancel (the ranks get SIGTERM, checkpoint and stop). Local: the same SIGTERM,
        then this waits up to ``grace_s`` for the checkpoint before it kills what is left.
        """
        return self.job.cancel(check=check, grace_s=grace_s)

    def wait(self, timeout: float | None = None, progress: bool = True,
             out: TextIO | None = None) -> dict[str, Any]:
        """Block until the run ends; its summary, or RunFailed with the failing rank's lines.

        ``timeout`` in seconds raises TimeoutError (the run goes on); ``progress`` prints a
        line (a bar on a terminal) per logged step.
        """

        from hpc_ddp.watch.follow import RunView, follow  # deferred (start-up): follow

        sink = (out or sys.stdout) if progress else io.StringIO()
        view = RunView(self)
        started = time.monotonic()
        code = follow(view, self.files, sink, poll_s=self.job.poll_s, timeout_s=timeout,
                      cancel_on_failure=self.job.follower_ends_failures)
        if code == 0:
            return self.summary() or {}
        if view.pending is not None and view.pending.never:
            raise RunFailed(f"job {self.job_id} {view.pending.line()}")
        if timeout is not None and time.monotonic() - started >= timeout and not self.done():
            raise TimeoutError(f"{self!r} still running after {timeout:.0f}s")
        from hpc_ddp.watch.follow import failure_report  # deferred (start-up): follow

        raise RunFailed(failure_report(self.files, view))

    # -- results -----------------------------------------------------------------------------
    def summary(self) -> dict[str, Any] | None:
        """summary.json as a dict (None until the run has finished)."""
        data = read_json(self.files.summary)
        return data if isinstance(data, dict) else None

    def progress(self) -> dict[str, Any] | None:
        data = read_json(self.files.progress)
        return data if isinstance(data, dict) else None

    def log_tail(self, lines: int = 20, rank: int = 0) -> str:
        from hpc_ddp.rank.join.ranklog import tail  # deferred (start-up): rank.join.ranklog

        return tail(self.files.rank_log(rank), lines)

    def scalars(self, tag: str | None = None) -> dict[str, list[tuple[int, float]]]:
        """TensorBoard scalars as {tag: [(step, value), ...]}, as TensorBoard reads them."""
        return scalars_in(self.files.tb, tag)

    def config(self) -> Config:
        from hpc_ddp.config.compose import from_yaml  # deferred (start-up): config.compose

        return from_yaml(self.files.config.read_text())

    def events(self) -> list[dict[str, Any]]:
        from hpc_ddp import events  # deferred (start-up): events

        return events.read(self.run_dir)


def scalars_in(tb: Path, tag: str | None = None) -> dict[str, list[tuple[int, float]]]:
    """The TensorBoard scalars of the events files in ``tb``: {tag: [(step, value), ...]}."""
    # deferred: tensorboard
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        EventAccumulator,
    )

    acc = EventAccumulator(str(tb), size_guidance={SCALARS: 0})
    acc.Reload()
    known = acc.Tags().get("scalars", [])
    if tag and tag not in known:
        raise KeyError(f"{tag!r}: the run logged no such scalar; it has "
                       f"{', '.join(sorted(known)) or 'none yet'}")
    tags = [tag] if tag else known
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags}
