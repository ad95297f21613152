"""`_target_` parts, good and bad."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset


def empty_data() -> tuple[Any, Any]:
    return TensorDataset(torch.zeros(0, 2)), None


def not_datasets() -> int:
    return 3


def classes_data(classes: int = 3, size: int = 32) -> dict[str, Any]:
    """A classification set that says how many classes it has (vectors of 8 features)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size, 8, generator=gen)
    y = torch.arange(size) % classes
    train = TensorDataset(x, y)
    train.classes = [f"c{i}" for i in range(classes)]  # type: ignore[attr-defined]
    return {"train": train, "eval": TensorDataset(x[:8], y[:8])}


class Mlp(nn.Module):
    def __init__(self, width: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class NanOnRank1(nn.Module):
    """A network whose forward fails on rank 1 at its third step (a user's own error)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, num_classes))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls == 3:
            raise FloatingPointError("the loss went nan in NanOnRank1.forward")
        return self.net(x)


class Shards(IterableDataset):  # type: ignore[type-arg]
    """An iterable data set that shards itself by rank, with a length per rank."""

    def __init__(self, rank: int, world_size: int, size: int = 64, classes: int = 3) -> None:
        self.rank, self.world_size, self.size, self.classes_ = rank, world_size, size, classes

    def __iter__(self) -> Any:
        gen = torch.Generator().manual_seed(self.rank)
        for _ in range(len(self)):
            yield torch.randn(8, generator=gen), torch.randint(self.classes_, (), generator=gen)

    def __len__(self) -> int:
        return self.size // self.world_size


def shards(rank: int, world_size: int) -> tuple[Any, Any]:
    return Shards(rank, world_size), Shards(rank, world_size, size=16)


class NotOnNode3(Dataset):  # type: ignore[type-arg]
    """A data set whose code fails on node3 only (a test cluster's third node: node3, bnode3),
    as a package missing from one node would."""

    def __init__(self) -> None:
        if socket.gethostname().endswith("node3"):
            raise ImportError("No module named 'site_only_package'")
        self.x, self.y = torch.randn(64, 8), torch.arange(64) % 3

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def differs_on_node3() -> tuple[Any, Any]:
    return NotOnNode3(), NotOnNode3()


class StuckOnRank1(Dataset):  # type: ignore[type-arg]
    """Rank 1's reads block once the file ``flag`` exists, as a read from a hung file system
    would; the other ranks go on into their next collective."""

    def __init__(self, flag: str, rank: int, size: int = 256) -> None:
        self.flag, self.rank = flag, rank
        self.x, self.y = torch.randn(size, 8), torch.arange(size) % 3

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        while self.rank == 1 and os.path.exists(self.flag):
            time.sleep(0.5)  # the line a stuck rank is found on
        return self.x[i], self.y[i]


def stuck_on_rank1(flag: str, rank: int) -> tuple[Any, Any]:
    return StuckOnRank1(flag, rank), StuckOnRank1(flag, -1, size=32)


class _Pictures(Dataset):  # type: ignore[type-arg]
    """uint8 [3, 10, 10] images of three classes (a factory's samples for pack)."""

    classes = ["a", "b", "c"]

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 10, 10), 40 * (i % 3), dtype=torch.uint8), i % 3


def image_data(size: int = 12) -> tuple[Any, Any]:
    return _Pictures(size), _Pictures(3)


def files_under(root: str) -> tuple[Any, Any]:
    """A data set of the files under ``root`` (one sample per file: its length), which logs
    the root it was given (the staging cluster test reads it from the rank log)."""
    import logging
    from pathlib import Path

    logging.getLogger(__name__).info("data factory root %s", root)
    sizes = sorted(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())
    x = torch.tensor(sizes, dtype=torch.float32).unsqueeze(1).repeat(1, 8) / 1000
    return TensorDataset(x, torch.arange(len(sizes)) % 2), None


def planted(marker: str) -> None:
    """What a planted `_target_` would run: any code at all, here creating ``marker``
    (tests/unit/test_planted_files.py checks it never runs from a file someone else wrote)."""
    from pathlib import Path

    Path(marker).touch()


def model_with_token(api_token: str, num_classes: int | None = None) -> Any:
    """A model whose factory takes a secret argument: keeps its SHA-256, never the value."""
    import hashlib

    model = torch.nn.Linear(4, 2)
    model.token_sha = hashlib.sha256(api_token.encode()).hexdigest()  # type: ignore[assignment]
    return model


class IdImages(Dataset):  # type: ignore[type-arg]
    """Small random images whose first pixels hold their index: a model can tell which samples
    each batch holds (tests/cluster/test_shrink.py records them)."""

    def __init__(self, size: int, classes: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 3, 8, 8, generator=gen)
        # The index in two pixels of at most 64 each: exact in bfloat16 too (FSDP casts the
        # inputs to the precision it computes in).
        index = torch.arange(size)
        self.x[:, 0, 0, 0], self.x[:, 0, 0, 1] = (index // 16).float(), (index % 16).float()
        # Labels a fixed linear teacher gives: a task a model learns, whose training converges
        # (random labels make it chaotic: rounding differences would grow step by step).
        teacher = torch.randn(3 * 8 * 8, classes, generator=torch.Generator().manual_seed(7))
        self.y = (self.x.flatten(1) @ teacher).argmax(1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def sample_ids(x: torch.Tensor) -> list[int]:
    """The indices of a batch of :class:`IdImages`."""
    return (x[:, 0, 0, 0].float().round().long() * 16
            + x[:, 0, 0, 1].float().round().long()).tolist()


def id_images(size: int = 1024, classes: int = 4) -> dict[str, Any]:
    train = IdImages(size, classes, 0)
    train.classes = [f"c{i}" for i in range(classes)]  # type: ignore[attr-defined]
    return {"train": train, "eval": IdImages(64, classes, 1)}


class IdRecorder(nn.Module):
    """An MLP that appends the sample ids of each training batch it gets to
    ``record_dir/rank<RANK>.jsonl``, with the start it belongs to (the job's requeue, the
    driver's relaunch, the supervisors' generation): the test's record, not the product's."""

    def __init__(self, record_dir: str, num_classes: int = 4, delay_s: float = 0.0) -> None:
        super().__init__()
        self.record_dir, self.delay_s = record_dir, delay_s
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.ReLU(),
                                 nn.Linear(32, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            start = [os.environ.get("SLURM_RESTART_COUNT", "0"),
                     os.environ.get("HPC_DDP_DRIVEN", "0"),
                     os.environ.get("HPC_DDP_GENERATION", "0")]
            ids = sample_ids(x)
            with open(Path(self.record_dir) / f"rank{os.environ['RANK']}.jsonl", "a") as out:
                out.write(json.dumps({"start": start, "ids": ids}) + "\n")
            time.sleep(self.delay_s)  # a step long enough to lose a node in the middle
        return self.net(x)
