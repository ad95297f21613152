"""What evaluation reports besides the loss (hpc_ddp averages it over the whole eval set)."""

from __future__ import annotations

import torch


def regression(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Batch means: absolute error, and the share of predictions within 0.1."""
    error = (outputs - targets).abs()
    return {"mae": error.mean(), "within_tenth": (error < 0.1).float().mean()}
