"""Run a short per-rank program (the doctor, a benchmark) as a job, and wait for it.

The same path as ``python -m hpc_ddp.submit``: compose -> resolve -> run dir check -> local or
Slurm submission (``hpc_ddp.launch``), only with another task and a short time limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp.config.schema import Config
from hpc_ddp.errors import UserError
from hpc_ddp.launch.target import LaunchTarget
from hpc_ddp.launch.target import target as launch_target
from hpc_ddp.rundir import RunDir

# Diagnostics are short: a small time limit, and a rank that cannot join fails within a
# minute instead of training's 2 (rendezvous) and 5 (collectives). Their program runs in
# each task itself, not under a supervisor: a supervised task (training's default on
# Slurm) starts the node's warm process for a training process it never forks, then runs
# the program cold, two imports of torch a node (config/supervision.py); unsupervised, each
# task is forked warm. No supervisor, no node-loss driver: cluster.min_nodes set aside. The
# user's overrides win.
DEFAULT_OVERRIDES = ("cluster.time_min=10", "trainer.rendezvous_timeout_s=60",
                     "trainer.collective_timeout_s=120", "cluster.supervise=false",
                     "cluster.min_nodes=null")
# Messages of ranks that failed because another one did (the other one is the cause).
_CONSEQUENCES = ("never joined the rendezvous", "could not reach rank 0",
                 "for rank 0 (on", "Connection closed by peer", "Connection reset by peer",
                 "timed out", "Timeout")
_ERROR_LINE = re.compile(r"^rank (\d+) on (\S+?): (.*)$")


def stamp(now: _dt.datetime | None = None) -> str:
    """<date>_<time> to the millisecond, as the run dirs submit makes."""
    return (now or _dt.datetime.now()).strftime("%Y-%m-%d_%H-%M-%S-%f")[:-3]


def add_job_arguments(p: argparse.ArgumentParser, plot: str | None = None,
                      per: str = "") -> None:
    """The options every diagnostic job's command shares: --timeout-s, --no-plot (when it
    draws ``plot``), and the Hydra overrides."""
    p.add_argument("--timeout-s", type=float, default=None,
                   help=f"give up (and cancel the job) after this many seconds{per}")
    if plot is not None:
        p.add_argument("--no-plot", action="store_true", help=f"skip {plot}")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, the same as for submit")


def check_timeout(timeout_s: float | None) -> None:
    """--timeout-s, when given, is a positive number of seconds (0 would give up at once)."""
    if timeout_s is not None and not timeout_s > 0:
        raise UserError("--timeout-s", timeout_s, "must be a positive number of seconds.",
                        "e.g. --timeout-s 600, or leave it out to wait until the job ends.")


def default_run_dir(cwd: Path, name: str, now: _dt.datetime | None = None) -> Path:
    """outputs/<name>-<date>_<time> (a fresh folder per diagnostic run)."""
    return cwd / "outputs" / f"{name}-{stamp(now)}"


def prepare(overrides: Sequence[str], name: str, environ: Mapping[str, str],
            cwd: Path) -> tuple[Config, RunDir]:
    """Compose, resolve and check the run dir exactly as submit does (UserError on bad input)."""
    # deferred (start-up): config.compose, inputs.run_dir, launch.resolve
    from hpc_ddp.config.compose import compose
    from hpc_ddp.inputs import run_dir as run_inputs
    from hpc_ddp.launch import resolve as plan

    cfg = compose([*DEFAULT_OVERRIDES, f"cluster.job_name=hpc_ddp_{name}", *overrides])
    if cfg.run_dir is None:
        cfg = dataclasses.replace(cfg, run_dir=str(default_run_dir(cwd, name)))
    if cfg.resume:
        raise UserError("resume", "true", f"the {name} has no run to continue.",
                        "drop resume=true (each diagnostic run gets a new folder).")
    cfg = plan.resolve(cfg, environ, cwd)
    plan.check_local_gpus(cfg, environ)  # a config mistake, not a bad node
    assert cfg.run_dir is not None
    folder = Path(cfg.run_dir)
    if folder.is_dir() and any(folder.iterdir()):  # never into a training run, or another
        raise UserError("run_dir", cfg.run_dir, f"already holds files; the {name} writes only "
                        "into a new folder, and nothing there is touched.",
                        f"give a new run_dir, or none (outputs/{name}-<date>_<time> is made).")
    run = run_inputs.check_run_dir(cfg)
    run_inputs.write_run_config(run, cfg, overrides)
    return cfg, run


def target(cfg: Config) -> LaunchTarget:
    return launch_target(cfg.cluster.kind)


def submit_and_wait(cfg: Config, run: RunDir, task: Callable[[], Any], out: TextIO = sys.stdout,
                    timeout_s: float | None = None, poll_s: float = 0.5,
                    on_poll: Callable[[], None] | None = None) -> Any:
    """Submit ``task`` on every rank and block until the job ends (or is given up);
    ``on_poll`` runs at every poll and once at the end (to show progress)."""
    launcher = target(cfg)
    job = launcher.submit(cfg, run, task)
    print(f"hpc_ddp: {cfg.cluster.kind} job {job.job_id}: {launcher.describe(cfg)}\n"
          f"  run dir: {run.root}", file=out, flush=True)
    try:
        wait(job, run, out, timeout_s, poll_s, on_poll)
    except KeyboardInterrupt:
        # A diagnostic job has nothing to save: end it now (its processes ignore Ctrl-C).
        print(f"\ninterrupted: cancelling job {job.job_id}.", file=out, flush=True)
        job.cancel(check=False)
        raise
    return job


def wait(job: Any, run: RunDir, out: TextIO, timeout_s: float | None, poll_s: float,
         on_poll: Callable[[], None] | None = None) -> bool:
    """True if the job ended by itself. After a rank reports a failure the others get a grace
    to report theirs, then the job is cancelled (they would wait in a collective otherwise)."""
    from hpc_ddp.watch.follow import FAILURE_GRACE_S, failed_ranks  # deferred (start-up): follow

    poll = on_poll or (lambda: None)
    try:
        return _wait(job, run, out, timeout_s, poll_s, poll, FAILURE_GRACE_S, failed_ranks)
    finally:
        poll()


def _wait(job: Any, run: RunDir, out: TextIO, timeout_s: float | None, poll_s: float,
          poll: Callable[[], None], grace_s: float,
          failed_ranks: Callable[[RunDir], list[int]]) -> bool:
    started = time.monotonic()
    failure_seen: float | None = None
    while not job.done():
        poll()
        if failed_ranks(run):
            failure_seen = failure_seen or time.monotonic()
            if time.monotonic() - failure_seen > grace_s:
                job.cancel(check=False)
                return False
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            print(f"still running after {timeout_s:.0f}s; cancelling job {job.job_id}.",
                  file=out, flush=True)
            job.cancel(check=False)
            return False
        time.sleep(poll_s)
    return True


def did_not_finish(run: RunDir, out: TextIO) -> int:
    """A benchmark's job ended without its result: every rank's recorded failure, one line
    each; returns the exit code (1)."""
    print("bench: the job did not finish; rank errors:", file=out)
    for r, h, m, _ in rank_errors(run):
        print(f"  rank {r} on {h}: {m}", file=out)
    return 1


def rank_errors(run: RunDir) -> list[tuple[int, str, str, float]]:
    """(rank, host, message, time written) of every rank that recorded a failure."""
    from hpc_ddp.watch.follow import failed_ranks  # deferred (start-up): follow

    found = []
    for rank in failed_ranks(run):
        path = run.rank_error(rank)
        try:
            first = path.read_text().splitlines()[0]
            written = path.stat().st_mtime
        except (OSError, IndexError):
            continue
        match = _ERROR_LINE.match(first)
        if match:
            found.append((int(match.group(1)), match.group(2), match.group(3), written))
    return found


def culprit_hosts(errors: list[tuple[int, str, str, float]]) -> list[str]:
    """The hosts whose ranks failed for a reason of their own. Ranks that failed because
    another did (rendezvous timeouts, a closed connection) point at others: rank 0's
    rendezvous error names where the missing ranks were expected. If only consequences are
    left, the earliest failure is taken as the cause."""
    hosts: list[str] = []
    for _, host, message, _ in errors:
        if "never joined the rendezvous" in message:
            hosts += re.findall(r"expected on ([^)\s]+)\)", message)
        elif not any(c in message for c in _CONSEQUENCES):
            hosts.append(host)
    if not hosts and errors:
        hosts.append(min(errors, key=lambda e: e[3])[1])
    return list(dict.fromkeys(hosts))
