"""What counts as a secret (names, value shapes, marks) and each channel one comes in by: the
config and the saved overrides hold references, the values travel apart, nothing printed or
put on a command line holds them (hpc_ddp/redact.py, config/secrets.py)."""

from __future__ import annotations

import io
import shlex
from pathlib import Path

import pytest

from hpc_ddp.config import secrets
from hpc_ddp.config.compose import compose, from_yaml, to_yaml
from hpc_ddp.errors import UserError
from hpc_ddp.launch import slurm
from hpc_ddp.launch.resolve import resolve
from hpc_ddp.redact import Marks, secret_name, secret_value
from hpc_ddp.rundir import RunDir

TOKEN = "hf_plantedTokenValue00000001"


@pytest.mark.parametrize("name", [
    "WANDB_API_KEY", "HF_TOKEN", "MY_SERVICE_PASSWORD", "PIP_INDEX_URL_PASSWORD", "MYSQL_PWD",
    "SSHPASS", "DATABASE_URL", "GH_PAT", "CI_JOB_JWT", "AZURE_STORAGE_CONNECTION_STRING",
    "SLACK_WEBHOOK_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "SENTRY_DSN",
    "model.api_token", "data.token", "--hf-token", "dbPassword", "SSH_PRIVATE_KEY",
    # issue 35's gaps: plural and other common names, a short password flag
    "api_keys", "OPENAI_API_KEYS", "cookie", "SESSION_COOKIES", "session_id", "AUTHORIZATION",
    "-p"])
def test_secret_names(name: str) -> None:
    assert secret_name(name)


@pytest.mark.parametrize("name", [
    "NCCL_IB_PKEY", "PWD", "OLDPWD", "PATH", "LD_LIBRARY_PATH", "model.key_dim", "KEYBOARD",
    "pad_token_id", "max_tokens", "BYPASS", "PIP_INDEX_URL", "NCCL_SOCKET_IFNAME", "HOME",
    "model.p", "keys", "--header", "cookie_cutter_dim"])
def test_names_that_are_no_secret(name: str) -> None:
    assert not secret_name(name)


@pytest.mark.parametrize("value, secret", [
    ("https://bob:pw-4417@pypi.example/simple", True), ("https://pypi.org/simple", False),
    (TOKEN, True), ("ghp_abcdefghijklmnopqrstuvwxyz1234", True),
    ("sk-proj-abcdefghijklmnop12", True),
    ("AKIAABCDEFGHIJKLMNOP", True), ("Endpoint=x;AccountKey=Zm9vYmFy==;", True),
    ("/home/me/data", False), ("0x8001", False), ("hf_short", False),
    ("Authorization: Bearer abcdefgh12345678", True), ("Authorization: Basic dXNlcjpwdw==", True),
    ("bearer of news", False)])
def test_secret_shapes(value: str, secret: bool) -> None:
    assert secret_value(value) is secret


def test_marks_decide_where_the_rules_are_wrong() -> None:
    marks = Marks.of(["MY_DB", "model.conn"], ["model.pad_token"])
    assert secret_name("MY_DB", marks) and secret_name("model.conn", marks)
    assert not secret_name("model.pad_token", marks) and secret_name("model.pad_token")
    cfg = compose(["+nccl.extra_env.MY_DB=postgres-9", "secrets.secret=[MY_DB]",
                   "model._target_=tests.usercode.parts.image_data", "model.pad_token=pad-token-x",
                   "secrets.public=[pad_token]"])
    scrubbed, found = secrets.extract(cfg)
    assert found == {"MY_DB": "postgres-9"}
    assert scrubbed.model.kwargs == {"pad_token": "pad-token-x"}


def test_setup_lines_dollar_literals_and_commas() -> None:
    lines = ["export DB_PASSWORD='$up3rS3cret'", "export HF_TOKEN=$'hf_abc\\x41'",
             "export HF_TOKEN2=hf_abc,def123", "export A=$HOME B=\"$HF_TOKEN\" C=$X",
             "huggingface-cli login --token abc123xyz",
             "export PIP_INDEX_URL=https://me:pw-4417@pypi.example/simple"]
    cfg = compose(["cluster.setup=[" + ", ".join(
        "'" + ln.replace("'", "\\'") + "'" for ln in lines) + "]"])
    scrubbed, found = secrets.extract(cfg)
    assert found == {"DB_PASSWORD": "$up3rS3cret", "HF_TOKEN": "hf_abcA",
                     "HF_TOKEN2": "hf_abc,def123", "HPC_DDP_SECRET_SETUP_1": "abc123xyz",
                     "HPC_DDP_SECRET_PIP_INDEX_URL": "https://me:pw-4417@pypi.example/simple"}
    assert secrets.shell_lines(scrubbed.cluster.setup) == [
        "export DB_PASSWORD=${DB_PASSWORD}", "export HF_TOKEN=${HF_TOKEN}",
        "export HF_TOKEN2=${HF_TOKEN2}", "export A=$HOME B=\"$HF_TOKEN\" C=$X",
        'huggingface-cli login --token "${HPC_DDP_SECRET_SETUP_1}"',
        "export PIP_INDEX_URL=${HPC_DDP_SECRET_PIP_INDEX_URL}"]
    assert from_yaml(to_yaml(scrubbed)) == scrubbed  # read back as written, not resolved


def test_every_channel_and_the_saved_overrides_agree() -> None:
    given = [f"+cluster.container.env.WANDB_API_KEY={TOKEN}", "container=podman",
             "cluster.container.image=/img", "model._target_=tests.usercode.parts.image_data",
             f"model.api_token={TOKEN}", "app.db_url=https://u:pw-1@db/x",
             "+nccl.extra_env.NCCL_IB_PKEY=0x8001", "script=/tmp/t.py"]
    from hpc_ddp.inputs.command_line import with_script_args

    cfg = with_script_args(compose(["cluster=slurm", *given]),
                           ["--hf-token", TOKEN, "--epochs", "3", f"--key={TOKEN}x"])
    scrubbed, found = secrets.extract(cfg)
    text = to_yaml(scrubbed)
    assert TOKEN not in text and "pw-1" not in text
    assert scrubbed.nccl.extra_env == {"NCCL_IB_PKEY": "0x8001"}  # not a secret: kept
    assert scrubbed.script_args == ["--hf-token", "${oc.env:HPC_DDP_SECRET_ARG_HF_TOKEN}",
                                    "--epochs", "3", "--key=${oc.env:HPC_DDP_SECRET_ARG_KEY}"]
    assert set(found) == {"WANDB_API_KEY", "HPC_DDP_SECRET_MODEL_API_TOKEN",
                          "HPC_DDP_SECRET_APP_DB_URL", "HPC_DDP_SECRET_ARG_HF_TOKEN",
                          "HPC_DDP_SECRET_ARG_KEY"}
    saved = secrets.scrub_overrides(["cluster=slurm", *given])
    assert not [o for o in saved if TOKEN in o or "pw-1" in o]
    again = with_script_args(compose(saved), scrubbed.script_args)
    assert secrets.extract(again) == (scrubbed, {})  # a resume composes the same references


@pytest.mark.parametrize("runtime, by_name", [
    ("podman", ["--env", "WANDB_API_KEY"]), ("apptainer", []), ("pyxis", [])])
def test_a_containers_secret_is_passed_by_name_never_on_the_command_line(
        runtime: str, by_name: list[str], tmp_path: Path) -> None:
    image = "nvcr.io#nvidia/pytorch:24.05-py3" if runtime == "pyxis" else "/img/train.sif"
    cfg = resolve(compose(["cluster=slurm", f"container={runtime}",
                           f"cluster.container.image='{image}'",
                           f"+cluster.container.env.WANDB_API_KEY={TOKEN}",
                           "+cluster.container.env.HF_HOME=${oc.env:HF_TOKEN,/x}"]),
                  {}, tmp_path)
    cfg, found = secrets.extract(cfg)
    script = slurm.render(cfg, RunDir(tmp_path / "run"))
    assert found == {"WANDB_API_KEY": TOKEN} and TOKEN not in script
    srun = next(ln for ln in script.splitlines() if ln.startswith("srun "))
    assert "WANDB_API_KEY=" not in srun and "oc.env" not in script
    assert 'export WANDB_API_KEY="${WANDB_API_KEY}"' in script  # from the job's environment
    assert 'export HF_HOME="${HF_TOKEN:-/x}"' in script  # a reference, not its text
    if by_name:
        words = shlex.split(srun)
        assert any(words[i:i + 2] == by_name for i in range(len(words)))
    if runtime == "apptainer":
        assert 'export APPTAINERENV_WANDB_API_KEY="${WANDB_API_KEY}"' in script


@pytest.mark.parametrize("override", [
    f"cluster.srun_args=['--export=ALL,HF_TOKEN={TOKEN}']",
    f"+cluster.sbatch_extra.comment={TOKEN}",
    "cluster.container.image='docker://bob:pw-4417@registry.example/img'",
    # By name, a value of no known shape (issue 35): NAME=value anywhere in an item, a
    # secret-named flag and its value.
    "cluster.srun_args=['--export=ALL,HF_TOKEN=pw-4417-plain']",
    "cluster.srun_args=['--comment','password=pw-4417-plain']",
    "cluster.srun_args=['--comment=db_password=pw-4417-plain']",
    "cluster.srun_args=['--token','pw-4417-plain']",
    "cluster.container.options=['--env','WANDB_API_KEY=pw-4417-plain']"])
def test_what_others_can_read_cannot_carry_a_secret(override: str) -> None:
    with pytest.raises(UserError) as info:
        secrets.extract(compose(["cluster=slurm", override]))
    said = info.value.message
    assert "other users of the cluster can read" in said or "scontrol show job" in said
    assert TOKEN not in said and "pw-4417" not in said


@pytest.mark.parametrize("override", [
    "cluster.srun_args=['--export=ALL,HF_TOKEN']",  # by name: the value from the environment
    "cluster.srun_args=['--cpu-bind=cores','--comment','nightly run']",
    "cluster.container.options=['--env','LANG=C.UTF-8']"])
def test_arguments_that_name_no_secret_value_pass(override: str) -> None:
    cfg, found = secrets.extract(compose(["cluster=slurm", override]))
    assert found == {}


def test_errors_show_no_secret(capsys: pytest.CaptureFixture[str]) -> None:
    from hpc_ddp.submit import main

    assert UserError("model.api_token", TOKEN, "is bad.", "fix it.").message == (
        "model.api_token=****: is bad. Fix: fix it.")
    assert TOKEN not in UserError("x", 1, f"holds {TOKEN}.", "").message
    for args in ([f"trainer.max_steps={TOKEN}"], [f"+nccl.extra_env.HF-TOKEN={TOKEN}x"],
                 ["cluster.setup=['export DB_PASSWORD='$up3rS3cret-7'"]):
        assert main(["cluster=slurm", *args], out=io.StringIO()) == 2
        err = capsys.readouterr().err
        assert TOKEN not in err and "$up3rS3cret-7" not in err, err


def test_sweep_points_with_different_secrets_get_variables_of_their_own() -> None:
    names = secrets.Names()  # what api.plan_many shares between a sweep's points
    done = []
    for index, value in enumerate(("tok-a-000001", "tok-b-000002", "tok-a-000001")):
        names.point = index
        cfg = compose(["model._target_=tests.usercode.parts.image_data",
                       f"model.api_token={value}"])
        scrubbed, found = secrets.extract(cfg, names)
        done.append((scrubbed, secrets.scrub_overrides([f"model.api_token={value}"],
                                                       names=names), found))
    hidden = [h for _, _, h in done]
    assert hidden == [{"HPC_DDP_SECRET_MODEL_API_TOKEN": "tok-a-000001"},
                      {"HPC_DDP_SECRET_P1_MODEL_API_TOKEN": "tok-b-000002"},
                      {"HPC_DDP_SECRET_MODEL_API_TOKEN": "tok-a-000001"}]
    assert done[1][0].model.kwargs["api_token"] == "${oc.env:HPC_DDP_SECRET_P1_MODEL_API_TOKEN}"
    assert done[1][1] == ["model.api_token='${oc.env:HPC_DDP_SECRET_P1_MODEL_API_TOKEN}'"]
    # A value a later point repeats keeps the variable it was first given.
    names.point = 3
    again = secrets.extract(compose(["model._target_=tests.usercode.parts.image_data",
                                     "model.api_token=tok-b-000002"]), names)[1]
    assert again == {"HPC_DDP_SECRET_P1_MODEL_API_TOKEN": "tok-b-000002"}
    # Within one run a second value for one name is still refused.
    with pytest.raises(UserError, match="a second, different value"):
        secrets.extract(compose(["cluster.setup=['export A_TOKEN=x1234567','export "
                                 "A_TOKEN=y7654321']"]), secrets.Names())


def test_the_sbatch_wrappers_tasks_refuse_a_secret_on_their_command_line(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from hpc_ddp.train import main

    assert main([f"run_dir={tmp_path / 'run'}", "model._target_=tests.usercode.parts.image_data",
                 f"model.api_token={TOKEN}"]) == 2
    err = capsys.readouterr().err
    assert "every user of the job's nodes can read" in err and TOKEN not in err
    assert not (tmp_path / "run").exists()
