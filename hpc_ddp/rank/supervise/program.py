"""The built-in trainer or a function entry on Slurm, in a child of a supervisor that outlives it.

Why: with torch 2.14 NCCL's watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, the default)
tears every rank's process down with SIGABRT after a collective fails or times out, so a
failure path inside the training process never runs: no error record, no restart, and Slurm
does not requeue a FAILED job. The decision therefore lives here, in a process that does no
collective and touches no GPU (https://pytorch.org/docs/stable/torch_nccl_environment_variables.html).
And a process that outlives the training can start it again in seconds: a restart in place
(supervise/generations.py) instead of a requeue that waits in the queue.

This process is the supervisor of supervise/supervisor.py (as a script's is) and starts the
training in ``python -m hpc_ddp.rank.main.child``: the child is a client of this store, its
keys apart from ours (rendezvous.connect), and dumps its stacks when asked (the relay). The
child handles signals, stops and checkpoints as ever; a failure it leaves to its supervisor
(outcome.fail). Here:

===================================  ==========================================
child exit 0                         done (or stopped and requeued by it): rank 0
                                     returns the summary the child wrote
exit RESTART_EXIT_CODE (76)          a failure a new start may get past (a lost
                                     peer, a failed collective): restart in place
killed by SIGABRT/KILL/SEGV/...      died abruptly: restart in place
any other exit code                  its own error (a bug, bad input): the job fails
killed by SIGTERM                    preempted or cancelled: left to Slurm
===================================  ==========================================

Every rank's training restarts when one fails (every supervisor stops its child), within
``cluster.restarts_in_place``; then the job is requeued within ``cluster.max_restarts``.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

from hpc_ddp.config.compose import to_yaml
from hpc_ddp.config.schema import Config
from hpc_ddp.config.supervision import supervised
from hpc_ddp.rank.contract import (
    EARLY_STOP_ENV,
    PROGRAM_CONFIG_ENV,
    PROGRAM_RUN_DIR_ENV,
    RESTART_EXIT_CODE,
    RESUME_CAUSE_ENV,
)
from hpc_ddp.rank.join.distenv import in_slurm_step, step_signals_every_process
from hpc_ddp.rank.join.joined import joined
from hpc_ddp.rank.services import stacks, stopping
from hpc_ddp.rank.services.stopping import StopRequest
from hpc_ddp.rank.supervise import generations
from hpc_ddp.rank.supervise.generations import End, Generation
from hpc_ddp.rank.supervise.hangs import HangWatch, hosts_of
from hpc_ddp.rank.supervise.outcome import after_generations, record_restart
from hpc_ddp.rank.supervise.supervisor import (
    ABRUPT,
    Child,
    child_environment,
    last_lines,
    run_generations,
)
from hpc_ddp.rundir import RunDir, read_json

log = logging.getLogger(__name__)


def wanted(cfg: Config, environ: Mapping[str, str]) -> bool:
    """Supervise here: a Slurm step's task (not a local run, not already the child, not a
    script, which has its own supervisor, not under torchrun, which is one) when
    cluster.supervise says so; unset, when the ranks may restart in place
    (cluster.restarts_in_place > 0) or use GPUs (NCCL's watchdog). A second interpreter
    start per rank is what a failure that costs seconds instead of a queue wait costs."""
    if not (in_slurm_step(environ) and cfg.script is None and PROGRAM_CONFIG_ENV not in environ
            and "TORCHELASTIC_RUN_ID" not in environ):
        return False
    return supervised(cfg)


def child_command() -> list[str]:
    # Through the script runner: a clean end is not turned into an abort by torch's teardown.
    return [sys.executable, "-m", "hpc_ddp.rank.main.script_runner",
            "-m", "hpc_ddp.rank.main.child"]


def classify(cfg: Config, code: int, child: Child, gen: Generation) -> End:
    """How this rank's training process ended (the table in the module docstring)."""
    if gen.stopped_by_us:
        return gen.end_of(generations.STOPPED, code)
    if code == 0:
        return gen.end_of(generations.OK, code)
    if code == RESTART_EXIT_CODE:
        return gen.end_of(generations.RESTARTABLE, code, child.tail(), gen.child_cause())
    if code < 0:
        name = signal.Signals(-code).name
        if -code in ABRUPT:
            return gen.end_of(generations.RESTARTABLE, code, (
                f"the training process died from {name} (an abort: NCCL's watchdog after a "
                f"failed or timed-out collective, the out-of-memory killer, or a crash)"
                f"{last_lines(child.tail())}"))
        # SIGTERM (preempted, cancelled: Slurm's to act on) or the requeue signal's echo.
        return gen.end_of(generations.STOPPED, code)
    return gen.end_of(generations.FINAL, code, child.tail(), gen.child_cause())


def hang_watch(gen: Generation, cfg: Config, run: RunDir, signum: int | None) -> HangWatch:
    """Rank 0's watch over the generation's heartbeats (hangs.py): a hang fails it as
    restartable, every rank's process stopped."""
    def hung(cause: str, culprit: int) -> None:
        gen.fail(dataclasses.replace(gen.end_of(generations.RESTARTABLE, 0, cause),
                                     rank=culprit, host=hosts_of(run.ranks, [culprit]).get(
                                         culprit, "?"), stop_all=True))

    return HangWatch(gen.rank, gen.child_prefix, cfg.trainer.hang_timeout_s, run.logs,
                     run.ranks, signum, hung)


def supervise(cfg: Config, run: RunDir, environ: MutableMapping[str, str],
              stop: StopRequest) -> dict[str, Any] | None:
    """Run this rank's training in a child and act on how it ended; the summary on rank 0.
    ``stop``: this process's, installed (slurmstepd signals every process of the step: the
    child acts, this one only notes it; in podman only this one has it, and passes it on)."""
    told = [stopping.NONE]  # the stop the child's environment carries

    with joined(cfg, run, environ, group=False) as rank:
        def command(generation: int, cause: str | None) -> tuple[list[str], dict[str, str]]:
            extra = {PROGRAM_CONFIG_ENV: to_yaml(cfg), PROGRAM_RUN_DIR_ENV: str(run.root)}
            if cause:
                extra[RESUME_CAUSE_ENV] = cause
            env = child_environment(rank, environ, extra, generation)
            told[0] = stop.code
            if stop.code != stopping.NONE:  # signalled while joining: the child never saw it
                env[EARLY_STOP_ENV] = str(stop.code)
            return child_command(), env

        def started(child: Child) -> None:
            if not step_signals_every_process(environ):  # in podman: passed on from here
                stop.forward_to(child.signal)
            if stop.code > told[0]:
                # Signalled after its environment was made, before it ran (its start waits
                # for the node's warm process to import torch): the step's signal never
                # reached it. It starts with the signal blocked until it handles it.
                child.signal(stopping.signal_of(stop.code, cfg.cluster.signal))
            log.info("training in process %d under this supervisor (rank %d of %d)",
                     child.proc.pid, rank.env.rank, rank.env.world_size)

        budget = cfg.cluster.restarts_in_place
        signum = stacks.stack_signal(cfg.cluster.signal)
        ended = run_generations(
            rank, command, lambda code, child, gen: classify(cfg, code, child, gen), stop,
            budget, stack_signal=signum, started=started,
            on_restart=lambda d, g: record_restart(d, g, rank, run, environ),
            watch=lambda gen: hang_watch(gen, cfg, run, signum),
            blocked=frozenset({stopping.signal_number(cfg.cluster.signal), signal.SIGTERM}),
            job_nodes=generations.slurm_nodes(rank, environ))
        after_generations(ended.decision, ended.generation, budget, cfg, rank, run, environ,
                          ended.end)
        if ended.code != 0:  # stopped (SIGTERM: Slurm's to act on)
            raise SystemExit(ended.code if ended.code > 0 else 128 - ended.code)
        if rank.env.is_master:
            summary = read_json(run.summary)
            return summary if isinstance(summary, dict) else None
    return None
