"""A torchrun-style script, run unchanged on every rank under a supervisor (this process).

The supervisor (supervise/supervisor.py, as for the trainer) starts the script with the
torchrun variables set: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR/MASTER_PORT pointing at the store rank 0's supervisor holds, and
TORCHELASTIC_USE_AGENT_STORE=True, so ``init_process_group("nccl")`` joins that store as
under torchrun (no port to pick, none to collide). Arguments reach the script as data; what
``hpc_ddp.context()`` in the script reads is added (script_environment).

Then it waits, and acts on how the script ended (rank 0 decides for the job):

=====================================  =========================================
exit 0                                 done; rank 0 writes summary.json
exit 0 after ctx.should_stop() agreed  stopped: requeue (as the built-in trainer)
exit 75 (``REQUEUE_EXIT_CODE``)        the script checkpointed and asks: requeue
killed by SIGTERM                      preempted or cancelled: left to Slurm
                                       (after the requeue signal: requeue)
killed by the requeue signal           it does not handle it: stopped, said so
killed by SIGKILL/SIGABRT/SIGSEGV...   died abruptly (NCCL's watchdog, the OOM
                                       killer): a failure that is requeued
any other exit code                    the script's own error: not requeued
=====================================  =========================================

Signals: on Slurm, slurmstepd signals every process of the step (the script too); run locally
(submitit's local executor signals only this process), the supervisor passes them on.
"""

from __future__ import annotations

import dataclasses
import logging
import shlex
import signal
import sys
import time
from collections.abc import MutableMapping
from typing import Any

from hpc_ddp.config.schema import Config
from hpc_ddp.rank.contract import (
    DATA_ROOT_ENV,
    REQUEUE_EXIT_CODE,
    REQUEUE_EXIT_ENV,
    REQUEUE_SIGNAL_ENV,
    RESUME_CAUSE_ENV,
    RUN_DIR_ENV,
    STOP_FILE_ENV,
    SYNC_PROBE_ENV,
    SYNC_SUFFIX,
)
from hpc_ddp.rank.join.distenv import step_signals_every_process
from hpc_ddp.rank.join.joined import Rank, joined
from hpc_ddp.rank.join.rendezvous import endpoint_file
from hpc_ddp.rank.services import checkpoint, stopping, trackers
from hpc_ddp.rank.services.stopping import StopRequest
from hpc_ddp.rank.supervise import diagnose, generations, handover
from hpc_ddp.rank.supervise.generations import End, Generation
from hpc_ddp.rank.supervise.outcome import (
    after_generations,
    after_stop,
    record_restart,
    write_summary,
)
from hpc_ddp.rank.supervise.supervisor import (
    ABRUPT,
    Child,
    Supervised,
    child_environment,
    exit_codes,
    last_lines,
    run_generations,
)
from hpc_ddp.rundir import RunDir, read_json
from hpc_ddp.slurm import requeue

log = logging.getLogger(__name__)


def command(cfg: Config) -> list[str]:
    """The script's command line: ``python path args`` or ``python -m module args``, through
    script_main (the same run, without a torch teardown crash after a clean end)."""
    assert cfg.script is not None
    wrapper = [sys.executable, "-m", "hpc_ddp.rank.main.script_runner"]
    if cfg.script.startswith("-m"):
        return [*wrapper, "-m", cfg.script[2:].strip(), *cfg.script_args]
    return [*wrapper, cfg.script, *cfg.script_args]


def shown(cfg: Config) -> str:
    """The script and its arguments, as the user gave them."""

    return " ".join(shlex.quote(a) for a in [cfg.script or "", *cfg.script_args])


def script_environment(cfg: Config, rank: Rank, run: RunDir, cause: str | None,
                       staged: dict[str, Any] | None) -> dict[str, str]:
    """What hpc_ddp.context() in the script reads (on top of the supervisor's child
    environment): the run dir, the stop file, the requeue exit code and signal, why it
    resumes, this node's copy of the data."""
    extra = {RUN_DIR_ENV: str(run.root), STOP_FILE_ENV: str(stop_file(run, rank)),
             REQUEUE_EXIT_ENV: str(REQUEUE_EXIT_CODE),
             REQUEUE_SIGNAL_ENV: cfg.cluster.signal.removeprefix("SIG")}
    if cause:
        extra[RESUME_CAUSE_ENV] = cause
    if staged is not None:
        extra[DATA_ROOT_ENV] = staged["root"]
    if rank.env.world_size >= 2 and cfg.trainer.strategy == "ddp":
        extra[SYNC_PROBE_ENV] = "1"  # script_runner follows its steps' gradient sync
    return extra


def stop_file(run: RunDir, rank: Rank) -> Any:
    """Where the script's rank 0 notes an agreed stop (one file per job attempt)."""

    return endpoint_file(run.rendezvous, rank.env).with_suffix(".stopped")


def supervise(cfg: Config, run: RunDir, environ: MutableMapping[str, str],
              cause: str | None, stop: StopRequest | None = None) -> dict[str, Any] | None:
    """Run the script on this rank and act on its end; the summary on rank 0. ``stop``:
    this process's (what it was signalled for so far is kept)."""
    children: list[Child] = []

    def forward(signum: int) -> None:
        for child in children[-1:]:
            child.signal(signum)

    stop = stop or StopRequest()
    # Where Slurm signals every process of the step, the script has the signal already.
    everyone = step_signals_every_process(environ)
    stop.install(cfg.cluster.signal, forward=None if everyone else forward)
    with joined(cfg, run, environ, group=False) as rank:
        from hpc_ddp.data.stage_run import stage_data  # deferred: concurrent, tarfile

        _, staged = stage_data(cfg, rank, run, environ)  # data.stage: this node's copy
        tracked = trackers.script_environment(cfg, run, environ) if rank.env.is_master else {}

        def child_command(generation: int, why: str | None) -> tuple[list[str], dict[str, str]]:
            extra = {**script_environment(cfg, rank, run, why or cause, staged), **tracked}
            return command(cfg), child_environment(rank, environ, extra, generation)

        def started(child: Child) -> None:
            children.append(child)
            if stop.code != stopping.NONE:
                # Signalled while joining or while the script started: the step's signal
                # came before the script existed. Passed on once it handles it (handover.py;
                # where it came as the script started, it has it twice: one per step is all
                # Slurm promises, a handler that stops is not hurt by a second).
                handover.start(child.proc.pid, stopping.signal_of(stop.code, cfg.cluster.signal),
                               child.signal, handover.grace_s(cfg.cluster.signal_delay_s),
                               lambda: child.proc.poll() is None)
            log.info("running %s on rank %d of %d", shown(cfg), rank.env.rank,
                     rank.env.world_size)

        began = time.perf_counter()
        budget = cfg.cluster.restarts_in_place
        ended = run_generations(rank, child_command,
                                lambda code, child, gen: classify(cfg, code, child, gen,
                                                                  environ),
                                stop, budget, started=started,
                                on_restart=lambda d, g: record_restart(d, g, rank, run, environ),
                                job_nodes=generations.slurm_nodes(rank, environ))
        after_generations(ended.decision, ended.generation, budget, cfg, rank, run, environ,
                          ended.end)
        return _outcome(ended, stop, cfg, rank, run, environ, began, staged)
    return None


def classify(cfg: Config, code: int, child: Child, gen: Generation,
             environ: MutableMapping[str, str] | None = None) -> End:
    """How the script ended on this rank (the table in the module docstring); ``environ``:
    the job's, to tell the time limit's requeue signal from a preemption's."""
    if gen.stopped_by_us:
        return gen.end_of(generations.STOPPED, code)
    if code in (0, REQUEUE_EXIT_CODE):
        return gen.end_of(generations.OK, code)
    tail = child.tail()
    if code < 0:
        name = signal.Signals(-code).name
        if -code == signal.SIGTERM:  # preempted, cancelled, the time limit: Slurm's
            return gen.end_of(generations.STOPPED, code)
        if -code == stopping.signal_number(cfg.cluster.signal):
            # Why it came (one squeue, rank 0's supervisor's: not one per rank of the job).
            job = requeue.slurm_job(environ) if environ is not None else None
            said = f"{name}, the requeue signal"
            if job and environ is not None and gen.rank.env.is_master:
                said = stopping.requeue_signal_said(name, stopping.time_left_s(job, environ),
                                                    cfg.cluster.signal_delay_s)
            return gen.end_of(generations.FINAL, code, (
                f"the script was ended by {said}, which it does not handle; it was not "
                f"requeued. To be requeued, handle {name}: save a "
                f"checkpoint and exit with code {REQUEUE_EXIT_CODE} (docs/your-code.md)."))
        abrupt = -code in ABRUPT
        return gen.end_of(generations.RESTARTABLE if abrupt else generations.FINAL, code, (
            f"the script died from {name}" + (" (an abort: NCCL's watchdog after a failed "
                                              "or timed-out collective, or a crash)" if abrupt
                                              else "") + last_lines(tail)))
    # Its own error, unless what it printed last is a lost peer or a failed collective.
    lost_peer = diagnose.reads_as_comm_failure(tail)
    return dataclasses.replace(gen.end_of(
        generations.RESTARTABLE if lost_peer else generations.FINAL, code,
        f"the script exited with code {code}{last_lines(tail)}"), symptom=lost_peer)


def _outcome(ended: Supervised, stop: StopRequest, cfg: Config, rank: Rank, run: RunDir,
             environ: MutableMapping[str, str], started: float,
             staged: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """After a generation every supervisor agreed was done: a stop the script agreed on or
    asked for (a requeue), Slurm's SIGTERM, or the end; the summary on rank 0."""
    code = ended.code
    step = _checkpoint_step(run)
    stopped_file = stop_file(run, rank)
    if code == 0 and stopped_file.is_file():
        agreed = int(stopped_file.read_text().strip() or stopping.REQUEUE)
        after_stop(agreed, step, stop, cfg, rank, run, environ)
    if code == REQUEUE_EXIT_CODE:
        after_stop(stopping.REQUEUE, step, stop, cfg, rank, run, environ)
    if code < 0:
        # Preempted, cancelled or at the time limit; after the requeue signal reached this
        # task too it is a stop for a requeue (as the built-in trainer's MAX of the two).
        after_stop(max(stopping.TERM, stop.code), step, stop, cfg, rank, run, environ)
    if code != 0:
        raise SystemExit(code)
    if not rank.env.is_master:
        return None

    result = read_json(stopped_file.with_suffix(".result.json")) or {}
    summary = {"program": f"script {shown(cfg)}",
               "world_size": rank.env.world_size, "num_nodes": rank.env.num_nodes,
               "train_time_s": time.perf_counter() - started,
               "exit_codes": exit_codes(ended.ends), "global_step": step,
               "restarts": rank.env.restart + ended.generation,
               **({"data_stage": staged} if staged is not None else {}),
               **(read_json(stopped_file.with_suffix(SYNC_SUFFIX)) or {})}
    return write_summary(rank, run, {**{k: v for k, v in result.items() if k not in summary},
                                     **summary, "result": result})


def _checkpoint_step(run: RunDir) -> int | None:
    """The step of the run's latest checkpoint, if the script uses hpc_ddp's."""
    return checkpoint.latest_step(run.checkpoints)
