"""How a rank's program ended, acted on: the summary, a stop (requeue or exit), a failure.

The same for every program a rank runs (the built-in trainer, a function entry, a script
under its supervisor): a stop at an agreed step ends in a requeue within
``cluster.max_restarts`` (or a clear exit); a failure is named (this rank's own error, or the
rank that stopped answering) and requeued when a new attempt may get past it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import traceback
from collections.abc import MutableMapping
from typing import Any, NoReturn

from hpc_ddp import events
from hpc_ddp.config.schema import Config
from hpc_ddp.rank.contract import COLD_NOTE, DRIVEN_ENV, RESTART_EXIT_CODE, WARM_NOTE_ENV
from hpc_ddp.rank.join import checkin, device, nccl, ranklog, tracebacks
from hpc_ddp.rank.join.joined import Rank, RunStopped, record_error
from hpc_ddp.rank.services import checkpoint, stacks, stopping
from hpc_ddp.rank.services.stopping import StopRequest
from hpc_ddp.rank.supervise import diagnose, generations
from hpc_ddp.rank.supervise.generations import Decision, cause_key
from hpc_ddp.rundir import RunDir, read_json, resume_command, write_json
from hpc_ddp.slurm import requeue

log = logging.getLogger(__name__)


def write_summary(rank: Rank, run_dir: RunDir, summary: dict[str, Any]) -> dict[str, Any]:
    """Rank 0: the summary with where every rank ran (read from the rendezvous store, not
    gathered from every rank), into summary.json; TensorBoard hparams for a sweep point."""
    env = rank.env
    placed = checkin.placements(rank.store, env.world_size) if rank.store is not None else []
    hosts = [str(p.get("host")) for p in placed]
    # job_id: the id the job was submitted as (job.json's); launch_id: this attempt's own
    # (its rendezvous files, ranks/*.json's job_id). docs/run-directory.md#summaryjson
    summary.update(hosts=hosts, nodes=sorted(set(hosts), key=hosts.index),
                   job_id=env.submitted_id or env.job_id, launch_id=env.job_id,
                   gpu_map=[p for p in placed if p.get("physical") is not None],
                   gpu_collisions=device.collisions(placed))
    # What failures cost: restarts in place, requeues, nodes left out (events.jsonl).
    summary.update(events.recovery(events.read(run_dir.root)))
    # How rank 0's processes started: "warm" (forked from its node's warm process) or "cold"
    # (rank/warm/), and the note its log has.
    note = os.environ.get(WARM_NOTE_ENV) or COLD_NOTE
    summary.update(start=note.partition(":")[0], start_note=note)
    if rank.environment is not None:  # the software fingerprint (rank/join/envcheck.py)
        summary["environment"] = rank.environment
    for shared in summary["gpu_collisions"]:
        log.warning("ranks %s share GPU %s on %s", shared["ranks"], shared["gpu"], shared["host"])
    write_json(run_dir.summary, summary)
    hparams = read_json(run_dir.hparams)  # written for sweep points
    if isinstance(hparams, dict) and hparams:
        # deferred (start-up): rank.services.metrics
        from hpc_ddp.rank.services.metrics import hparam_metrics, write_hparams

        write_hparams(run_dir.tb, hparams, hparam_metrics(summary))
    return summary


def after_stop(code: int, step: int | None, stop: StopRequest, cfg: Config, rank: Rank,
               run_dir: RunDir, environ: MutableMapping[str, str]) -> NoReturn:
    """All ranks stopped at the same step and the checkpoint is written: requeue or exit."""
    if not rank.env.is_master:
        raise SystemExit(0)  # rank 0 decides and reports
    at = f"step {step}" if step is not None else "the last checkpoint"
    job = requeue.slurm_job(environ)
    left = stopping.time_left_s(job, environ) if job else None
    cause = stopping.cause_of(code, left, cfg.cluster.signal_delay_s, job is not None)
    record = {"attempt": rank.env.restart, "step": step, "cause": cause, "job": job,
              "signals": [name for name, _ in stop.received]}
    resume_hint = resume_command(run_dir.root)
    if job is None:
        events.append(run_dir.root, {"kind": events.STOP, **record})
        raise RunStopped(f"stopped at {at} ({cause}); the checkpoint is saved. "
                         f"Continue with: {resume_hint}", requested=True)
    if code == stopping.TERM:
        # Preemption: Slurm itself requeues the job (PreemptMode=REQUEUE); a scancel ends it.
        events.append(run_dir.root, {"kind": events.STOP, **record})
        log.warning("stopped at %s on SIGTERM; checkpoint saved", at)
        raise SystemExit(0)
    used = events.restarts_spent(events.read(run_dir.root), job)
    if used >= cfg.cluster.max_restarts:
        events.append(run_dir.root, {"kind": events.STOP, **record})
        raise RunStopped(f"stopped at {at} ({cause}) and not requeued: "
                         f"cluster.max_restarts={cfg.cluster.max_restarts} requeues without "
                         "progress are used. "
                         f"The checkpoint is saved; continue with: {resume_hint} "
                         "(raise cluster.max_restarts or cluster.time_min for fewer stops).")
    problem = requeue.requeue(job, environ)
    if problem:
        events.append(run_dir.root, {"kind": events.STOP, **record})
        raise RunStopped(f"stopped at {at} ({cause}); the checkpoint is saved "
                         f"but `scontrol requeue {job}` failed: {problem}. Continue with: "
                         f"{resume_hint}")
    events.append(run_dir.root, {"kind": events.STOP, **record})
    events.append(run_dir.root, {"kind": events.REQUEUE, **record})
    log.warning("stopped at %s (%s): checkpoint saved, job %s requeued", at, cause, job)
    raise SystemExit(0)


def after_failure(exc: Exception, cfg: Config, rank: Rank, run_dir: RunDir,
                  environ: MutableMapping[str, str]) -> NoReturn:
    """Name the cause: this rank's own error, or the rank that failed or stopped answering;
    on Slurm requeue from the last checkpoint if allowed and a new attempt may get past it.

    Whatever the world size, a rank does a few store operations and file reads here; one
    rank (the reporter of the failure) names the silent ranks, records the failure in
    events.jsonl and requeues (diagnose.py)."""
    env = rank.env
    if diagnose.is_comm_failure(exc):
        found = diagnose.survey(rank.store, env.rank, env.world_size, wait_s=5.0)
        lead = found.reporter == env.rank or (not found.store_alive and env.rank == _fallback(env))
        message = diagnose.explain(exc, found, env.rank, run_dir.ranks, search=lead,
                                   locate=lambda silent: _stacks_of(silent, cfg, rank, run_dir))
        peer = diagnose.peer_error(rank.store if found.store_alive else None, run_dir.logs)
        if peer is not None:  # a peer failed by itself; its error is the cause, not ours
            message = f"{peer} (this rank's collective failed as a result)"
        fail(message, peer is None, cfg, rank, run_dir, environ, exc, report=lead)
    own = diagnose.own_error(exc)
    diagnose.publish_own_failure(rank.store, f"rank {env.rank} on {rank.host}: {own}")
    fail(f"{diagnose.LOCAL_MARK} {own}", diagnose.worth_requeue(exc), cfg, rank, run_dir,
         environ, exc)


_ABOUT = re.compile(r"rank (\d+) on (\S+?): ")


def _fallback(env: Any) -> int:
    return diagnose.fallback_reporter(env.num_nodes, env.local_world_size, env.world_size)


def fail(message: str, retry: bool, cfg: Config, rank: Rank, run_dir: RunDir,
         environ: MutableMapping[str, str], exc: BaseException | None = None,
         report: bool = True, generation: int | None = None,
         deferred: bool = False, root: generations.End | None = None) -> NoReturn:
    """Record the failure and requeue (within max_restarts) when ``retry``: once per failure,
    by the first rank that reports it (a claim on the store; with the store gone, the
    fallback reporter). ``report`` false: this rank only raises (its error file says why).

    A training process under a supervisor records nothing and requeues nothing: it leaves
    its message for its supervisor and exits with RESTART_EXIT_CODE when a new start may get
    past it (``retry``), 1 when not; the supervisors decide together (generations.py) and
    rank 0's records the failure. ``generation``: the supervisors' generation that failed
    (default: this process's). ``deferred``: the job's driver acts on it (a node lost:
    slurm/driver.py); recorded as such, not requeued here."""
    message = ranklog.masked(message)  # it reaches events.jsonl, files and the console
    if rank.env.supervised:
        _tell_supervisor(message, retry, rank, run_dir, exc)
    job = requeue.slurm_job(environ)
    generation = rank.env.generation if generation is None else generation
    if not (report and _first_report(rank, generation)):
        raise RuntimeError(message) from exc
    seen = events.read(run_dir.root) if job is not None else []
    if _reported_already(seen, job, rank.env.restart, generation):
        # The claim fell back to this rank because the store is gone: its host (rank 0)
        # exited after the first reporter's decision (srun ends a step's other tasks once one
        # exits non-zero). That decision stands: no second record, and no requeue of a
        # failure judged final.
        raise RuntimeError(message) from exc
    # The rank the failure is about (a peer's own error, a rank that stopped answering),
    # else this one: status names the same rank as the submit command's report.
    # The supervisors' root cause when they decided (``root``: every record names the same
    # rank as the submit command's report), else the rank the message is about (a peer's own
    # error, a rank that stopped answering), else this one.
    bare = message.replace(f"{diagnose.LOCAL_MARK} ", "").replace(diagnose.LOCAL_MARK, "")
    about = _ABOUT.match(bare.strip())
    cause = bare.strip()[about.end():] if about else bare.strip()
    if root is not None and not (about and int(about[1]) == root.rank):
        cause = ranklog.masked(root.cause)  # this rank's message is its own, not the root's
    failed = tracebacks.child_failed(exc)
    record: dict[str, Any] = {
        "attempt": rank.env.restart, "generation": generation,
        "rank": root.rank if root else int(about[1]) if about else rank.env.rank,
        "host": root.host if root else about[2] if about else rank.host, **events.cause_fields(
            run_dir.root, cause, rank.env.restart, root.rank if root else rank.env.rank,
            generation),
        **({"failed_at": root.at} if root else {"failed_at": failed.at} if failed else {}),
        "job": job, "step": checkpoint.latest_step(run_dir.checkpoints),
        "reached": reached_step(run_dir), **({"deferred": True} if deferred else {})}
    traces = flight_dumps(run_dir)
    if traces:
        record["nccl_traces"] = traces
        message += (" NCCL flight recorder dumps (the last collectives of each rank): "
                    + ", ".join(traces[:8]))
    events.append(run_dir.root, {"kind": events.FAILURE, **record})
    if not retry or job is None or deferred:
        raise RuntimeError(message) from exc  # a new attempt would fail the same way
    already = any(e.get("kind") == events.REQUEUE and e.get("attempt") == rank.env.restart
                  and e.get("job") in (None, job) for e in seen)
    if not already and events.restarts_spent(seen, job) < cfg.cluster.max_restarts and (
            not requeue.requeue(job, environ)):
        events.append(run_dir.root, {"kind": events.REQUEUE, **record})
        message += f" Job {job} requeued from its last checkpoint."
    raise RuntimeError(message) from exc


def _tell_supervisor(message: str, retry: bool, rank: Rank, run_dir: RunDir,
                     exc: BaseException | None) -> NoReturn:
    """A supervised training process's end of a failure: its message on the store for its
    supervisor (generations.cause_key) and, when final, in its error file (one a restart in
    place gets past is not this rank's last word), then the exit code that says whether a new
    start may get past it."""
    text = message.replace(diagnose.LOCAL_MARK, "").strip()
    at = time.time()
    trace = ranklog.masked(tracebacks.program_traceback(exc)) if exc is not None and (
        diagnose.LOCAL_MARK in message) else ""
    full = ranklog.masked("".join(traceback.format_exception(exc))) if exc is not None else ""
    if retry:
        log.error("rank %d on %s failed: %s%s", rank.env.rank, rank.host, text,
                  f"\n{trace}" if trace else "")
    else:
        record_error(run_dir, rank.env.rank, rank.host, message, exc, at=at)
    try:  # what its supervisor's report says: the cause, when, and the program's frames
        if rank.store is not None:
            rank.store.set(cause_key(rank.env.rank), json.dumps(
                {"cause": text, "at": at, "trace": trace, "full": full,
                 "symptom": diagnose.LOCAL_MARK not in message}))
    except Exception:  # the store is gone with rank 0's supervisor: the tail says it
        pass
    raise SystemExit(RESTART_EXIT_CODE if retry else 1) from exc


def _reported_already(seen: list[dict[str, Any]], job: str | None, attempt: int,
                      generation: int = 0) -> bool:
    """A failure of this attempt (and generation) of Slurm job ``job`` is on record
    (events.jsonl)."""
    return job is not None and any(e.get("kind") == events.FAILURE and e.get("job") == job
                                   and e.get("attempt") == attempt
                                   and e.get("generation", 0) == generation for e in seen)


def _first_report(rank: Rank, generation: int = 0) -> bool:
    """This rank reports the failure of this attempt: the first to claim it on the store, or,
    with the store gone (it died with rank 0's process), the fallback reporter."""
    if rank.store is None:
        return True
    try:
        return int(rank.store.add(f"hpc_ddp/failure/{rank.env.restart}.{generation}", 1)) == 1
    except Exception:
        return rank.env.rank == _fallback(rank.env)


def _stacks_of(silent: list[int], cfg: Config, rank: Rank, run_dir: RunDir) -> dict[int, str]:
    """Ask the silent ranks for their Python stacks (services/stacks.py); where each one was."""
    stacks.request(rank.store, silent, run_dir.ranks, rank.host,
                   stacks.stack_signal(cfg.cluster.signal), logs=run_dir.logs)
    found = {r: stacks.where(run_dir.logs / f"rank{r}.stacks") for r in silent}
    return {r: place for r, place in found.items() if place}


def record_restart(decision: Decision, generation: int, rank: Rank, run_dir: RunDir,
                   environ: MutableMapping[str, str]) -> None:
    """Rank 0's supervisor, before every rank starts ``generation`` in place: the failure
    that ended the one before and the restart, in events.jsonl (status, the summary)."""
    root = decision.root
    assert root is not None
    record = {"attempt": rank.env.restart, "rank": root.rank, "host": root.host,
              **events.cause_fields(run_dir.root, ranklog.masked(root.cause),
                                    rank.env.restart, root.rank, generation - 1),
              "job": requeue.slurm_job(environ),
              "step": checkpoint.latest_step(run_dir.checkpoints),
              "reached": reached_step(run_dir), "nccl_traces": flight_dumps(run_dir)}
    events.append(run_dir.root, {"kind": events.FAILURE, **record, "generation": generation - 1,
                                 "failed_at": root.at})
    events.append(run_dir.root, {"kind": events.RESTART_IN_PLACE, **record,
                                 "generation": generation, "failed_at": root.at})


def flight_dumps(run_dir: RunDir, within_s: float = 600.0) -> list[str]:
    """The NCCL flight recorder's dumps of this failure (written in the last minutes) under
    logs/, for the report (rank/join/nccl.py FLIGHT_RECORDER_PREFIX)."""
    now = time.time()
    try:
        found = [p for p in run_dir.logs.glob(f"{nccl.FLIGHT_RECORDER_PREFIX}*")
                 if now - p.stat().st_mtime < within_s]
    except OSError:
        return []
    return sorted(f"logs/{p.name}" for p in found)


def reached_step(run_dir: RunDir) -> int | None:
    """How far the training had got, as its progress.json last said (rank 0 writes it every
    few seconds): a failure's steps lost are this less the step its restart resumed from."""
    progress = read_json(run_dir.progress)
    step = progress.get("step") if isinstance(progress, dict) else None
    return step if isinstance(step, int) else None


def after_generations(decision: Decision, generation: int, budget: int, cfg: Config,
                      rank: Rank, run_dir: RunDir, environ: MutableMapping[str, str],
                      mine: generations.End | None = None) -> None:
    """Act on the supervisors' decision on the last generation: nothing when it is done;
    else the failure recorded (once: rank 0's supervisor, or the fallback reporter when its
    store is gone) and the job requeued within max_restarts when a new attempt may get past
    it (the restarts in place spent, or a node lost); a final failure fails the job, each
    rank that failed by itself saying its own error (``mine``: how this rank's ended), the
    others the first failure."""
    if decision.what == generations.DONE:
        return
    root = decision.root
    said = f"rank {root.rank} on {root.host}: {root.cause}" if root is not None else ""
    # This rank's own process failed: its report (frames, time) is this rank's error
    own = mine is not None and mine.verdict in (generations.FINAL,
                                                generations.RESTARTABLE) and bool(mine.cause)
    child = tracebacks.ChildFailed(mine.cause, mine.at, mine.trace, mine.full) \
        if own and mine is not None else None
    if decision.what == generations.LOST and own and mine is not None and (
            mine.verdict == generations.FINAL and not mine.symptom):
        # Rank 0's supervisor is gone, but this rank's program failed by itself, in a way a
        # new start would not get past: that is the failure, not a lost node (no requeue).
        fail(f"{diagnose.LOCAL_MARK} {mine.cause}", False, cfg, rank, run_dir, environ, child,
             generation=generation, root=mine)
    if decision.what == generations.FAIL:
        fail(f"{diagnose.LOCAL_MARK} {mine.cause}" if own and mine else said, False, cfg,
             rank, run_dir, environ, child, report=rank.env.is_master, generation=generation,
             root=root)
    lost = decision.what == generations.LOST
    if lost:
        missing = ", ".join(str(r) for r in decision.missing)
        said = (f"the supervisor of rank(s) {missing} stopped answering (its node was lost, "
                f"or rank 0's with the store){': ' + said if said else ''}")
    elif budget:
        said += f" (the {budget} restart(s) in place of cluster.restarts_in_place are spent)"
    # A lost node under the job's driver: it starts the step again on the nodes left.
    is_root = child is not None and root is not None and root.rank == rank.env.rank
    fail(said, True, cfg, rank, run_dir, environ, child if is_root else None,
         report=rank.env.is_master or lost, generation=generation,
         deferred=lost and DRIVEN_ENV in environ, root=root)


def summary_line(summary: dict[str, Any]) -> str:
    """One line for the end of a rank-0 log or an srun's output: the step, the eval figures;
    a program of the user's that recorded no step (a script that never saved) by its name."""
    step = summary.get("global_step")
    figures = [f"step {step}" if step is not None else str(summary.get("program") or "")]
    for key in ("eval_loss", "eval_accuracy"):
        if isinstance(summary.get(key), float):
            figures.append(f"{key.replace('_', ' ')} {summary[key]:.4f}")
    return ", ".join(f for f in figures if f)
