"""What the trainer minimises and what evaluation reports: the loss and the metrics.

The loss is ``loss(outputs, targets) -> scalar tensor`` (mean over the batch, as torch's
criteria are). Metrics are ``metrics(outputs, targets) -> {name: batch mean}``; evaluation
weights each by the batch's size, sums over batches and ranks (one all-reduce), and reports
the means over the whole eval set, so every sample counts once whatever the sharding.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from hpc_ddp.config.schema import LossConfig, MetricsConfig

Metrics = Callable[[Any, Any], dict[str, Any]]


def build_loss(cfg: LossConfig) -> Callable[[Any, Any], Any]:
    """The criterion: cross-entropy (label smoothing from the config), or a `_target_`."""
    if cfg.target is not None:
        return _callable("loss", cfg.target, cfg.kwargs)
    import torch.nn.functional as F  # deferred: torch

    smoothing = cfg.label_smoothing

    def cross_entropy(outputs: Any, targets: Any) -> Any:
        return F.cross_entropy(outputs, targets, label_smoothing=smoothing)

    return cross_entropy


def build_metrics(cfg: MetricsConfig) -> Metrics | None:
    """auto/accuracy/none, or a `_target_` hook; None: evaluation reports the loss only."""
    if cfg.target is not None:
        return _callable("metrics", cfg.target, cfg.kwargs)
    return {"auto": auto_accuracy, "accuracy": accuracy, "none": None}[cfg.name or "none"]


def _callable(part: str, target: str, kwargs: dict[str, Any]) -> Any:
    """A class is instantiated with its arguments (torch.nn.MSELoss()); a function is used as
    it is, bound to its arguments (`_partial_` implied: a loss is called with the batch)."""

    from hpc_ddp.targets import TargetError, build, locate  # deferred (start-up): targets

    is_class = inspect.isclass(locate(target, f"{part}._target_"))
    made = build(part, target, kwargs, partial=not is_class)
    if not callable(made):
        raise TargetError(f"{part}._target_", target, f"made a {type(made).__name__}, which "
                          "cannot be called.", f"name a function or a class whose instances "
                          f"are called as {part}(outputs, targets).")
    return made


def accuracy(outputs: Any, targets: Any) -> dict[str, Any]:
    """Top-1 accuracy of class scores [N, C] against class indices [N]."""
    if outputs.dim() != 2 or targets.dim() != 1 or targets.is_floating_point():
        raise ValueError(f"metrics=accuracy needs class scores [N, C] and class indices [N]; "
                         f"got outputs {tuple(outputs.shape)} and targets "
                         f"{tuple(targets.shape)} {targets.dtype} (use metrics=none or your own "
                         "metrics._target_)")
    return {"accuracy": (outputs.argmax(1) == targets).float().mean()}


def auto_accuracy(outputs: Any, targets: Any) -> dict[str, Any]:
    """Accuracy where it means something (class scores and indices), nothing otherwise."""
    if outputs.dim() == 2 and targets.dim() == 1 and not targets.is_floating_point():
        return accuracy(outputs, targets)
    return {}


def batch_size(batch: Any) -> int:
    """The samples in a batch: the first dimension of its first tensor."""
    import torch  # deferred: torch

    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        return batch_size(next(iter(batch.values())))
    if isinstance(batch, list | tuple) and batch:
        return batch_size(batch[0])
    return 1


def to_device(batch: Any, device: Any) -> Any:
    """Tensors anywhere in a batch (tuple, list, dict) moved to ``device``, asynchronously."""
    import torch  # deferred: torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
