"""`_target_` parts that plant one cause each for the scaling report (python -m hpc_ddp.bench
scaling; tests/cluster/test_scaling_report.py), as users' own code would have it:

- ``WideMlp``: many parameters per FLOP (a few million weights, a small batch of 8-feature
  vectors): the gradient all-reduce outweighs the step's arithmetic, so a slow link shows.
- ``DeviceBound``: a small model whose forward waits ``compute_ms`` the way a host waits for
  an accelerator's kernels (a sleep, not host CPU): on this 2-core machine, where more nodes
  means fewer cores per rank, its step does not slow down as nodes are added, as on a cluster
  whose nodes each bring their own GPU. The run that scales.
- ``slow_vectors``: 8-feature vectors whose every sample takes ``sample_ms`` to read (a sleep:
  slow storage or decoding), read one by one in the trainer's loader: the loader-bound run.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset


def vectors(size: int = 512, classes: int = 10) -> dict[str, Any]:
    """A classification set of 8-feature vectors (the same on every rank: seed 0)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size, 8, generator=gen)
    y = torch.randint(0, classes, (size,), generator=gen)
    return {"train": TensorDataset(x, y), "eval": TensorDataset(x[:16], y[:16])}


class WideMlp(nn.Module):
    """8 -> width -> ... -> classes; ``depth`` hidden layers of width x width weights."""

    def __init__(self, width: int = 1024, depth: int = 2, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(8, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DeviceBound(nn.Module):
    """A tiny MLP whose forward takes ``compute_ms`` of waiting (see the module docstring)."""

    def __init__(self, compute_ms: float = 40.0, num_classes: int = 10) -> None:
        super().__init__()
        self.compute_s = compute_ms / 1e3
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.compute_s)
        return self.net(x)


class _SlowVectors(Dataset):  # type: ignore[type-arg]
    def __init__(self, x: torch.Tensor, y: torch.Tensor, sample_s: float) -> None:
        self.x, self.y, self.sample_s = x, y, sample_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.sample_s)
        return self.x[i], self.y[i]


def slow_vectors(sample_ms: float = 2.0, size: int = 512, classes: int = 10) -> dict[str, Any]:
    """:func:`vectors`, each training sample taking ``sample_ms`` to read."""
    sets = vectors(size, classes)
    x, y = sets["train"].tensors
    return {"train": _SlowVectors(x, y, sample_ms / 1e3), "eval": sets["eval"]}
