"""Follow a submitted job to its end: progress while it trains, a results table at the end.

On a terminal a progress bar (rich); in a log, one plain line per logged step. While a
Slurm job is pending, why it waits (Slurm's reason in words); a job that can never start
(its reason says so) is not waited for: the reason and its fix are printed instead. If a
rank fails, the others would wait in a collective until the timeout: the job is cancelled
at once and the failing rank's last log lines are printed.
"""

from __future__ import annotations

import shlex
import sys
import time
from typing import Any, TextIO

from hpc_ddp.launch.control import failed_ranks
from hpc_ddp.rank.join.ranklog import tail
from hpc_ddp.rank.supervise.diagnose import LOCAL_MARK
from hpc_ddp.ranklines import for_terminal
from hpc_ddp.rundir import RunDir, read_json, resume_command
from hpc_ddp.watch.sync_lines import percent, summary_cell

POLL_S = 0.5
# Seconds the other ranks get to report on their own after one rank reported a failure
# (longer than rank 0's extra rendezvous wait, so it can name the ranks that never came).
FAILURE_GRACE_S = 15.0


def follow(job: Any, run: RunDir, out: TextIO = sys.stdout, poll_s: float = POLL_S,
           timeout_s: float | None = None, cancel_on_failure: bool = True) -> int:
    """Block until ``job`` ends; returns 0 on success, 1 on failure (after printing why).

    ``cancel_on_failure``: once a rank reported a failure, cancel the job after a grace
    period (local runs, where nothing else would end it). On Slurm the ranks requeue or end
    the job themselves, and the job is followed through its requeues to its final state.
    """
    reporter = _Reporter(out, since=time.time())
    failure_seen: float | None = None
    started = time.monotonic()
    try:
        while not job.done():
            pending = getattr(job, "pending", None)
            if pending is not None and pending.never:
                reporter.close()
                print(f"job {job.job_id} {pending.line()}\nIt stays queued until cancelled: "
                      f"python -m hpc_ddp.status {shlex.quote(str(run.root))} --cancel",
                      file=out, flush=True)
                return 1
            reporter.waits(pending)
            reporter.update(read_json(run.progress))
            if cancel_on_failure and failed_ranks(run):
                failure_seen = failure_seen or time.monotonic()
                if time.monotonic() - failure_seen > FAILURE_GRACE_S:
                    job.cancel(check=False)
                    break
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                print(f"still running after {timeout_s:.0f}s; not waiting any longer.", file=out)
                return 1
            time.sleep(poll_s)
        reporter.update(read_json(run.progress))
    finally:
        reporter.close()
    cost = _cost(run)
    summary = read_json(run.summary)
    state = getattr(job, "state", "")
    if getattr(job, "exit_code", ""):
        print(f"job {job.job_id} ended: {state} (exit code {job.exit_code})", file=out)
    if summary is not None and not failed_ranks(run) and state in ("", "COMPLETED", "FINISHED"):
        print(results_table(summary), file=out)
        for line in tracker_lines(run):
            print(line, file=out)
        return 0
    print(for_terminal(failure_report(run, job)), file=out)  # the ranks' words, defused
    if cost:
        print(f"cost: {cost}", file=out)
    return 1


def tracker_lines(run: RunDir) -> list[str]:
    """Where the run's W&B / MLflow runs are (trackers.json), with W&B's sync command."""
    from hpc_ddp.rank.services import trackers  # deferred (start-up): rank.services.trackers

    record = read_json(run.root / trackers.FILE) or {}
    return ([trackers.where_wandb(record["wandb"])] if "wandb" in record else []) + (
        [trackers.where_mlflow(record["mlflow"])] if "mlflow" in record else [])


def _cost(run: RunDir) -> str:
    """The ended run's cost in words, recorded in summary.json (runcost.finish)."""
    from hpc_ddp.watch import runcost  # deferred (start-up): runcost, slurm.state

    try:
        cost = runcost.finish(run)
    except OSError:
        return ""
    return runcost.line(cost) if cost is not None else ""


def results_table(summary: dict[str, Any]) -> str:
    """The summary as a table: what every run has, the built-in trainer's figures, and the
    numbers a user's program returned (rows without a value are left out)."""
    def fmt(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"  # as summary.json writes it
        return f"{value:.4f}" if isinstance(value, float) else str(value)

    speed = summary.get("samples_per_s")
    rows = [("world size", summary.get("world_size")), ("hosts", ", ".join(
        summary.get("nodes", []))), ("program", summary.get("program")),
            ("steps", summary.get("global_step")),
            ("epochs completed", summary.get("epochs_completed")),
            ("final train loss", summary.get("final_train_loss")),
            ("eval loss", summary.get("eval_loss")),
            ("eval accuracy", summary.get("eval_accuracy")),
            *[(f"eval {k}", v) for k, v in (summary.get("eval_metrics") or {}).items()
              if k not in ("loss", "accuracy")],
            *returned_rows(summary.get("result") or {})[:12],
            ("samples/s", f"{speed:.1f}" if isinstance(speed, int | float) else None),
            ("gradient sync", summary_cell(summary)),
            ("resumed from step", summary.get("resumed_from_step")),
            ("restarts", summary.get("restarts")), ("cost", _cost_cell(summary.get("cost")))]
    rows = [(name, v) for name, v in rows if v is not None and v != ""]
    width = max(len(name) for name, _ in rows)
    return "\n".join(["results:"] + [f"  {name:<{width}}  {fmt(v)}" for name, v in rows])


def _cost_cell(cost: Any) -> str | None:
    # deferred (start-up): slurm.cost, watch.runcost
    from hpc_ddp.slurm.cost import Cost
    from hpc_ddp.watch import runcost

    try:
        return runcost.line(Cost(**cost)) if isinstance(cost, dict) else None
    except TypeError:  # another version's fields
        return None


def returned_rows(result: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """What a program returned, as table rows: numbers, strings and booleans, a dict's under
    dotted names (``metrics.f1``); lists and other values stay in summary.json only."""
    rows: list[tuple[str, Any]] = []
    for key, value in result.items():
        if isinstance(value, dict):
            rows += returned_rows(value, f"{prefix}{key}.")
        elif isinstance(value, int | float | str):  # bool is an int
            rows.append((f"{prefix}{key}", value))
    return rows


def error_message(run: RunDir, rank: int, max_lines: int = 12) -> str:
    """A rank's error as its error file begins: "rank N on host: message" (the whole message,
    which for a state-dict mismatch names the keys on the following lines)."""
    error = run.rank_error(rank)
    try:
        head = error.read_text().split("\n\n", 1)[0].splitlines()
    except OSError:
        return f"rank {rank}: no error file"
    head = head[:max_lines] + (["..."] if len(head) > max_lines else [])
    return "\n".join(head).replace(f"{LOCAL_MARK} ", "")


def last_stop(run: RunDir) -> dict[str, Any] | None:
    """The stop the run ended with (events.jsonl's last line, when it is a stop)."""
    from hpc_ddp import events  # deferred (start-up): events

    found = events.read(run.root)
    if not found or found[-1].get("kind") != events.STOP:
        return None
    try:  # a stop of an earlier submission (job.json is rewritten by each) is not this one's
        submitted = (run.root / "job.json").stat().st_mtime
    except OSError:
        submitted = 0.0
    return found[-1] if found[-1].get("time", 0.0) >= submitted else None


def stopped_how(files: Any, killed: bool) -> str:
    """Where a local run stopped: at a checkpoint (nothing lost), or killed (a second Ctrl-C)
    with the steps after its last checkpoint lost, counted from the last logged step."""
    # deferred (start-up): rank.services.checkpoint
    from hpc_ddp.rank.services.checkpoint import latest_step

    saved = latest_step(files.checkpoints)
    stop = last_stop(files)
    if stop is not None and not killed:
        return f"stopped at step {stop.get('step')} with a checkpoint; nothing is lost."
    checkpoint = "no checkpoint yet" if saved is None else f"the latest checkpoint is step {saved}"
    if not killed:  # the ranks ended without recording a stop (e.g. before the first step)
        return f"stopped; {checkpoint}."
    progress = read_json(files.progress) or {}
    reached = progress.get("step")
    if not isinstance(reached, int) or (saved or 0) >= reached:
        return f"killed; {checkpoint}, and no logged step after it is lost."
    return (f"killed at step {reached} (the last one logged) or a little later; {checkpoint}: "
            f"{reached - (saved or 0)} step(s) are lost and will be trained again.")


def stop_report(run: RunDir, job: Any) -> str | None:
    """A stop someone asked for (a signal, a cancel) is not a failure: where it stopped and
    how to go on; None when the run did not end with such a stop."""

    stop = last_stop(run)
    if stop is None or failed_ranks(run):
        return None
    return (f"job {job.job_id} stopped at step {stop.get('step')} ({stop.get('cause')}); the "
            f"checkpoint is saved. Continue with: {resume_command(run.root)}")


def failure_report(run: RunDir, job: Any) -> str:
    stopped = stop_report(run, job)
    if stopped is not None:
        return stopped
    ranks = failed_ranks(run)
    state = getattr(job, "state", "?")
    lines = [f"job {job.job_id} failed (state {state})."]
    if ranks:
        from hpc_ddp.watch import failures  # deferred (start-up): failures

        lines += failures.report(run, ranks)
    else:
        lines.append(error_message(run, 0))
        if run.rank_log(0).exists():  # a rank that never started python has none
            lines += [f"last lines of {run.rank_log(0)}:", tail(run.rank_log(0), 15)]
        lines += [f"no rank reported an error; the launcher's output (submitit's, or srun's "
                  f"step-*.out) is under {run.submitit}"]
    return "\n".join(lines)


# progress.json keys that are not a scalar to show.
_PROGRESS_KEYS = ("step", "total_steps", "epoch", "time", "stopped")
# The built-in trainer's figures, shown in their own words (trainer/throughput.py).
_THROUGHPUT = ("loss", "samples_per_s", "lr", "samples_per_s_per_rank", "step_ms", "own_ms",
               "mfu", "slowest_rank", "slowest_behind", "sync_share")


def progress_text(progress: dict[str, Any]) -> str:
    """"loss 0.1234  5000 samples/s  epoch 1" for the built-in trainer; a user's own
    logged scalars (up to four) otherwise."""
    parts = []
    number = {k: v for k, v in progress.items() if isinstance(v, int | float)}
    if "loss" in number:
        parts.append(f"loss {number['loss']:.4f}")
    if "samples_per_s" in number:
        per_rank = number.get("samples_per_s_per_rank")
        parts.append(f"{number['samples_per_s']:.0f} samples/s" + (
            f" ({per_rank:.0f}/rank)" if per_rank is not None else ""))
    if "step_ms" in number:
        parts.append(f"{number['step_ms']:.1f} ms/step")
    if "sync_share" in number:  # trainer/sync_probe.py
        parts.append(f"sync {percent(number['sync_share'])}")
    if "mfu" in number:
        parts.append(f"MFU {100 * number['mfu']:.1f}%")
    if "slowest_rank" in number and "slowest_behind" in number:
        parts.append(f"slowest: rank {number['slowest_rank']:.0f} "
                     f"+{100 * number['slowest_behind']:.0f}%")
    others = [(k, v) for k, v in number.items() if k not in _PROGRESS_KEYS
              and k not in _THROUGHPUT]
    parts += [f"{k} {v:.4g}" for k, v in others[:4]]
    if progress.get("epoch") is not None:
        parts.append(f"epoch {progress['epoch']}")
    return "  ".join(parts)


class RunView:
    """What follow() needs of a Run (job_id, state, exit_code, pending, done, cancel): one
    Slurm query per done(), whose answer the other members reuse."""

    def __init__(self, run: Any) -> None:
        from hpc_ddp.slurm.fit import lazy_partitions  # deferred: the typed schemas

        self.run = run
        self.job_id = run.job_id
        self.pending: Any = None  # slurm_reasons.Pending while the job waits
        self._last: Any = None
        self._facts = lazy_partitions()
        self._requests: dict[Any, Any] = {}

    @property
    def state(self) -> str:
        return self._last.state if self._last is not None else str(self.run.state)

    @property
    def exit_code(self) -> str:
        return self._last.exit_code if self._last is not None else ""

    def done(self) -> bool:
        from hpc_ddp.slurm.reasons import pending_of  # deferred: the typed schemas

        self._last = self.run.job.state()  # one look, as the job's kind looks (control.py)
        self.pending = pending_of(self._last, self.run.run_dir, self._facts, self._requests)
        return bool(self._last.finished)

    def cancel(self, check: bool = False) -> None:
        """After a rank failed (follow's grace is over): end the others now, as failed."""
        self.run.job.end_now(check=check)


def stage_text(stage: dict[str, Any]) -> str:
    """"staging data on node1: 1.2 of 4.0 GiB (30%), 210 MB/s"."""
    done, total = stage.get("done", 0), stage.get("total", 0)
    share = f" ({100 * done / total:.0f}%)" if total else ""
    return (f"staging data on {stage.get('host', '?')}: {done / 2**30:.2f} of "
            f"{total / 2**30:.2f} GiB{share}, {stage.get('rate', 0) / 1e6:.0f} MB/s")


class _Reporter:
    def __init__(self, out: TextIO, since: float) -> None:
        self.out = out
        self.since = since  # progress written before this (an earlier attempt) is not news
        self.last_step: int | None = None
        self.last_wait: str | None = None
        self.staged_at: float | None = None
        self.bar: Any = None
        if getattr(out, "isatty", lambda: False)():
            # deferred: rich
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("{task.fields[counter]}"), BarColumn(),
                                TextColumn("{task.description}"), TimeRemainingColumn())
            self.bar.start()
            self.task = self.bar.add_task("starting: waiting for the first logged step",
                                          total=None, counter="")

    def waits(self, pending: Any) -> None:
        """Why the job waits (slurm_reasons.Pending), said when it changes."""
        line = pending.line() if pending is not None else None
        if line == self.last_wait:
            return
        self.last_wait = line
        if line is None:
            return
        if self.bar is not None:
            self.bar.update(self.task, description=f"pending: {line}")
        else:
            print(f"pending: {line}", file=self.out, flush=True)

    def update(self, progress: dict[str, Any] | None) -> None:
        if progress and isinstance(progress.get("stage"), dict):
            self._staging(progress)
            return
        if not progress or progress.get("step") == self.last_step:
            return
        if progress.get("time", self.since) < self.since:
            return
        self.last_step = progress["step"]
        text = progress_text(progress)
        if progress.get("stopped"):  # the agreed stop's step: a checkpoint, not a speed
            text = f"{text}  stopped: checkpoint saved".strip()
        total = progress.get("total_steps") or None
        counter = f"step {progress['step']}" + (f"/{total}" if total else "")
        if self.bar is not None:
            self.bar.update(self.task, completed=progress["step"], total=total,
                            description=text, counter=counter)
        else:
            print(f"{counter}  {text}", file=self.out, flush=True)

    def _staging(self, progress: dict[str, Any]) -> None:
        """Rank 0's node copying the data set (data.stage): bytes and rate."""
        if progress.get("time", self.since) < self.since or progress["time"] == self.staged_at:
            return
        self.staged_at = progress["time"]
        text = stage_text(progress["stage"])
        if self.bar is not None:
            self.bar.update(self.task, description=text)
        else:
            print(text, file=self.out, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
