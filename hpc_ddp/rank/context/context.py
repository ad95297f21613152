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

The built-in trainer (hpc_ddp/trainer/loop.py) runs through a Context too: its checkpoints,
resume, stop agreement, metrics and restart history are these, so what the trainer's tests
prove is what a user's loop gets.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp import events
from hpc_ddp.config import secrets
from hpc_ddp.config.schema import Config
from hpc_ddp.rank.context.ddp_models import DdpModels
from hpc_ddp.rank.context.ordered import GlobalOrder
from hpc_ddp.rank.context.sharded import ShardedModels
from hpc_ddp.rank.context.trial import TrialReports
from hpc_ddp.rank.contract import DATA_ROOT_ENV
from hpc_ddp.rank.join.distenv import DistEnv
from hpc_ddp.rank.services import heartbeat, stopping, trackers, window_sync
from hpc_ddp.rank.services.loop_checkpoints import LoopCheckpoints
from hpc_ddp.rank.services.metrics import MetricsWriter
from hpc_ddp.rundir import RunDir, read_json, write_json, write_text

if TYPE_CHECKING:  # the type only: a script's context never joins through join/
    from hpc_ddp.rank.join.joined import Rank

log = logging.getLogger(__name__)
# What a launched collective's sums are handed to when it is read (the trainer's log window).
OnSums = Callable[[window_sync.Reduction, window_sync.Sums], None]


class Context(ShardedModels, DdpModels, GlobalOrder, TrialReports):
    """One rank's view of the job and its services (see the module docstring)."""

    def __init__(self, cfg: Config, run: RunDir, env: DistEnv, device: Any,
                 host: str | None = None, stop: stopping.StopRequest | None = None,
                 resume_cause: str | None = None, *, stop_file: Path | None = None,
                 joined: Rank | None = None) -> None:
        """``stop_file``: in a script hpc_ddp supervises, where rank 0 notes an agreed stop
        for the supervisor (supervise/script.py), and ``summary`` beside it. ``joined``: the
        joined rank (its store and host) for :meth:`stage`; None in a script (its supervisor
        staged data.root already: $HPC_DDP_DATA_ROOT)."""
        self.cfg = cfg
        self.env = env
        self.device = device
        self.host = host or socket.gethostname()
        self.run = run
        # Steps of the whole run, if the loop knows them (progress bars show N/total).
        self.total_steps: int | None = None
        # Added to summary.json by rank 0 at the end (with what the entry returns).
        self.summary: dict[str, Any] = {}
        # Why this start resumes (the restart history's cause), if it does.
        self.resume_cause = resume_cause
        self.checkpoints = LoopCheckpoints(cfg.trainer, run, env.rank, env.world_size,
                                           env.restart, cfg.entry or cfg.script)
        self._stop = stop
        self._calls = 0
        self._sync = window_sync.Periodic()  # the stop agreement (and the trainer's window)
        self._on_sums: OnSums | None = None
        self._stop_step: int | None = None
        self._last_step = 0
        self._metrics: MetricsWriter | None = None
        self.stop_file = stop_file
        self._joined = joined
        self._recovering = False  # resumed: the first step after it is recorded (stepped())
        # Under a supervisor, its hang watch reads these beats (services/heartbeat.py).
        store = joined.store if joined is not None and env.supervised else None
        self._heartbeat = heartbeat.Heartbeat(store, env.rank,
                                              heartbeat.interval(cfg.trainer.hang_timeout_s,
                                                                 env.world_size))
        self._heartbeat.beat(heartbeat.STARTING)  # a rank that hangs before its first step

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
        """Your own config keys (the ``app`` group); a secret among them, which the config
        holds as ``${oc.env:NAME}``, read from this process's environment
        (config/secrets.py)."""
        found: dict[str, Any] = secrets.resolve_tree(self.cfg.app, os.environ)
        return found

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
        # deferred: concurrent, tarfile
        from hpc_ddp.data.stage_run import stage_path  # deferred (start-up): data.stage_run

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
        self.stepped(self._last_step)
        if self._sync.pending is not None:
            self.finish_collective()
            if self._sync.agreed != stopping.NONE:
                self._stop_step = self._last_step
                if self.stop_file is not None and self.is_master:
                    write_text(self.stop_file, str(self._sync.agreed))  # never via a link
                log.warning("stop agreed by every rank (%s) at call %d of should_stop()",
                            "SIGTERM" if self._sync.agreed == stopping.TERM else
                            "requeue signal", self._calls)
                return True
        if self._calls % self.cfg.trainer.stop_check_interval == 0:
            self.launch_collective(step=self._calls, check_stop=True)
        return False

    @property
    def stop_code(self) -> int:
        """stopping.NONE, TERM or REQUEUE: what the ranks agreed."""
        return self._sync.agreed

    def launch_collective(self, *, step: int, check_stop: bool,
                          window: tuple[Any, int, int] | None = None,
                          on_sums: OnSums | None = None, epoch: int = 0, lr: float = 0.0,
                          elapsed_s: float = 0.0, own_s: float = 0.0,
                          slow_above: float | None = None) -> None:
        """Launch the loop's periodic all-reduce without waiting for it (window_sync): this
        rank's stop request when ``check_stop``, and a log window's sums ``(loss_sum,
        batches, samples)`` when given, handed to ``on_sums`` when read. Every rank launches
        it at the same step; :meth:`finish_collective` (or the next should_stop) reads it.
        :meth:`should_stop` is this with no window; the built-in trainer adds its window,
        and this rank's own time in it (``own_s``, trainer/throughput.py), marked as behind
        when above ``slow_above``."""
        code = None
        if check_stop:
            code = self._stop.code if self._stop is not None else stopping.NONE
        loss_sum, batches, samples = window if window is not None else (0.0, 0, 0)
        self._sync.launch(window_sync.start(loss_sum, batches, samples, code,
                                            self._collective_device(), step=step,
                                            epoch=epoch, lr=lr, elapsed_s=elapsed_s,
                                            log=window is not None, own_s=own_s,
                                            slow=slow_above is not None and own_s > slow_above,
                                            rank=self.rank))
        self._on_sums = on_sums

    def finish_collective(self) -> None:
        """Read the launched all-reduce, if any (waiting if needed): an agreed stop is kept
        (:attr:`stop_code`), its sums go to the ``on_sums`` it was launched with."""
        done = self._sync.read()
        on_sums, self._on_sums = self._on_sums, None
        if done is not None and on_sums is not None:
            on_sums(*done)

    def _collective_device(self) -> Any:
        import torch  # deferred: torch
        import torch.distributed as dist

        backend = dist.get_backend() if dist.is_initialized() else "gloo"
        return self.device if backend == "nccl" else torch.device("cpu")

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, state: Mapping[str, Any], step: int | None = None, *,
             generators: Mapping[str, Any] | None = None) -> Path | None:
        """Checkpoint ``state`` (your loop's dict) as the atomic checkpoint of ``step``
        (default: ``state["step"]``, else the last logged step): rank 0's copy of ``state``
        and each rank's own random streams — Python's, NumPy's, torch's and those of the
        torch Generators in ``generators`` (by name) — so a resumed loop draws what an
        uninterrupted one would. Every rank calls it at the same point. The copy to the CPU
        happens here, the writing in the background (``trainer.checkpoint_background``); it
        is complete before the next save, ``ctx.load()``, and the end of the program (or of
        a stop). A state holding a sharded model's tensors (:meth:`shard`,
        :meth:`state_dict`) is written by every rank, its own shards, with
        torch.distributed.checkpoint (``trainer.checkpoint_format``). What a resume loads
        back is data only (tensors, numbers, strings, lists,
        dicts: docs/security.md); a state holding anything else is refused when it is
        written. Returns, on rank 0, the path the checkpoint gets; None on the others."""
        step = self._step_of(state, step)
        self._last_step = step
        # Every rank's state: a sharded one (DTensors, trainer.checkpoint_format=dcp) is
        # written by every rank, its own part (loop_checkpoints.py); else rank 0's only.
        path = self.checkpoints.save(state, step, generators)
        return path if self.is_master else None

    def flush(self) -> None:
        """Wait until the last ``save`` is on disk (raises if it failed)."""
        self.checkpoints.flush()

    def _step_of(self, state: Mapping[str, Any], step: int | None) -> int:
        if step is None:
            given = state.get("step")
            step = given if isinstance(given, int) and not isinstance(given, bool) else (
                self._last_step)
        if step < 0:
            raise ValueError(f"ctx.save(step={step}): a step is 0 or more")
        return step

    def load(self, *, generators: Mapping[str, Any] | None = None,
             check: Callable[[dict[str, Any]], None] | None = None,
             into: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """The state of the latest checkpoint (None for a fresh run); this rank's random
        streams (and those of ``generators``) are set back to where they were when it was
        saved. ``check``: called with the state, raising if it does not fit (e.g. your
        ``load_state_dict``): then the checkpoint before is tried, as for a truncated file,
        and the skip is recorded in events.jsonl. ``into``: for a sharded model, a state
        shaped like the one you save (``{"model": ..., **ctx.state_dict(model, opt)}``): each
        of its tensors is filled in place with this rank's part, whatever the world size that
        saved it; without it, tensors come back whole on the CPU."""
        state = self.checkpoints.load(self.resume_cause or "resume", generators, check, into)
        if state is not None:
            self._last_step = self.checkpoints.resumed_from_step or 0
            self._recovering = self.is_master and events.after_failure(
                events.read(self.run.root))
        return state

    def stepped(self, step: int) -> None:
        """A training step ended (should_stop() calls it; the built-in trainer after every
        step): the first one after a resume from a failure is recorded in events.jsonl
        ("recovered": what the failure cost in seconds, docs/fault-tolerance.md), and the
        heartbeat a supervisor watches for hangs is due (docs/fault-tolerance.md#hangs)."""
        self._heartbeat.beat(step)
        if self._recovering:
            self._recovering = False
            events.append(self.run.root, {"kind": events.RECOVERED, "attempt": self.env.restart,
                                          "generation": self.env.generation,
                                          "from_step": self.resumed_from_step, "step": step})

    def alive(self) -> None:
        """This rank is busy but not stepping (a long evaluation, a slow save): call it now
        and then, and a hang watch with a derived timeout never takes the pause for a hang."""
        self._heartbeat.beat(self._last_step)

    @property
    def restarts(self) -> list[dict[str, Any]]:
        """The restart history (from the checkpoint on): from which step, why, when."""
        return self.checkpoints.restarts

    @property
    def resumed_from_step(self) -> int | None:
        return self.checkpoints.resumed_from_step

    def settle_buckets(self, ddp_model: Any, inputs: Any, targets: Any = None,
                       loss_fn: Any = None) -> None:
        """One throw-away forward/backward of a sample batch through your DDP model before
        training (every rank calls it): DDP then sums gradients in its final bucket order
        from the first real step on, so a resumed run ends bitwise equal to an uninterrupted
        one with more than two ranks, or with PowerSGD (services/ddp_warmup.py says why).
        Nothing it touches is kept: gradients, buffers, random streams, a hook's state."""
        # deferred (start-up): rank.services.ddp_warmup
        from hpc_ddp.rank.services.ddp_warmup import settle_buckets  # deferred: torch

        settle_buckets(ddp_model, inputs, targets, loss_fn)

    # -- logging ---------------------------------------------------------------------------
    @property
    def metrics(self) -> MetricsWriter:
        """TensorBoard and progress.json (rank 0's; the others' calls do nothing)."""
        if self._metrics is None:
            self._metrics = MetricsWriter(self.run.tb, self.run.progress, self.is_master,
                                          self.resumed_from_step, self.total_steps,
                                          self._trackers())
        return self._metrics

    def _trackers(self) -> Any:
        """Rank 0's W&B / MLflow runs when ``logger`` asks for them (services/trackers.py)."""
        if not self.is_master or not trackers.wanted(self.cfg.logger):
            return None
        try:
            record = trackers.prepare(self.cfg, self.run, os.environ)
            return trackers.Trackers(record, read_json(self.run.hparams) or {},
                                     trackers.label_of(self.run), os.environ)
        except Exception as exc:  # a tracker's service that does not answer: train on
            log.warning("logger=%s: the tracker could not be opened (%s); training goes on "
                        "with TensorBoard alone", self.cfg.logger, exc)
            return None

    def log(self, scalars: Mapping[str, float], step: int, *, epoch: int | None = None,
            progress: bool = True, final: bool = False) -> None:
        """Scalars to TensorBoard and the trackers ``logger`` names (rank 0; the others'
        calls are free: services/trackers.py) and to the progress
        that ``wait``/``status`` show (``progress``; a tag's last part names it there, e.g.
        ``train/loss`` as ``loss``, rewritten at most once a second unless ``final``)."""
        self._last_step = step
        if not self.is_master:
            return
        values = {k: float(v) for k, v in scalars.items()}
        metrics = self.metrics
        metrics.scalars(step, values)
        if progress:
            metrics.total_steps = self.total_steps
            metrics.write_progress(step, epoch, _progress_names(values), force=final)

    def close(self, finished: bool = True) -> None:
        """Flush what is pending: the last launched collective (not if ``finished`` is
        false: the loop raised, and a failed peer may never join it), the checkpoint being
        written (its failure then only logged: the error in flight is the cause), metrics."""
        if finished:  # launched on every rank at one call: every rank reads it
            self.finish_collective()
        self._sync.drop()
        try:
            self.flush()  # a checkpoint still being written is on disk before we go
        except Exception as exc:
            if finished:
                raise
            log.error("the checkpoint being written when training failed is not the latest: "
                      "%s", exc)
        if self._metrics is not None:
            ended = finished and self._sync.agreed == stopping.NONE
            for line in self._metrics.close(ended):
                log.info("%s", line)
            self._metrics = None
        if self.stop_file is not None and self.is_master and self.summary:
            write_json(self.stop_file.with_suffix(".result.json"), self.summary)

    @property
    def step(self) -> int:
        """The last step logged or saved (what the summary reports)."""
        return max(self._last_step, self.checkpoints.saved_step or 0)

    @property
    def stopped_at(self) -> int | None:
        """The step of the agreed stop (the last saved, else the last logged step)."""
        if self._sync.agreed == stopping.NONE:
            return None
        saved = self.checkpoints.saved_step
        return saved if saved is not None else self._stop_step


def _progress_names(values: dict[str, float]) -> dict[str, float]:
    """progress.json's keys: a tag's last part (``train/loss`` → ``loss``) where no other
    tag of the call ends the same, else the whole tag."""
    last = [tag.rpartition("/")[2] for tag in values]
    return {(short if last.count(short) == 1 else tag): v
            for (tag, v), short in zip(values.items(), last, strict=True)}
