"""The context a user's own training gets on every rank: who it is, and the services that
keep a loop alive on a cluster.

A function entry (``entry=my_pkg.train:main``) is called with it; a script (``script=``)
gets the same object from ``hpc_ddp.context()``. ::

    def main(ctx: hpc_ddp.Context) -> dict:
        model = DDP(Net().to(ctx.device))
        state = ctx.load() or {"step": 0}             # the latest checkpoint, or None
        for step in range(state["step"], 1000):
            ...train one step...
            ctx.log({"loss": loss.item()}, step)      # TensorBoard + progress (rank 0)
            if ctx.should_stop():                     # the requeue signal / SIGTERM, agreed
                ctx.save({"step": step + 1, "model": model.module.state_dict()})
                return {}                             # hpc_ddp requeues the job
        return {"final_loss": loss.item()}            # -> summary.json

``should_stop`` and ``save`` are collectives: every rank calls them at the same points.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp.config.schema import Config
from hpc_ddp.rank.contract import DATA_ROOT_ENV
from hpc_ddp.rank.join.distenv import DistEnv
from hpc_ddp.rank.services import checkpoint, rng, stopping, window_sync
from hpc_ddp.rank.services.metrics import MetricsWriter
from hpc_ddp.rundir import RunDir, write_json

if TYPE_CHECKING:  # the type only: a script's context never joins through join/
    from hpc_ddp.rank.join.joined import Rank

log = logging.getLogger(__name__)
_USER_KEY = "user"
_OURS_KEY = "hpc_ddp"


class Context:
    """One rank's view of the job and its services (see the module docstring)."""

    def __init__(self, cfg: Config, run: RunDir, env: DistEnv, device: Any, host: str,
                 stop: stopping.StopRequest | None, resume_cause: str | None = None, *,
                 stop_file: Path | None = None, joined: Rank | None = None) -> None:
        """``stop_file``: in a script hpc_ddp supervises, where rank 0 notes an agreed stop
        for the supervisor (supervise/script.py), and ``summary`` beside it. ``joined``: the
        joined rank (its store and host) for :meth:`stage`; None in a script (its supervisor
        staged data.root already: $HPC_DDP_DATA_ROOT)."""
        self.cfg = cfg
        self.env = env
        self.device = device
        self.host = host
        self.run = run
        # Steps of the whole run, if the loop knows them (progress bars show N/total).
        self.total_steps: int | None = None
        # Added to summary.json by rank 0 at the end (with what the entry returns).
        self.summary: dict[str, Any] = {}
        self.restarts: list[dict[str, Any]] = []
        self.resumed_from_step: int | None = None
        self._stop = stop
        self._cause = resume_cause
        self._calls = 0
        self._sync = window_sync.Periodic()  # the stop agreement
        self._stop_step: int | None = None
        self._last_step = 0
        self._saved_step: int | None = None
        self._metrics: MetricsWriter | None = None
        self._writer: Any = None  # ckpt_writer.CheckpointWriter, made at the first save
        self.stop_file = stop_file
        self._joined = joined

    # -- who this rank is ------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def local_world_size(self) -> int:
        return self.env.local_world_size

    @property
    def node_rank(self) -> int:
        return self.env.node_rank

    @property
    def num_nodes(self) -> int:
        return self.env.num_nodes

    @property
    def restart(self) -> int:
        """How many times this job was requeued before this attempt."""
        return self.env.restart

    @property
    def is_master(self) -> bool:
        return self.env.is_master

    @property
    def run_dir(self) -> Path:
        return self.run.root

    @property
    def app(self) -> dict[str, Any]:
        """Your own config keys (the ``app`` group)."""
        return self.cfg.app

    # -- data ----------------------------------------------------------------------------
    @property
    def data_root(self) -> Path | None:
        """``data.root``: with data.stage=true, this node's copy of it (stage_run.py)."""


        if os.environ.get(DATA_ROOT_ENV):  # a script: its supervisor staged it
            return Path(os.environ[DATA_ROOT_ENV])
        d = self.cfg.data  # staged: its root is already the copy
        root = d.kwargs.get("root") if d.target is not None else d.root
        return Path(str(root)) if root else None

    def stage(self, path: str | Path) -> Path:
        """Copy ``path`` (a folder or a tar, on the shared file system) to this node's local
        disk under data.stage_dir, once per node, and return the copy (a tar's one top
        folder, if it holds one). A collective: every rank calls it, with the same path. A
        requeue on the same node reuses the copy (docs/data.md)."""
        from hpc_ddp.data.stage_run import stage_path  # deferred: concurrent, tarfile

        if self._joined is None:
            raise RuntimeError("ctx.stage() works in a function entry; in a script, set "
                               "data.stage=true and read $HPC_DDP_DATA_ROOT")

        staged = stage_path(str(path), self.cfg, self._joined, self.run, os.environ,
                            key="ctx.stage")
        return staged.root

    # -- stopping --------------------------------------------------------------------------
    def should_stop(self) -> bool:
        """True once the ranks agreed to stop: the requeue signal before the time limit, a
        preemption, SIGTERM. Call it once per step on every rank. Every
        ``trainer.stop_check_interval`` calls it launches one tiny all-reduce without waiting
        for it (window_sync); the next call reads it, so a signal is acted on within that
        many steps plus one, at the same call on every rank. Then save and return: the job is
        requeued (or, after SIGTERM, left to Slurm) and resumes from the checkpoint."""
        if self._sync.agreed != stopping.NONE:
            return True
        self._calls += 1
        if self._sync.read() is not None:
            code = self._sync.agreed
            if code != stopping.NONE:
                self._stop_step = self._last_step
                if self.stop_file is not None and self.is_master:
                    self.stop_file.write_text(str(code))
                log.warning("stop agreed by every rank (%s) at call %d of should_stop()",
                            "SIGTERM" if code == stopping.TERM else "requeue signal",
                            self._calls)
                return True
        if self._calls % self.cfg.trainer.stop_check_interval == 0:
            code = self._stop.code if self._stop is not None else stopping.NONE
            self._sync.launch(window_sync.agree_to_stop(code, self._agree_device(),
                                                        self._calls))
        return False

    @property
    def stop_code(self) -> int:
        """stopping.NONE, TERM or REQUEUE: what the ranks agreed."""
        return self._sync.agreed

    def _agree_device(self) -> Any:
        # deferred: torch
        import torch
        import torch.distributed as dist

        backend = dist.get_backend() if dist.is_initialized() else "gloo"
        return self.device if backend == "nccl" else torch.device("cpu")

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, state: Mapping[str, Any], step: int | None = None) -> Path | None:
        """Checkpoint ``state`` (your loop's dict) as the atomic checkpoint of ``step``
        (default: ``state["step"]``, else the last logged step): rank 0's copy of ``state``
        and each rank's own random streams, so a resumed loop draws what an uninterrupted one
        would. Every rank calls it at the same point. The copy to the CPU happens here, the
        writing in the background (``trainer.checkpoint_background``); it is complete before
        the next save, ``ctx.load()``, and the end of the program (or of a stop). What a
        resume loads back is data only (tensors, numbers, strings, lists, dicts:
        docs/security.md); a state holding anything else is refused when it is written.
        Returns, on rank 0, the path the checkpoint gets; None on the others."""
        step = self._step_of(state, step)
        self._saved_step = self._last_step = step
        ours = {"step": step, "world_size": self.world_size,
                "restarts": list(self.restarts), "program": self.cfg.entry or self.cfg.script}
        whole = {_USER_KEY: dict(state), _OURS_KEY: ours} if self.is_master else None
        path = self._checkpoints().save(step, whole, rng.capture({}))
        return path if self.is_master else None

    def _checkpoints(self) -> Any:
        if self._writer is None:
            # deferred (start-up): rank.services.ckpt_writer
            from hpc_ddp.rank.services.ckpt_writer import CheckpointWriter

            self._writer = CheckpointWriter.from_config(self.cfg.trainer, self.run.checkpoints,
                                                        self.rank, self.world_size,
                                                        self.restart)
        return self._writer

    def flush(self) -> None:
        """Wait until the last ``save`` is on disk (raises if it failed)."""
        if self._writer is not None:
            self._writer.wait()

    def _step_of(self, state: Mapping[str, Any], step: int | None) -> int:
        if step is None:
            given = state.get("step")
            step = given if isinstance(given, int) and not isinstance(given, bool) else (
                self._last_step)
        if step < 0:
            raise ValueError(f"ctx.save(step={step}): a step is 0 or more")
        return step

    def load(self) -> dict[str, Any] | None:
        """The state of the latest checkpoint (None for a fresh run); this rank's RNG streams
        are set back to where they were when it was saved."""
        self.flush()
        # As the built-in trainer resumes: an unusable latest (a truncated file) falls back
        # to the one before, recorded in events.jsonl.
        state = checkpoint.load_for_resume(
            self.run, self.is_master, self.restart,
            step_of=lambda s: (s.get(_OURS_KEY) or {}).get("step"))
        if state is None:
            return None
        if _USER_KEY not in state or _OURS_KEY not in state:
            raise RuntimeError(f"the latest checkpoint in {self.run.checkpoints} was not "
                               "written by ctx.save (the built-in trainer's?): start a new "
                               "run_dir for your own loop")
        ours = state[_OURS_KEY]
        self.restarts = list(ours.get("restarts", []))
        self.resumed_from_step = self._last_step = int(ours["step"])
        self.restarts.append(checkpoint.restart_record(self.resumed_from_step,
                                                       self._cause or "resume"))
        streams = None
        if ours.get("world_size") == self.world_size:
            streams = checkpoint.load_streams(self.run.checkpoints, self.rank,
                                              self.resumed_from_step)
        if streams is not None:
            rng.restore(streams, {})
        elif ours.get("world_size") == self.world_size:
            log.warning("rank %d restarts its random streams", self.rank)
        else:
            log.warning("checkpoint was written with world_size %s, now %d: RNG streams "
                        "restart", ours.get("world_size"), self.world_size)
        log.info("resumed from step %d", self.resumed_from_step)
        user: dict[str, Any] = state[_USER_KEY]
        return user

    def settle_buckets(self, ddp_model: Any, inputs: Any, targets: Any = None,
                       loss_fn: Any = None) -> None:
        """One throw-away forward/backward of a sample batch through your DDP model before
        training (every rank calls it): DDP then sums gradients in its final bucket order
        from the first real step on, so a resumed run ends bitwise equal to an uninterrupted
        one with more than two ranks (hpc_ddp/rank/services/ddp_warmup.py says why). Nothing it
        touches is kept: gradients, buffers and random streams are put back."""
        # deferred (start-up): rank.services.ddp_warmup
        from hpc_ddp.rank.services.ddp_warmup import settle_buckets

        settle_buckets(ddp_model, inputs, targets, loss_fn)

    # -- logging ---------------------------------------------------------------------------
    def log(self, scalars: Mapping[str, float], step: int) -> None:
        """Scalars to TensorBoard (rank 0; the others' calls are free) and to the progress
        that ``wait``/``status`` show."""
        self._last_step = step
        if not self.is_master:
            return
        if self._metrics is None:
            # After a resume, TensorBoard drops the earlier attempt's events from the resumed
            # step on (they were logged after the checkpoint): no step appears twice.
            purge = self.resumed_from_step
            self._metrics = MetricsWriter(self.run.tb, self.run.progress, True, purge,
                                          self.total_steps or 0)
        values = {k: float(v) for k, v in scalars.items()}
        self._metrics.scalars(step, values)
        self._metrics.total_steps = self.total_steps
        self._metrics.write_progress(step, None, values, force=False)

    def close(self, finished: bool = True) -> None:
        """Flush what is pending; ``finished`` false (the loop raised): do not wait for the
        last stop agreement, which a failed peer may never join."""
        if finished:  # launched on every rank at one call: every rank reads it
            self._sync.read()
        self._sync.drop()
        if finished:  # a requested stop's checkpoint is whole before the requeue or the exit
            self.flush()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self.stop_file is not None and self.is_master and self.summary:

            write_json(self.stop_file.with_suffix(".result.json"), self.summary)

    @property
    def step(self) -> int:
        """The last step logged or saved (what the summary reports)."""
        return max(self._last_step, self._saved_step or 0)

    @property
    def stopped_at(self) -> int | None:
        """The step of the agreed stop (the last saved, else the last logged step)."""
        if self._sync.agreed == stopping.NONE:
            return None
        return self._saved_step if self._saved_step is not None else self._stop_step
