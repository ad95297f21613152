"""The built-in trainer in this process as a world of one rank (gloo on a HashStore): for
unit tests of what the loop does step by step (tests/unit/test_perf_trainer.py,
test_comm_hooks.py, which take the fixture as ``one_rank_group``: tests/unit/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hpc_ddp.config.compose import compose
from hpc_ddp.rank.join.distenv import DistEnv
from hpc_ddp.rundir import RunDir

ENV = DistEnv(rank=0, local_rank=0, world_size=1, node_rank=0, num_nodes=1,
              local_world_size=1, source="single", job_id="test")


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    """A process group of one, for the module's tests."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def trainer(overrides: list[str], folder: Path) -> Any:
    """The built-in trainer of ``overrides`` on CPU, its run dir ``folder``."""
    from hpc_ddp.trainer.loop import Trainer

    return Trainer(compose(overrides), ENV, RunDir(folder), torch.device("cpu"))
