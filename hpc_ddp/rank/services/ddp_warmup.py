"""One throw-away forward/backward before training, so every real step sums its gradients in
the same order, whether the run started fresh or was resumed.

DDP's first iteration puts all gradients in one bucket (in the order the parameters were
registered) and rebuilds its buckets from the order the gradients became ready; later
iterations all-reduce the rebuilt buckets. With more than two ranks the summation order of an
all-reduce depends on where a gradient sits in its bucket (ring and halving-doubling
algorithms cut buffers into per-rank chunks), so the first step after a resume — in one
bucket — would not be bitwise the step the uninterrupted run took there with rebuilt buckets
(seen here: a 4-rank transformer drifting in the 5th digit after one resume, 2 ranks exact).
Running one step that changes nothing makes the rebuild happen before any real step (two
under ``static_graph``, which rebuilds after its second iteration: seen with torch 2.14).
A communication hook runs a plain all-reduce in them and keeps its state (comm_hooks.py).
https://pytorch.org/docs/stable/notes/ddp.html#internal-design (gradient bucketing)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpc_ddp.rank.services import comm_hooks, rng


def settle_buckets(ddp_model: Any, inputs: Any, targets: Any | None = None,
                   loss_fn: Callable[[Any, Any], Any] | None = None,
                   generators: dict[str, Any] | None = None) -> None:
    """Forward and backward ``inputs`` through ``ddp_model`` (a collective: every rank calls
    it), then put back everything it touched: gradients, buffers (batch-norm statistics),
    the random streams (and ``generators``). ``loss_fn(outputs, targets)`` makes the scalar
    to differentiate; without it, the sum of the outputs."""
    import torch  # deferred: torch

    saved_rng = rng.capture(generators or {})
    buffers = {name: b.detach().clone() for name, b in ddp_model.module.named_buffers()}
    with comm_hooks.settling(ddp_model):
        for _ in range(comm_hooks.first_layout(ddp_model)):
            outputs = ddp_model(inputs)
            if loss_fn is not None and targets is not None:
                loss = loss_fn(outputs, targets)
            else:
                loss = sum(o.float().sum() for o in _tensors(outputs))
            loss.backward()
    with torch.no_grad():
        for name, buffer in ddp_model.module.named_buffers():
            buffer.copy_(buffers[name])
    for param in ddp_model.parameters():
        param.grad = None
    rng.restore(saved_rng, generators or {})


def _tensors(value: Any) -> list[Any]:
    import torch  # deferred: torch

    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []
