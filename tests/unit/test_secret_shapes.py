"""Secrets the earlier rules let through (issue: a second user reads `scontrol show job` and
`ps`): a secret set by name in an sbatch option's value, each value of a swept secret (on
the submit command's own command line and in its error lines), curl's `-u user:password`,
a password in a scheme-less URL, a key named `bearer`; and a sweep of sweeps refused in one
line. Each test plants the value and proves it refused, referenced or masked."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from hpc_ddp.config import secrets
from hpc_ddp.config.compose import compose
from hpc_ddp.errors import UserError
from hpc_ddp.redact import mask_shapes, secret_name, secret_value
from hpc_ddp.submit import _masked, argv_without_secrets, main
from hpc_ddp.sweep.expand import expand
from tests.conftest import compose_refusal

PLANTED = "pw-4417-plain"


# -- (3) an sbatch option's value (scontrol show job shows it to every user) ----------------


@pytest.mark.parametrize("override", [
    f"+cluster.sbatch_extra.comment='password={PLANTED}'",
    f"+cluster.sbatch_extra.export='ALL,HF_TOKEN={PLANTED}'",
    f"+cluster.sbatch_extra.comment='--token {PLANTED}'",
    f"+cluster.sbatch_extra.comment='run db_password={PLANTED} nightly'",
    f"cluster.srun_args=['--export=ALL,HF_TOKEN', '--token {PLANTED}']",  # one item
    "cluster.job_name=hf_plantedJobNameToken000",
    f"cluster.account='token={PLANTED}'"])
def test_a_secret_set_by_name_in_an_sbatch_option_is_refused(override: str) -> None:
    with pytest.raises(UserError) as info:
        secrets.extract(compose(["cluster=slurm", override]))
    said = info.value.message
    assert "scontrol show job" in said and "would put a secret" in said, said
    assert PLANTED not in said and "hf_planted" not in said


@pytest.mark.parametrize("override", [
    "+cluster.sbatch_extra.export='ALL,HF_TOKEN'",  # by name: its value from the environment
    "+cluster.sbatch_extra.comment='nightly run, lr=0.1'",
    "+cluster.sbatch_extra.mail-type=END"])
def test_an_sbatch_option_that_sets_no_secret_passes(override: str) -> None:
    assert secrets.extract(compose(["cluster=slurm", override]))[1] == {}


def test_the_command_refuses_an_sbatch_option_secret_without_printing_it(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for override in (f"+cluster.sbatch_extra.comment='password={PLANTED}'",
                     f"+cluster.sbatch_extra.export='ALL,HF_TOKEN={PLANTED}'",
                     f"+cluster.sbatch_extra.mail_user='password={PLANTED}'",  # another check
                     f"cluster.job_name='token={PLANTED}'"):
        assert main(["cluster=slurm", f"run_dir={tmp_path / 'run'}", override],
                    out=io.StringIO()) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert PLANTED not in err, err
    # compose() itself (the Python API) never echoes it either
    said = compose_refusal([f"+cluster.sbatch_extra.mail_user='password={PLANTED}'"])
    assert PLANTED not in said and "cluster.sbatch_extra.mail_user=****" in said
    assert not (tmp_path / "run").exists()


def test_a_parse_error_of_an_sbatch_option_masks_a_short_secret(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster=slurm", "+cluster.sbatch_extra.comment=token=Q7"],
                out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "cannot be parsed" in err and "token=****" in err and "Q7" not in err, err
    # the literal of a quoted one is recorded, to be masked in every line printed
    assert secrets.literals_in([f"+cluster.sbatch_extra.comment='password={PLANTED}'"]) == [
        PLANTED]


# -- (4) a swept secret: each value by a reference of its own ------------------------------


A, B = "planted-sweep-a-0001", "planted-sweep-b-0002"


def test_the_restart_replaces_each_swept_value_by_its_own_reference() -> None:
    argv, values = argv_without_secrets(
        ["-m", "cluster=local", f"app.api_token={A},{B}", "optim.lr=0.1,0.2"])
    assert argv is not None and argv[:3] == [sys.executable, "-m", "hpc_ddp.submit"]
    assert not [a for a in argv if A in a or B in a], argv
    assert argv[3:] == ["-m", "cluster=local",
                        "app.api_token='${oc.env:HPC_DDP_SECRET_APP_API_TOKEN_0}',"
                        "'${oc.env:HPC_DDP_SECRET_APP_API_TOKEN_1}'", "optim.lr=0.1,0.2"]
    assert values == {"HPC_DDP_SECRET_APP_API_TOKEN_0": A, "HPC_DDP_SECRET_APP_API_TOKEN_1": B}
    # Each point carries its reference; the rank reads it from the environment it inherits.
    points = expand(argv[5:])
    assert [dict(p.params) for p in points] == [
        {"app.api_token": "****", "optim.lr": lr} for lr in ("0.1", "0.2")] * 2
    for point, value in zip(points, (A, A, B, B), strict=True):
        cfg = compose(list(point.overrides))
        assert secrets.extract(cfg)[1] == {}  # nothing literal left to take
        assert secrets.resolve_tree(cfg.app, values)["api_token"] == value


@pytest.mark.parametrize("override, names", [
    (f"+nccl.extra_env.HF_TOKEN={A},'{B}'", ["HPC_DDP_SECRET_HF_TOKEN_0",
                                            "HPC_DDP_SECRET_HF_TOKEN_1"]),
    (f"cluster.setup=['export HF_TOKEN={A}'],['login --token {B}', 'echo hi']",
     ["HPC_DDP_SECRET_HF_TOKEN_0", "HPC_DDP_SECRET_SETUP_1_1"]),
    (f"app.api_token=shuffle({A},{B})", ["HPC_DDP_SECRET_APP_API_TOKEN_0",
                                         "HPC_DDP_SECRET_APP_API_TOKEN_1"])])
def test_every_channel_of_a_swept_secret_gets_references(override: str,
                                                         names: list[str]) -> None:
    argv, values = argv_without_secrets(["-m", override])
    assert argv is not None and A not in " ".join(argv) and B not in " ".join(argv)
    assert values == dict(zip(names, (A, B), strict=True))
    assert len(expand(argv[4:])) == 2


def test_an_error_of_a_swept_secret_masks_every_value(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = [f"app.api_token={A},{B}", "cluster=local"]
    line = f"app.api_token={A}: (sweep point 0: app.api_token=****) is bad."
    assert _masked(line, ["-m", *args]) == "app.api_token=****: (sweep point 0: " \
        "app.api_token=****) is bad."
    assert sorted(secrets.literals_in(args)) == [A, B]
    # A swept setup line: the point's label (error lines, the manifest) is masked too.
    setup = f"cluster.setup=['export HF_TOKEN={A}'],['export HF_TOKEN={B}']"
    assert [dict(p.params) for p in expand([setup])] == [{"cluster.setup": "****"}] * 2
    assert main(["-m", setup, "cluster=local", "cluster.tasks_per_node=-1",
                 f"sweep.dir={tmp_path / 's'}"], out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "(sweep point 0: cluster.setup=****)" in err and A not in err and B not in err, err


# -- (12) shapes and names kept literal before ----------------------------------------------


def test_curl_user_password_and_a_flags_attached_value_become_references() -> None:
    lines = [f"curl -u me:{PLANTED} https://h/x", f"curl --user=me:{PLANTED}x https://h/x",
             f"curl -ume:{PLANTED}y https://h/x", f"huggingface-cli login --token={PLANTED}z",
             f"git clone https://oauth2:p@ss-{PLANTED}@gitlab.example/a.git",
             f"export https_proxy=alice:{PLANTED}w@proxy.example:3128",
             "docker run -u 1000:1000 img", "python -u train.py --user alice"]
    cfg = compose(["cluster.setup=[" + ", ".join(f"'{ln}'" for ln in lines) + "]"])
    scrubbed, found = secrets.extract(cfg)
    assert not [ln for ln in scrubbed.cluster.setup if PLANTED in ln], scrubbed.cluster.setup
    assert secrets.shell_lines(scrubbed.cluster.setup) == [
        'curl -u "${HPC_DDP_SECRET_SETUP_1}" https://h/x',
        'curl --user="${HPC_DDP_SECRET_SETUP_2}" https://h/x',
        'curl -u"${HPC_DDP_SECRET_SETUP_3}" https://h/x',
        'huggingface-cli login --token="${HPC_DDP_SECRET_SETUP_4}"',
        'git clone "${HPC_DDP_SECRET_SETUP_5}"',
        "export https_proxy=${HPC_DDP_SECRET_https_proxy}",
        "docker run -u 1000:1000 img", "python -u train.py --user alice"]
    assert found["HPC_DDP_SECRET_SETUP_1"] == f"me:{PLANTED}"
    assert found["HPC_DDP_SECRET_SETUP_5"] == f"https://oauth2:p@ss-{PLANTED}@gitlab.example/a.git"


def test_a_scripts_user_password_argument_becomes_a_reference() -> None:
    from hpc_ddp.inputs.command_line import with_script_args

    cfg = with_script_args(compose(["script=/tmp/t.py"]),
                           ["--user", f"me:{PLANTED}", f"--proxy-user=me:{PLANTED}"])
    scrubbed, found = secrets.extract(cfg)
    assert scrubbed.script_args == ["--user", "${oc.env:HPC_DDP_SECRET_ARG_USER}",
                                    "--proxy-user=${oc.env:HPC_DDP_SECRET_ARG_PROXY_USER}"]
    assert set(found.values()) == {f"me:{PLANTED}"}


@pytest.mark.parametrize("text, secret", [
    (f"alice:{PLANTED}@proxy.example:3128", True), (f"http_proxy=bob:{PLANTED}@proxy", True),
    (f"https://u:p@ss-{PLANTED}@host/x", True),
    ("nvcr.io/nvidia/pytorch:24.05-py3", False), ("git@github.com:org/repo.git", False),
    ("img:1.0@sha256:0123456789abcdef0123456789abcdef", False), ("/a:/b@x", False)])
def test_a_password_in_a_url_without_a_scheme_is_a_secret(text: str, secret: bool) -> None:
    assert secret_value(text) is secret
    if secret:
        assert PLANTED not in mask_shapes(text) and "ss-" not in mask_shapes(text)


def test_a_key_named_bearer_is_a_secret() -> None:
    assert secret_name("bearer") and secret_name("app.bearer") and secret_name("API_BEARER")
    assert not secret_name("bearing")
    scrubbed, found = secrets.extract(compose([f"+app.bearer={PLANTED}"]))
    assert scrubbed.app["bearer"] == "${oc.env:HPC_DDP_SECRET_APP_BEARER}"
    assert found == {"HPC_DDP_SECRET_APP_BEARER": PLANTED}


# -- (11b) a sweep among a sweep's values: one line ----------------------------------------


@pytest.mark.parametrize("override", ["+app.n=range(0,1000),range(0,1000)",
                                      "+app.n=1,interval(0,1)", "+app.n=[range(0,3)],[1]"])
def test_a_sweep_of_sweeps_is_refused_in_one_line(
        override: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["-m", override, "cluster=local", f"sweep.dir={tmp_path / 's'}"],
                out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {override}: puts a sweep"), err
    assert "Fix: sweep one range per key (+app.n=range(0,10))" in err
    assert not (tmp_path / "s").exists()
