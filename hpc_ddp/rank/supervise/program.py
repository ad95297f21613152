"""The built-in trainer or a function entry on Slurm, in a child of a supervisor that outlives it.

Why: with torch 2.14 NCCL's watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, the default)
tears every rank's process down with SIGABRT after a collective fails or times out, so a
failure path inside the training process never runs: no error record, no requeue, and Slurm
does not requeue a FAILED job. The decision therefore lives here, in a process that does no
collective and touches no GPU (https://pytorch.org/docs/stable/torch_nccl_environment_variables.html).

This process is the supervisor of supervise/supervisor.py (as a script's is) and starts the
training in ``python -m hpc_ddp.rank.main.child``: the child is a client of this store, its
keys apart from ours (rendezvous.connect), and dumps its stacks when asked (the relay). The
child handles signals, stops, checkpoints and its own errors as ever. Here:

================================  =============================================
child exit 0                      done (or stopped and requeued by it): rank 0
                                  returns the summary the child wrote
child exit code > 0               it recorded its error: passed on
killed by SIGABRT/KILL/SEGV/...   died abruptly: recorded as a failure and the
                                  job requeued (once, within max_restarts)
killed by SIGTERM                 preempted or cancelled: left to Slurm
================================  =============================================
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

from hpc_ddp import events
from hpc_ddp.config.compose import to_yaml
from hpc_ddp.config.schema import Config
from hpc_ddp.rank.contract import EARLY_STOP_ENV, PROGRAM_CONFIG_ENV, PROGRAM_RUN_DIR_ENV
from hpc_ddp.rank.join.distenv import in_slurm_step
from hpc_ddp.rank.join.joined import Rank, joined
from hpc_ddp.rank.services import stacks, stopping
from hpc_ddp.rank.services.stopping import StopRequest
from hpc_ddp.rank.supervise.outcome import fail
from hpc_ddp.rank.supervise.supervisor import ABRUPT, Child, child_environment, run_child
from hpc_ddp.rundir import RunDir, read_json
from hpc_ddp.slurm import requeue

log = logging.getLogger(__name__)


def wanted(cfg: Config, environ: Mapping[str, str]) -> bool:
    """Supervise here: a Slurm step's task (not a local run, not already the child, not a
    script, which has its own supervisor, not under torchrun, which is one) when
    cluster.supervise says so; unset, when the ranks use GPUs (NCCL's watchdog). Two
    processes per rank cost a second interpreter start, which CPU/Gloo jobs need not pay:
    there a dead peer is an exception the other ranks handle."""
    if not (in_slurm_step(environ) and cfg.script is None and PROGRAM_CONFIG_ENV not in environ
            and "TORCHELASTIC_RUN_ID" not in environ):
        return False
    if cfg.cluster.supervise is not None:
        return cfg.cluster.supervise
    return bool(cfg.cluster.gpus_per_node) and cfg.trainer.device != "cpu"


def child_command() -> list[str]:
    # Through the script runner: a clean end is not turned into an abort by torch's teardown.
    return [sys.executable, "-m", "hpc_ddp.rank.main.script_runner",
            "-m", "hpc_ddp.rank.main.child"]


def supervise(cfg: Config, run: RunDir, environ: MutableMapping[str, str],
              stop: StopRequest) -> dict[str, Any] | None:
    """Run this rank's training in a child and act on how it ended; the summary on rank 0.
    ``stop``: this process's, installed (slurmstepd signals every process of the step: the
    child acts, this one only notes it)."""
    with joined(cfg, run, environ, group=False) as rank:
        env = child_environment(rank, environ, {PROGRAM_CONFIG_ENV: to_yaml(cfg),
                                                PROGRAM_RUN_DIR_ENV: str(run.root)})
        if stop.code != stopping.NONE:  # signalled while joining: the child never saw it
            env[EARLY_STOP_ENV] = str(stop.code)

        def started(child: Child) -> None:
            log.info("training in process %d under this supervisor (rank %d of %d)",
                     child.proc.pid, rank.env.rank, rank.env.world_size)

        code, child = run_child(rank, child_command(), env, stop, started=started,
                                stack_signal=stacks.stack_signal(cfg.cluster.signal))
        if code < 0 and -code in ABRUPT:
            _died(code, child, cfg, rank, run, environ)
        if code != 0:
            # The child's own error (recorded by it), or SIGTERM: Slurm's to act on.
            raise SystemExit(code if code > 0 else 128 - code)
        if rank.env.is_master:
            summary = read_json(run.summary)
            return summary if isinstance(summary, dict) else None
    return None


def _died(code: int, child: Child, cfg: Config, rank: Rank, run: RunDir,
          environ: MutableMapping[str, str]) -> None:
    name = signal.Signals(-code).name
    attempt = rank.env.restart
    job = requeue.slurm_job(environ)
    # Only rank 0's supervisor reads the history (it alone requeues): one reader per job.
    already = rank.env.is_master and any(
        e.get("kind") == "requeue" and e.get("attempt") == attempt
        and e.get("job") in (None, job) for e in events.read(run.root))
    message = (f"the training process died from {name} (an abort: NCCL's watchdog after a "
               "failed or timed-out collective, the out-of-memory killer, or a crash); its "
               f"last lines:\n{child.tail()}")
    if already or stopping.signal_number(cfg.cluster.signal) == -code:
        # Another rank's failure already requeued this attempt: this death is its echo.
        raise SystemExit(128 - code)
    # Rank 0's supervisor decides: one scontrol call per job, and the store that would
    # arbitrate between supervisors lives in its process, gone once it has requeued (another
    # rank's supervisor would then requeue the next attempt too). The others record their
    # death in their own error file (logs/rank<N>.error); rank 0's alone goes into
    # events.jsonl. Rank 0's training dies as well when a peer's does (NCCL's watchdog, or a
    # failed Gloo collective, which its own failure path handles); a lost node is Slurm's to
    # requeue.
    fail(message, rank.env.is_master, cfg, rank, run, environ, report=rank.env.is_master)
