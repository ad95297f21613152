"""The Python API: compose, submit, watch and collect runs from a notebook or a script.

    import hpc_ddp
    cfg = hpc_ddp.compose(["model=resnet18", "trainer.max_steps=200"])
    run = hpc_ddp.submit(["model=resnet18", "trainer.max_steps=200", "run_dir=/tmp/r1"])
    run.wait()                      # progress, then the summary as a dict
    run.scalars()["train/loss"]     # [(step, value), ...]
    run = hpc_ddp.Run.from_dir("/tmp/r1")   # after a kernel restart: the same run

``python -m hpc_ddp.submit`` is a thin layer over :func:`plan` and :func:`submit`, so both
accept the same overrides and refuse bad ones with the same :class:`~hpc_ddp.errors.UserError`;
:func:`plan_many` plans several runs at once as a sweep does (hpc_ddp/planning.py, the config
pipeline).
"""

from __future__ import annotations

import contextlib
import io
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from hpc_ddp.config import secrets
from hpc_ddp.config.schema import Config
from hpc_ddp.errors import UserError
from hpc_ddp.launch.control import JOB_FILE as JOB_FILE  # job.json: its readers name it here
from hpc_ddp.launch.control import JobControl, control
from hpc_ddp.launch.target import LaunchTarget
from hpc_ddp.launch.target import target as launch_target
from hpc_ddp.planning import Plan as Plan
from hpc_ddp.planning import as_list
from hpc_ddp.planning import plan as plan
from hpc_ddp.planning import plan_many as plan_many
from hpc_ddp.planning import program_overrides as program_overrides
from hpc_ddp.rundir import RunDir, created_with, read_json, write_json

if TYPE_CHECKING:
    from hpc_ddp.slurm.reasons import Pending
    from hpc_ddp.slurm.state import JobState



class RunFailed(RuntimeError):
    """The run ended without completing; the message has the failing rank's last lines."""


def compose(overrides: Sequence[str] | str = (), config_dir: Path | str | None = None) -> Config:
    """The checked config for these overrides (same grammar and errors as the CLI);
    ``config_dir``: your config folder, searched before hpc_ddp's conf/."""
    from hpc_ddp.config.compose import compose as _compose  # deferred (start-up): config.compose

    return _compose(as_list(overrides), config_dir)


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
