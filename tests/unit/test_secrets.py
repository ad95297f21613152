"""Secrets pass as references and are masked where printed; run dirs get cluster.umask."""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path

import pytest

from hpc_ddp.config import secrets
from hpc_ddp.config.compose import compose, from_yaml, to_yaml
from hpc_ddp.rundir import created_with, parse_umask
from tests.conftest import compose_refusal

KEY = "lit-wandb-0c4e11d2"


def test_a_literal_secret_becomes_a_reference_and_its_value_travels_apart() -> None:
    cfg = compose([f"cluster.setup=['module load x && export WANDB_API_KEY=\"{KEY}\" A=1']",
                   "+nccl.extra_env.HF_TOKEN=tok-5a5a5a", "+nccl.extra_env.NCCL_DEBUG=WARN"])
    scrubbed, values = secrets.extract(cfg)
    assert values == {"WANDB_API_KEY": KEY, "HF_TOKEN": "tok-5a5a5a"}
    assert scrubbed.cluster.setup == [
        "module load x && export WANDB_API_KEY=${oc.env:WANDB_API_KEY} A=1"]
    assert scrubbed.nccl.extra_env == {"HF_TOKEN": "${oc.env:HF_TOKEN}", "NCCL_DEBUG": "WARN"}
    text = to_yaml(scrubbed)
    assert KEY not in text and from_yaml(text) == scrubbed  # the node reads it back as written
    assert secrets.extract(scrubbed) == (scrubbed, {})  # references stay references


def test_a_secrets_reference_is_resolved_on_the_node_not_at_submission(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_API_KEY", KEY)
    monkeypatch.setenv("SCRATCH", "/scratch/me")
    cfg = compose(["cluster.setup=['export MY_API_KEY=${oc.env:MY_API_KEY}']",
                   "data.root=${oc.env:SCRATCH}/cifar"])
    assert cfg.cluster.setup == ["export MY_API_KEY=${oc.env:MY_API_KEY}"]
    assert cfg.data.root == "/scratch/me/cifar"  # not a secret: resolved as ever
    assert secrets.shell_lines(cfg.cluster.setup) == ["export MY_API_KEY=${MY_API_KEY}"]
    from omegaconf import OmegaConf

    assert OmegaConf.create({"k": "${oc.env:MY_API_KEY}"}).k == KEY  # only inside compose


def test_the_sbatch_script_and_the_printed_lines_hold_no_secret(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from hpc_ddp.submit import main

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    out = io.StringIO()
    code = main(["cluster=slurm", "dry_run=true", f"run_dir={tmp_path / 'run'}",
                 f"cluster.setup=['export WANDB_API_KEY={KEY}']",
                 "cluster.setup=['export HF_TOKEN=${oc.env:HF_TOKEN}']"], out=out)
    assert code == 0
    script, err = out.getvalue(), capsys.readouterr().err
    assert "export HF_TOKEN=${HF_TOKEN}" in script and KEY not in script + err
    assert "HF_TOKEN is passed as ${oc.env:HF_TOKEN} but is not set here" in err
    code = main(["cluster=slurm", f"+nccl.extra_env.HF-TOKEN={KEY}"], out=out)
    assert code == 2 and KEY not in capsys.readouterr().err  # the refusal masks it


def test_an_sbatch_option_cannot_carry_a_secret() -> None:
    cfg = compose(["+cluster.sbatch_extra.comment=${oc.env:MY_TOKEN}"])
    with pytest.raises(Exception, match="cluster.sbatch_extra.comment=.*scontrol show job"):
        secrets.extract(cfg)


def test_overrides_keep_references_and_leave_other_keys_alone() -> None:
    given = [f"cluster.setup=['export WANDB_API_KEY={KEY}']", "model.kwargs.key_dim=64",
             "nccl.extra_env={HF_TOKEN: tok-777777, NCCL_DEBUG: INFO}",
             "+cluster.sbatch_extra.wckey=proj1"]
    assert secrets.scrub_overrides(given) == [
        "cluster.setup=['export WANDB_API_KEY=${oc.env:WANDB_API_KEY}']",
        "model.kwargs.key_dim=64",
        "nccl.extra_env={HF_TOKEN: '${oc.env:HF_TOKEN}', NCCL_DEBUG: INFO}",
        "+cluster.sbatch_extra.wckey=proj1"]
    assert sorted(secrets.literals_in(given)) == sorted([KEY, "tok-777777"])


def test_a_reference_is_read_from_the_ranks_environment() -> None:
    from hpc_ddp.config.nccl_schema import NcclConfig
    from hpc_ddp.rank.join.nccl import planned_changes

    cfg = NcclConfig(extra_env={"HF_TOKEN": "${oc.env:HF_TOKEN}", "X_KEY": "${oc.env:NOPE}"})
    changes = planned_changes(cfg, {"HF_TOKEN": KEY})
    assert [(c.name, c.new) for c in changes] == []  # already set to that value
    changes = planned_changes(cfg, {"HF_TOKEN": KEY, "OTHER": "x"})
    assert all(c.name != "X_KEY" for c in changes)  # NOPE is not set there: left out
    assert secrets.resolve("a-${oc.env:N,dflt}", {}) == "a-dflt"


def test_the_rank_log_masks_the_values_of_secret_variables(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc_ddp.rank.join import ranklog

    monkeypatch.setenv("SERVICE_PASSWORD", KEY)
    ranklog.setup(tmp_path / "rank0.log", 0, "node1", echo=False)
    try:
        logging.getLogger("x").info("connecting with %s", KEY)
    finally:
        for handler in list(logging.getLogger().handlers):
            handler.close()
            logging.getLogger().removeHandler(handler)
    assert "connecting with ****" in (tmp_path / "rank0.log").read_text()


@pytest.mark.parametrize("value, mask", [("027", 0o027), ("77", 0o077), ("0o022", 0o022),
                                         (27, 0o027)])
def test_umask_values(value: str | int, mask: int) -> None:
    assert parse_umask(value) == mask


@pytest.mark.parametrize("value", ["002", "000", "020", "9", "0277", "rw"])
def test_a_umask_that_lets_others_write_is_refused(value: str) -> None:
    assert compose_refusal([f"cluster.umask={value}"]).startswith(f"cluster.umask={value}: ")


def test_files_made_under_the_umask(tmp_path: Path) -> None:
    before = os.umask(0o002)
    try:
        with created_with("027"):
            (tmp_path / "run").mkdir()
            (tmp_path / "run" / "f").write_text("x")
        assert (tmp_path / "run").stat().st_mode & 0o777 == 0o750
        assert (tmp_path / "run" / "f").stat().st_mode & 0o777 == 0o640
        assert os.umask(0o002) == 0o002  # the process's own is back
    finally:
        os.umask(before)
