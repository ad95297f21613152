"""Generated sequences: x is L numbers in [-1, 1]; y is a fixed weighted sum of them passed
through tanh, plus a little noise. Deterministic from the seed; no files, no downloads."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class SequenceRegression(Dataset):
    """(x [length, 1] float32, y [1] float32) pairs."""

    def __init__(self, size: int, length: int = 16, seed: int = 0, split: int = 0,
                 noise: float = 0.01) -> None:
        weights = torch.linspace(-1.0, 1.0, length) ** 3  # the rule (fixed)
        gen = torch.Generator().manual_seed(seed * 1_000 + split)
        self.x = torch.rand(size, length, 1, generator=gen) * 2 - 1
        clean = torch.tanh((self.x.squeeze(-1) * weights).sum(1, keepdim=True))
        self.y = clean + noise * torch.randn(size, 1, generator=gen)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def make_splits(train_size: int = 2048, eval_size: int = 256, length: int = 16,
                seed: int = 0) -> dict[str, SequenceRegression]:
    """The factory hpc_ddp calls (data._target_): the train and eval sets."""
    return {"train": SequenceRegression(train_size, length, seed, 0),
            "eval": SequenceRegression(eval_size, length, seed, 1)}
