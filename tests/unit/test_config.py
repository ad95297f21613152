"""Composition and validation: typed groups, typos, wrong types, impossible values."""

from __future__ import annotations

import pytest

from hpc_ddp.config.compose import compose, from_yaml, to_yaml
from hpc_ddp.config.schema import Config
from hpc_ddp.errors import UserError


def test_defaults_compose_to_the_documented_run() -> None:
    cfg = compose([])
    assert isinstance(cfg, Config)
    assert (cfg.cluster.kind, cfg.model.name, cfg.data.name, cfg.optim.name) == (
        "auto", "tiny_cnn", "synthetic", "sgd")
    assert cfg.nodes == 1 and cfg.trainer.epochs == 2 and cfg.nccl.profile == "default"


@pytest.mark.parametrize("overrides, attr, value", [
    (["nodes=4"], "nodes", 4),
    (["model=resnet50"], "model.name", "resnet50"),
    (["optim=adamw", "optim.lr=0.001"], "optim.lr", 0.001),
    (["cluster=slurm", "cluster.gpus_per_node=4"], "cluster.gpus_per_node", 4),
    (["+cluster.sbatch_extra.mail-type=END"], "cluster.sbatch_extra", {"mail-type": "END"}),
    (["trainer.max_steps=60"], "trainer.max_steps", 60),
])
def test_overrides_reach_the_typed_config(overrides: list[str], attr: str, value: object) -> None:
    node: object = compose(overrides)
    for part in attr.split("."):
        node = getattr(node, part)
    assert node == value


@pytest.mark.parametrize("overrides, key, words", [
    (["nodes=0"], "nodes=0", "nodes=1 or more"),
    (["trainer.batch_size=-4"], "trainer.batch_size=-4", ">= 1"),
    (["trainer.batchsize=3"], "trainer.batchsize=3", "did you mean trainer.batch_size"),
    (["+trainer.bogus=1"], "trainer.bogus=1", "no such key"),
    (["trainer.batch_size=abc"], "trainer.batch_size=abc", "could not be converted"),
    (["model=foo"], "model=foo", "resnet18, resnet50, timm, tiny_cnn, torchvision"),
    (["data=foo"], "data=foo", "cifar10, image_folder, shards, synthetic"),
    (["data=cifar10"], "data.root=null", "hpc_ddp.data download"),
    (["optim.lr=0"], "optim.lr=0", "positive"),
    (["scheduler.name=poly"], "scheduler.name=poly", "cosine, linear, constant"),
    (["optim.schedule=linear"], "optim.schedule=linear: has moved", "scheduler=<cosine"),
    (["model.num_clases=5"], "model.num_clases=5", "did you mean model.num_classes?"),
    (["model._target_=my.Net", "entry=a.b:c", "script=x.py"], "script=x.py", "keep one"),
    (["entry=my_pkg.train"], "entry=my_pkg.train", "entry=my_pkg.train:main"),
    (["cluster.kind=pbs"], "cluster.kind=pbs", "auto, local, slurm"),
    (["cluster=slurm", "cluster.gpus_per_node=4", "cluster.tasks_per_node=2"],
     "cluster.tasks_per_node=2", "cluster.gpus_per_node=4"),
    (["cluster.job_name=a b"], "cluster.job_name=a b", "plain name"),
    (["trainer.device=tpu"], "trainer.device=tpu", "auto, cpu, cuda"),
    (["optim.lr=[1"], "optim.lr=[1", "the whole override for the shell (\"optim.lr='[1'\")"),
    (["nccl.socket_ifname=^docker,lo"], "nccl.socket_ifname=^docker,lo",
     "(\"nccl.socket_ifname='^docker,lo'\") when it holds brackets, commas, spaces, quotes, "
     "^ or ="),
    (["nodes=2", "cluster.nodelist=node[1-2]"], "cluster.nodelist=node[1-2]",
     "cluster.nodelist='node[1-2]'"),
])
def test_bad_input_names_key_value_and_fix(overrides: list[str], key: str, words: str) -> None:
    with pytest.raises(UserError) as info:
        compose(overrides)
    message = info.value.message
    assert message.startswith(key), message
    assert words in message
    assert "Fix:" in message and "\n" not in message


def test_yaml_round_trip_keeps_every_value() -> None:
    cfg = compose(["nodes=3", "optim=adamw", "trainer.max_steps=7", "cluster=slurm",
                   "cluster.setup=[module load cuda]"])
    again = from_yaml(to_yaml(cfg))
    assert again == cfg


def test_new_map_keys_need_plus() -> None:
    with pytest.raises(UserError, match=r"\+cluster.sbatch_extra.mail-type=\.\.\."):
        compose(["cluster.sbatch_extra.mail-type=END"])


def test_model_must_match_the_data() -> None:
    with pytest.raises(UserError, match="model.num_classes=10"):
        compose(["model.num_classes=5"])
    with pytest.raises(UserError, match="CIFAR-10 images are 32x32"):
        compose(["data=cifar10", "data.root=/x", "data.image_size=64"])
