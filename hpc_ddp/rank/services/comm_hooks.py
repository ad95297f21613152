"""DDP's communication hook (trainer.ddp_comm_hook): torch's own hooks, registered on a DDP
model of the built-in trainer or of a user's loop (``ctx.ddp``), with the state a resumed run
needs to stay bitwise equal to an uninterrupted one.

The hooks are torch's (https://pytorch.org/docs/stable/ddp_comm_hooks.html):
``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook`` (stateless) and
``powerSGD_hook`` with its ``PowerSGDState``. What this module adds around them:

- **State in checkpoints.** PowerSGD's error feedback is this rank's own (its gradient minus
  the approximation all ranks agreed on), so it goes in each rank's own file beside its
  random streams (loop_checkpoints.py), with the warm-up counter, the warm start's P and Q and
  the NumPy stream that draws the first Q. ``PowerSGDState.__getstate__`` would pickle that
  stream as an object, which a checkpoint loaded as data refuses (trusted.py); this keeps
  tensors and numbers only.
- **The settling step** (ddp_warmup.py) runs a plain all-reduce and touches no state: it is
  not a training step, and a resumed run settles again.
- **DDP's first bucket layout.** DDP rebuilds its buckets in gradient-ready order after its
  first synced backward (its second under static_graph: :func:`first_layout`); a resumed
  loop that did not settle meets PowerSGD's saved state in the first layout, where a
  bucket's index holds other parameters. That bucket gets a plain all-reduce (the warm-up
  counter still counts the step) until the layout it was saved for is back; a layout that
  never comes back (other bucket sizes) restarts the bucket's state, said once in the log.
- **Counts** of hook calls and of synced backward passes (``syncs``), which show that
  gradient accumulation's no_sync micro-batches reduce nothing.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from hpc_ddp.errors import UserError
from hpc_ddp.rank.services import rng
from hpc_ddp.rank.services.ckpt_writer import snapshot

if TYPE_CHECKING:  # the type only
    from hpc_ddp.config.schema import TrainerConfig

log = logging.getLogger(__name__)
# NCCL reduces bf16 from 2.10 on (torch's own check in DistributedDataParallel._check_comm_hook,
# which looks at the build, not at the backend in use).
NCCL_BF16 = (2, 10)
# The DDP models a hook was registered on (weak: a model's hook goes with it).
_REGISTERED: weakref.WeakKeyDictionary[Any, CommHook] = weakref.WeakKeyDictionary()


class CommHook:
    """One DDP model's registered hook: ``name`` (trainer.ddp_comm_hook), torch's
    PowerSGDState under powersgd (None otherwise), and the counts."""

    def __init__(self, name: str, ddp_model: Any, power_rank: int = 1,
                 warmup_steps: int = 1000) -> None:
        # deferred: torch (its DDP hooks)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        self.name = name
        self.group = ddp_model.process_group
        self.device = next(ddp_model.module.parameters()).device
        self.calls = 0  # buckets handed to the hook, the settling step's too
        self.syncs = 0  # synced backward passes (one per optimizer step), not settling
        self.settling = False
        self._plain = default_hooks.allreduce_hook
        self._hook: Any = {"fp16": default_hooks.fp16_compress_hook,
                           "bf16": default_hooks.bf16_compress_hook,
                           "powersgd": powerSGD_hook.powerSGD_hook}[name]
        self.state: Any = None
        self._positions = {id(p): i for i, p in enumerate(ddp_model.module.parameters())}
        self._layouts: dict[int, tuple[int, ...]] = {}  # PowerSGD's state is for these
        self._seen = 0  # synced backward passes of this DDP model, the settling one too
        self._first_layout = first_layout(ddp_model)
        self._said: set[str] = set()
        if name == "powersgd":
            # Error feedback and warm start on (torch's defaults and advice); the seed is
            # torch's default, the same on every rank, as PowerSGD needs.
            self.state = powerSGD_hook.PowerSGDState(
                self.group, matrix_approximation_rank=power_rank,
                start_powerSGD_iter=warmup_steps)

    def __call__(self, state: Any, bucket: Any) -> Any:
        """DDP's hook: ``state`` is this object (registered as its own state)."""
        self.calls += 1
        last = bucket.is_last()
        try:
            if self.settling:
                return self._plain(self.group, bucket)
            if self.state is None:
                return self._hook(self.group, bucket)
            if not self._fits(bucket):
                self.state.maybe_increase_iter(bucket)  # the step counts toward the warm-up
                return self._plain(self.group, bucket)
            return self._hook(self.state, bucket)
        finally:
            if last:
                self._seen += 1
                self.syncs += 0 if self.settling else 1

    def _fits(self, bucket: Any) -> bool:
        """Whether PowerSGD's state of this bucket (if any) is for the parameters it holds."""
        s = self.state
        if s.iter < s.start_powerSGD_iter:
            return True  # a plain all-reduce in torch's hook: no state used
        index = bucket.index()
        layout = tuple(self._positions.get(id(p), -1) for p in bucket.parameters())
        saved = self._layouts.get(index)
        if saved is None or saved == layout:
            self._layouts[index] = layout
            return True
        if self._seen < self._first_layout:
            self._say("first", "PowerSGD: DDP's first buckets are not those its state was "
                      "saved for (a resumed loop that did not call ctx.settle_buckets): a "
                      "plain all-reduce until DDP rebuilds them; the run is no longer bitwise "
                      "the uninterrupted one")
            return False
        self._say("layout", f"PowerSGD: bucket {index} holds other parameters than when its "
                  "state was saved (other bucket sizes?): its error feedback restarts")
        for memory in (s.error_dict, s.p_memory_dict, s.q_memory_dict):
            memory.pop(index, None)
        self._layouts[index] = layout
        return True

    def _say(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning("%s", message)

    # -- checkpoints (loop_checkpoints.py: this rank's own file) -----------------------------
    def state_dict(self) -> dict[str, Any]:
        """PowerSGD's state as data, copied to the CPU ({} for a stateless hook)."""
        s = self.state
        if s is None:
            return {}
        return snapshot({
            "hook": self.name, "rank": s.matrix_approximation_rank, "iter": s.iter,
            "rng": rng.numpy_state(s.rng.get_state(legacy=True)),
            "error": dict(s.error_dict), "p": dict(s.p_memory_dict),
            "q": dict(s.q_memory_dict),
            "layouts": {i: list(v) for i, v in self._layouts.items()},
            "numel_before": s.total_numel_before_compression,
            "numel_after": s.total_numel_after_compression,
            "next_stats_report": s.next_stats_report})

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Put a :meth:`state_dict` back (onto this model's device)."""
        s = self.state
        if s is None or saved.get("hook") != self.name:
            return
        s.iter = int(saved["iter"])
        s.rng.set_state(rng.numpy_tuple(saved["rng"]))
        s.error_dict = {int(i): t.to(self.device) for i, t in saved["error"].items()}
        same_rank = saved["rank"] == s.matrix_approximation_rank
        if not same_rank:  # P and Q have the rank's width: drawn again
            log.warning("PowerSGD: rank %s now, %s in the checkpoint: its P and Q start "
                        "again", s.matrix_approximation_rank, saved["rank"])
        s.p_memory_dict = {int(i): t.to(self.device)
                           for i, t in saved["p"].items()} if same_rank else {}
        s.q_memory_dict = {int(i): t.to(self.device)
                           for i, t in saved["q"].items()} if same_rank else {}
        self._layouts = {int(i): tuple(v) for i, v in saved["layouts"].items()}
        s.total_numel_before_compression = int(saved["numel_before"])
        s.total_numel_after_compression = int(saved["numel_after"])
        s.next_stats_report = int(saved["next_stats_report"])


def first_layout(ddp_model: Any) -> int:
    """The synced backward passes DDP runs in its first bucket layout: it rebuilds the
    buckets in gradient-ready order before its second iteration, before its third under
    static_graph (seen with torch 2.14; torch/nn/parallel/distributed.py, _pre_forward)."""
    return 2 if getattr(ddp_model, "static_graph", False) else 1


def register(ddp_model: Any, trainer: TrainerConfig) -> CommHook | None:
    """Register trainer.ddp_comm_hook on ``ddp_model`` (None for ``none``: DDP's own
    all-reduce). Refused (UserError) where the process group cannot reduce the hook's dtype."""
    name = trainer.ddp_comm_hook
    if name == "none":
        return None
    _check_backend(name, ddp_model.process_group)
    if name == "powersgd":
        _check_one_bucket_over_gloo(ddp_model, trainer.ddp_bucket_cap_mb is None)
    hook = CommHook(name, ddp_model, trainer.ddp_powersgd_rank,
                    trainer.ddp_powersgd_warmup_steps)
    ddp_model.register_comm_hook(hook, _reduce)
    _REGISTERED[ddp_model] = hook
    log.info("DDP communication hook: %s%s", name,
             f" (rank {trainer.ddp_powersgd_rank}, a plain all-reduce for the first "
             f"{trainer.ddp_powersgd_warmup_steps} steps)" if name == "powersgd" else "")
    return hook


def _reduce(state, bucket):
    """What DDP calls with each bucket. Unannotated: DDP reads the signature and accepts only
    dist.GradBucket and Future[Tensor] there, which this module's postponed annotations would
    give it as strings (DistributedDataParallel._check_comm_hook)."""
    return state(state, bucket)


def registered(ddp_model: Any) -> CommHook | None:
    """The hook :func:`register` put on ``ddp_model``, if any."""
    try:
        return _REGISTERED.get(ddp_model)
    except TypeError:  # not weak-referenceable: not a model of ours
        return None


@contextlib.contextmanager
def settling(ddp_model: Any) -> Iterator[None]:
    """Within: ``ddp_model``'s hook (if any) runs a plain all-reduce and keeps its state."""
    hook = registered(ddp_model)
    if hook is None:
        yield
        return
    hook.settling = True
    try:
        yield
    finally:
        hook.settling = False


def _check_one_bucket_over_gloo(ddp_model: Any, default_cap: bool) -> None:
    """PowerSGD over Gloo hangs once a step has two gradient buckets or more: torch's hook
    waits for its second all-reduce inside the first one's completion callback
    (powerSGD_hook.py, ``unpack_uncompressed_tensors_and_allreduce_ps``), which Gloo runs on
    one of its worker threads (2 by default), so two buckets' callbacks hold both threads
    and their all-reduces never run (seen with torch 2.14: a 4 MB model, 4 MB buckets, every
    rank stopped at its first compressed step). NCCL's futures do not wait that way. From
    its warm-up on DDP has rebuilt its buckets to ``bucket_bytes_cap``: one bucket when the
    gradients fit in it."""
    import torch.distributed as dist  # deferred: torch

    if dist.get_backend(ddp_model.process_group) != "gloo":
        return
    grads = sum(p.numel() * p.element_size() for p in ddp_model.parameters()
                if p.requires_grad)
    cap = int(ddp_model.bucket_bytes_cap)
    # Without trainer.ddp_bucket_cap_mb DDP keeps its first bucket at 1 MiB, rebuilt too
    # (torch/nn/parallel/distributed.py, BucketCapacityConfig); with it, every bucket is
    # that size.
    first = min(cap, dist._DEFAULT_FIRST_BUCKET_BYTES) if default_cap else cap
    if grads > first:
        need = -(-grads // 2**20) + 1
        raise UserError("trainer.ddp_comm_hook", "powersgd", f"hangs over Gloo (CPU training) "
                        f"with more than one gradient bucket: this model's "
                        f"{grads / 2**20:.1f} MB of gradients make several buckets (at most "
                        f"{cap / 2**20:g} MB each, the first {first / 2**20:g} MB; torch's "
                        "hook waits inside Gloo's callbacks, which hold its worker threads).",
                        f"one bucket: trainer.ddp_bucket_cap_mb={need}; or "
                        "trainer.ddp_comm_hook=bf16 (or fp16) on CPU; PowerSGD over NCCL "
                        "(GPUs) has no such limit.")


def _check_backend(name: str, group: Any) -> None:
    """bf16 over NCCL needs NCCL 2.10 (Gloo on the CPU reduces both 16-bit types: tried with
    torch 2.14)."""
    if name != "bf16":
        return
    # deferred: torch
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) != "nccl":
        return
    version = tuple(torch.cuda.nccl.version()[:2])
    if version < NCCL_BF16:
        raise UserError("trainer.ddp_comm_hook", "bf16", f"needs NCCL "
                        f"{'.'.join(map(str, NCCL_BF16))} or newer to all-reduce bf16; this "
                        f"torch has NCCL {'.'.join(map(str, version))}.",
                        "use trainer.ddp_comm_hook=fp16, or a torch built with a newer NCCL.")
