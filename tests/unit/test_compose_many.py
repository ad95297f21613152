"""The sweep fast path composes exactly what compose() does, and refuses the same input."""

from __future__ import annotations

import pytest

from hpc_ddp.config.compose import compose, compose_many
from hpc_ddp.errors import UserError

TABLE = [
    [],
    ["optim.lr=0.3", "model=resnet18"],
    ["model=resnet18", "optim=adamw", "optim.lr=0.001", "trainer.seed=4"],
    ["cluster=slurm", "cluster.gpus_per_node=2", "+cluster.sbatch_extra.mail-type=END"],
    ["cluster.setup=[module load x,conda activate y]", "nodes=3"],
    ["data=cifar10", "data.root=/data", "trainer.max_steps=7"],
    ["nccl=infiniband", "nccl.ib_timeout=22"],
    ["run_dir='/tmp/a b'", "optim.lr=0.3"],
]


def test_same_configs_as_compose() -> None:
    assert compose_many(TABLE) == [compose(o) for o in TABLE]


@pytest.mark.parametrize("bad", [["trainer.batchsize=3"], ["nodes=0"], ["model=vgg"],
                                 ["trainer.batch_size=x"], ["+trainer.bogus=1"]])
def test_same_errors_as_compose(bad: list[str]) -> None:
    with pytest.raises(UserError) as expected:
        compose(bad)
    with pytest.raises(UserError) as got:
        compose_many([["optim.lr=0.1"], bad])
    assert got.value.message == expected.value.message
