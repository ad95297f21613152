"""The built-in trainer or a function entry on Slurm, in a child of a supervisor that outlives it.

Why: with torch 2.14 NCCL's watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, the default)
tears every rank's process down with SIGABRT after a collective fails or times out, so a
failure path inside the training process never runs: no error record, no requeue, and Slurm
does not requeue a FAILED job. The decision therefore lives here, in a process that does no
collective and touches no GPU (https://pytorch.org/docs/stable/torch_nccl_environment_variables.html).

This process joins the job as a script's supervisor does (rendezvous; rank 0's holds the
store), then starts the training in ``python -m hpc_ddp.rank.main.child`` with the torchrun
variables and ``TORCHELASTIC_USE_AGENT_STORE=True``: the child is a client of this store, its
keys apart from ours (rendezvous.connect). The child handles signals, stops, checkpoints and
its own errors as ever. Here:

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
import threading
from collections.abc import Mapping, MutableMapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hpc_ddp import events
from hpc_ddp.config.compose import to_yaml
from hpc_ddp.config.schema import Config
from hpc_ddp.rank.contract import PROGRAM_CONFIG_ENV, PROGRAM_RUN_DIR_ENV
from hpc_ddp.rank.join import rendezvous
from hpc_ddp.rank.join.joined import Rank, joined
from hpc_ddp.rank.services import stacks, stopping
from hpc_ddp.rank.services.stopping import StopRequest
from hpc_ddp.rank.slurm import requeue
from hpc_ddp.rank.supervise.outcome import fail
from hpc_ddp.rank.supervise.script import ABRUPT, Child, report_done, wait_for_all
from hpc_ddp.rundir import RunDir, read_json

log = logging.getLogger(__name__)


def wanted(cfg: Config, environ: Mapping[str, str]) -> bool:
    """Supervise here: a Slurm step's task (not a local run, not already the child, not a
    script, which has its own supervisor, not under torchrun, which is one) when
    cluster.supervise says so; unset, when the ranks use GPUs (NCCL's watchdog). Two
    processes per rank cost a second interpreter start, which CPU/Gloo jobs need not pay:
    there a dead peer is an exception the other ranks handle."""
    on_slurm = "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ
    if not (on_slurm and cfg.script is None and PROGRAM_CONFIG_ENV not in environ
            and "TORCHELASTIC_RUN_ID" not in environ):
        return False
    if cfg.cluster.supervise is not None:
        return cfg.cluster.supervise
    return bool(cfg.cluster.gpus_per_node) and cfg.trainer.device != "cpu"


def child_command() -> list[str]:
    # Through the script runner: a clean end is not turned into an abort by torch's teardown.
    return [sys.executable, "-m", "hpc_ddp.rank.main.script_runner",
            "-m", "hpc_ddp.rank.main.child"]


def child_environment(cfg: Config, rank: Rank, environ: Mapping[str, str],
                      run: RunDir) -> dict[str, str]:
    env = {**environ, **rank.torchrun_env(), "TORCHELASTIC_USE_AGENT_STORE": "True",
           PROGRAM_CONFIG_ENV: to_yaml(cfg), PROGRAM_RUN_DIR_ENV: str(run.root)}
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def supervise(cfg: Config, run: RunDir, environ: MutableMapping[str, str]
              ) -> dict[str, Any] | None:
    """Run this rank's training in a child and act on how it ended; the summary on rank 0."""
    stop = StopRequest()
    # slurmstepd signals every process of the step: the child acts, this one only notes it.
    stop.install(cfg.cluster.signal)
    with joined(cfg, run, environ, group=False) as rank:
        child = Child(child_command(), child_environment(cfg, rank, environ, run))
        relay = StackRelay(rank, child, stacks.stack_signal(cfg.cluster.signal))
        log.info("training in process %d under this supervisor (rank %d of %d)",
                 child.proc.pid, rank.env.rank, rank.env.world_size)
        try:
            code = child.wait()
        finally:
            relay.close()
        report_done(rank, code)
        if rank.env.is_master:
            wait_for_all(rank, stop)
        if code < 0 and -code in ABRUPT:
            _died(code, child, cfg, rank, run, environ)
        if code != 0:
            # The child's own error (recorded by it), or SIGTERM: Slurm's to act on.
            raise SystemExit(code if code > 0 else 128 - code)
        if rank.env.is_master:
            summary = read_json(run.summary)
            return summary if isinstance(summary, dict) else None
    return None


class StackRelay:
    """A thread that waits for a stack request for this rank (rank/services/stacks.py) on a
    connection of its own (a store client is not shared between threads) and signals the
    child when it comes. Waiting is the store's own (no polling).

    :meth:`close` ends the thread before this process exits, by setting the key itself (to
    stacks.DONE) and joining it. A thread left blocked in the store would be woken by the
    store's shutdown (rank 0's process ending) while this interpreter finalizes; it then
    cannot take the GIL, is unwound through torch's C++ frames and the process aborts
    ("terminate called without an active exception", SIGABRT). srun reports the task
    Aborted and Slurm ends a run that finished FAILED (exit code 6).
    """

    def __init__(self, rank: Rank, child: Child, signum: int) -> None:
        self._child, self._signum = child, signum
        self._store = rank.store
        self._prefix = rendezvous.attempt_prefix(rank.env.restart)  # the child's keys
        self._key = stacks.request_key(rank.env.rank)
        self._thread: threading.Thread | None = None
        if rank.endpoint is not None and rank.store is not None:
            self._thread = threading.Thread(target=self._relay, args=(rank.endpoint,),
                                            name="hpc_ddp-stack-relay", daemon=True)
            self._thread.start()

    def _relay(self, endpoint: rendezvous.Endpoint) -> None:
        try:
            own = dist.PrefixStore(self._prefix, dist.TCPStore(
                endpoint.addr, endpoint.port, is_master=False, timeout=timedelta(seconds=30),
                wait_for_workers=False))
            while self._child.proc.poll() is None:
                try:
                    own.wait([self._key], timedelta(hours=1))
                except Exception as exc:  # an hour without a request, or the store is gone
                    if "timeout" not in str(exc).lower():
                        return
                    continue
                if own.get(self._key).decode() == stacks.REQUEST:
                    self._child.signal(self._signum)
                return
        except Exception:
            return

    def close(self, timeout_s: float = 10.0) -> None:
        """End the thread (the child has ended): set this rank's key, then join."""
        if self._thread is None:
            return
        try:
            dist.PrefixStore(self._prefix, self._store).set(self._key, stacks.DONE)
        except Exception:  # the store is gone: the thread's wait has failed and it returns
            pass
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the stack relay thread did not end within %.0fs", timeout_s)


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
