"""Overrides Hydra refuses (or misreads) get one line with the key as typed and a fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_ddp.config.compose import compose, compose_many
from hpc_ddp.errors import UserError
from tests.conftest import compose_refusal


@pytest.mark.parametrize("overrides, start, words", [
    # A sweep without -m: Hydra's "Ambiguous value" had no fix.
    (["optim.lr=0.1,0.01"], "optim.lr=0.1,0.01: is a sweep",
     "python -m hpc_ddp.submit -m optim.lr=0.1,0.01"),
    # Commas on a list key: the list syntax, not a sweep.
    (["cluster.setup=a,b"], "cluster.setup=a,b:", "'cluster.setup=[a,b]'"),
    (["+optim.lr=1"], "+optim.lr=1: optim.lr exists already", "use optim.lr=1 to set it"),
    (["+optim.lr=1"], "+optim.lr=1:", "++optim.lr=1"),
    (["~optim.lr"], "override=~optim.lr: `~` deletes a key", "cannot be deleted"),
    (["~nodes"], "override=~nodes:", "set it instead (nodes=<value>"),
    (["~optim"], "override=~optim:", "optim=<option>"),
    (["~cluster.sbatch_extra.nope"], "override=~cluster.sbatch_extra.nope:", "nothing to delete"),
    # The whole override, not "optimm=", and the suggestion with the rest of the key.
    (["optimm.lr=0.1"], "optimm.lr=0.1: no such key", "did you mean optim.lr?"),
    (["+optimm.lr=0.1"], "optimm.lr=0.1: no such key", "did you mean optim.lr?"),
    (["+nccl.env.1BAD=x"], "+nccl.env.1BAD=x: is not an environment variable name",
     "not starting with a digit"),
    (["+cluster.sbatch_extra.2x=1"], "+cluster.sbatch_extra.2x=1: is not an sbatch option",
     "mail-type"),
    (["optim.lr=0.1,,0.01"], "optim.lr=0.1,,0.01: has an empty item",
     "optim.lr=0.1,0.01 (a sweep, with -m)"),
    (["cluster.setup=module load cuda"], "cluster.setup=module load cuda:",
     "'cluster.setup=[module load cuda]'"),
    (["optim.betas=0.9"], "optim.betas=0.9:", "'optim.betas=[0.9]'"),
    (["nccl.env=[a]"], "nccl.env=[a]:", "+nccl.env.<name>=<value>"),
    (["cluster.sbatch_extra=foo"], "cluster.sbatch_extra=foo:", "+cluster.sbatch_extra.<name>"),
    (["nodes=null"], "nodes=null:", "cannot be null"),
    (["dry_run=maybe"], "dry_run=maybe:", "dry_run=true or dry_run=false"),
    # OmegaConf reads any integer as a boolean: dry_run=2 was a dry run.
    (["dry_run=2"], "dry_run=2: is a boolean", "dry_run=true or dry_run=false"),
    # Not a Hydra app: hydra.* would be accepted and silently do nothing.
    (["hydra.run.dir=/tmp/x"], "override=hydra.run.dir=/tmp/x: hydra.* settings have no "
     "effect here", "use run_dir="),
    (["resume=-1"], "resume=-1: is a boolean", "resume=true"),
    (["=3"], "override==3: has no key", "key=value"),
    (["optim.lr=inf"], "optim.lr=inf: is not a finite number", "optim.lr=0.05"),
    (["cluster.mem_gb=nan"], "cluster.mem_gb=nan: is not a finite number", "cluster.mem_gb=null"),
    (["data=cifar10"], "data.root=null:", "data.root=/path"),
    (["scheduler.min_lr_ratio=2"], "scheduler.min_lr_ratio=2.0:",
     "scheduler.min_lr_ratio=0.1"),
    (["optim.betas=[0.9,1.5]"], "optim.betas=[0.9, 1.5]:", "'optim.betas=[0.9,0.999]'"),
])
def test_refused_overrides_say_the_fix(overrides: list[str], start: str, words: str) -> None:
    message = compose_refusal(overrides)
    assert message.startswith(start), message
    assert words in message, message


def test_no_quote_advice_for_a_bad_key() -> None:
    assert "quote the value" not in compose_refusal(["+nccl.env.1BAD=x"])


def test_sweep_advice_quotes_only_string_keys() -> None:
    assert "quote" not in compose_refusal(["optim.lr=0.1,0.01"])
    assert "cluster.partition='a,b'" in compose_refusal(["cluster.partition=a,b"])


def test_the_suggested_list_syntax_works() -> None:
    # What the fix for "cluster.setup=module load cuda" proposes, as the shell hands it over.
    assert compose(["cluster.setup=[module load cuda]"]).cluster.setup == ["module load cuda"]
    assert compose(["optim.betas=[0.8,0.99]"]).optim.betas == [0.8, 0.99]


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), ("true", True),
                                             ("off", False)])
def test_booleans_still_take_their_usual_spellings(value: str, expected: bool) -> None:
    assert compose([f"dry_run={value}"]).dry_run is expected


def test_compose_many_refuses_numbers_for_booleans() -> None:
    with pytest.raises(UserError, match="dry_run=2: is a boolean"):
        compose_many([["dry_run=true"], ["dry_run=2"]])


def test_map_entries_can_still_be_deleted() -> None:
    cfg = compose(["+cluster.sbatch_extra.mail-type=END", "~cluster.sbatch_extra.mail-type"])
    assert cfg.cluster.sbatch_extra == {}


def test_conf_dir_from_the_environment_must_exist(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    monkeypatch.setenv("HPC_DDP_CONF", str(missing))
    with pytest.raises(UserError) as info:
        compose(["nodes=1"])
    assert info.value.message.startswith(f"HPC_DDP_CONF={missing}: does not exist.")
    assert "unset HPC_DDP_CONF" in info.value.message
    with pytest.raises(UserError, match="does not exist"):
        compose_many([["nodes=1"]])


def test_conf_dir_needs_a_config_yaml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HPC_DDP_CONF", str(tmp_path))
    with pytest.raises(UserError, match=r"HPC_DDP_CONF=.*: has no config.yaml"):
        compose([])
    monkeypatch.delenv("HPC_DDP_CONF")
    # A user's config folder needs none: hpc_ddp's config.yaml is found behind it.
    assert compose([], config_dir=tmp_path).model.name == "tiny_cnn"
    with pytest.raises(UserError, match=r"^config_dir=.*nope: does not exist"):
        compose([f"config_dir={tmp_path / 'nope'}"])


def test_group_options_come_from_the_folder_in_use(tmp_path: Path) -> None:
    import shutil

    from hpc_ddp.config.compose import conf_dir

    conf = tmp_path / "conf"
    shutil.copytree(conf_dir({}), conf)
    (conf / "optim" / "sgd_site.yaml").write_text((conf / "optim" / "sgd.yaml").read_text())
    with pytest.raises(UserError, match="use one of adamw, sgd, sgd_site"):
        compose(["optim=nope"], config_dir=conf)


@pytest.mark.parametrize("typo, meant", [
    ("container.image=/shared/x.sif", "cluster.container.image"),  # its group left out
    ("cluster.contaner.image=x", "cluster.container.image"),
    ("trainr.seed=1", "trainer.seed"),
    ("imge_size=3", "data.image_size"),
    ("cluster.gpus_per_nod=1", "cluster.gpus_per_node"),
])
def test_a_suggested_key_is_one_that_exists(typo: str, meant: str) -> None:
    """A suggestion never names a key that does not exist (container.image once got
    'did you mean trainer.image?'): every group is searched."""
    import re

    from hpc_ddp.config.messages import all_keys

    message = compose_refusal([typo])
    suggested = re.search(r"did you mean (\S+)\?", message)
    assert suggested is not None and suggested[1] == meant, message
    assert meant in all_keys()
