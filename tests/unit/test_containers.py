"""Containers as config: what each runtime's command line holds, checked against its
documented syntax (the stand-ins' parsers), and bad input refused in one line."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from hpc_ddp.config.compose import compose
from hpc_ddp.errors import UserError
from hpc_ddp.launch import container, slurm, step
from hpc_ddp.launch.resolve import resolve
from hpc_ddp.rundir import RunDir
from tests.cluster.standins import Refused, parse_apptainer, parse_pyxis
from tests.conftest import compose_refusal

RUN = Path("/shared/runs/r1")
CODE = Path("/home/me/project")
PYXIS_IMAGE = "cluster.container.image='nvcr.io#nvidia/pytorch:24.05-py3'"


def cfg_of(*overrides: str):  # type: ignore[no-untyped-def]
    return resolve(compose(["cluster=slurm", "nodes=2", f"run_dir={RUN}", *overrides]),
                   {"PATH": os.environ["PATH"]}, CODE)


def srun_line(cfg) -> list[str]:  # type: ignore[no-untyped-def]
    """The words of the sbatch script's srun line, as bash would split them."""
    script = slurm.render(cfg, RunDir(RUN))
    line = next(ln for ln in script.splitlines() if ln.startswith("srun "))
    return shlex.split(line)


def test_pyxis_options_are_srun_options_in_the_documented_form() -> None:
    cfg = cfg_of("container=pyxis", PYXIS_IMAGE, "data.root=/data/set",
                 "+cluster.container.env.OMP_NUM_THREADS=4",
                 "cluster.container.pass_env=[WANDB_API_KEY]",
                 "cluster.container.mounts=[/scratch:/scratch:ro]")
    words = srun_line(cfg)
    found, rest = parse_pyxis(words[1:])
    assert found["container-image"] == "nvcr.io#nvidia/pytorch:24.05-py3"
    # The data read-only, the run dir and code read-write at their own paths (shortest path
    # first, so a mount inside another comes after it), then the user's.
    assert found["container-mounts"] == (f"/data/set:/data/set:ro,{RUN}:{RUN},{CODE}:{CODE},"
                                         "/scratch:/scratch:ro")
    assert found["container-workdir"] == str(CODE)
    assert found["container-env"] == "WANDB_API_KEY,OMP_NUM_THREADS,HPC_DDP_CONTAINER"
    assert str(found["container-name"]).startswith("hpc_ddp-")
    # The image's python, through the checked loader of the job's pickle (owned.py).
    assert rest[-7:-1] == ["python", "-m", "hpc_ddp.rank.main.submitted", "-u", "-m",
                           "submitit.core._submit"]
    script = slurm.render(cfg, RunDir(RUN))
    assert "export OMP_NUM_THREADS=4\n" in script  # pyxis takes the value from the job
    assert "hpc_ddp_slurm_relay \"$HPC_DDP_SLURM_RELAY\" $$ &" in script


def test_the_pyxis_name_follows_the_image_and_can_be_turned_off() -> None:
    a = container.command(cfg_of("container=pyxis", PYXIS_IMAGE), RUN, "py").srun_args
    b = container.command(cfg_of("container=pyxis", "cluster.container.image=/sq/b.sqsh"),
                          RUN, "py").srun_args
    names = [next(w for w in args if w.startswith("--container-name=")) for args in (a, b)]
    assert names[0] != names[1]
    off = container.command(cfg_of("container=pyxis", PYXIS_IMAGE, "cluster.container.name=''"),
                            RUN, "py").srun_args
    assert not any(w.startswith("--container-name") for w in off)


def test_apptainer_exec_with_nv_binds_pwd_and_env() -> None:
    cfg = cfg_of("container=apptainer", "cluster.container.image=/img/train.sif",
                 "cluster.gpus_per_node=2", "+cluster.container.env.A=b c")
    words = srun_line(cfg)
    start = words.index("apptainer")
    options, image, command = parse_apptainer(words[start + 1:])
    assert image == "/img/train.sif" and command[:3] == ["python", "-m",
                                                         "hpc_ddp.rank.main.submitted"]
    assert options["--nv"] == [""]  # the job asks for GPUs
    assert options["--bind"] == [f"{RUN}:{RUN}", f"{CODE}:{CODE}"]
    assert options["--pwd"] == [str(CODE)]
    assert options["--env"] == ["A=b c", "HPC_DDP_CONTAINER=apptainer"]
    no_gpu = container.command(cfg_of("container=apptainer", "cluster.container.image=/i.sif"),
                               RUN, "python")
    assert "--nv" not in no_gpu.prefix


def test_podman_run_shares_the_nodes_namespaces_and_passes_slurms_variables() -> None:
    cfg = cfg_of("container=podman", "cluster.container.image=localhost/train:1",
                 "cluster.gpus_per_node=1", "cluster.container.pass_env=[WANDB_*]",
                 "cluster.container.options=['--userns=keep-id']")
    task = container.command(cfg, RUN, "python")
    argv = task.prefix
    assert argv[:3] == ["podman", "run", "--rm"]
    for flag in ("--network=host", "--pid=host", "--ipc=host", "--uts=host"):
        assert flag in argv
    pairs = {argv[i + 1] for i, w in enumerate(argv) if w == "--env"}
    assert {"SLURM*", "SUBMITIT_*", "HPC_DDP_*", "NCCL_*", "WANDB_*",
            "HPC_DDP_CONTAINER=podman"} <= pairs
    assert argv[argv.index("--device") + 1] == "nvidia.com/gpu=all"  # CDI
    assert argv[-2:] == ["--userns=keep-id", "localhost/train:1"]
    rootfs = container.command(cfg_of("container=podman", "cluster.container.image=/fs/root",
                                      "cluster.container.rootfs=true"), RUN, "python")
    assert rootfs.prefix[-2:] == ["--rootfs", "/fs/root"]


def test_mounts_are_not_repeated_inside_one_another() -> None:
    cfg = cfg_of("container=podman", "cluster.container.image=i",
                 f"run_dir={CODE}/outputs/r1", f"data.root={CODE}/data")
    shown = [(m.source, m.read_only) for m in container.mounts(cfg, Path(cfg.run_dir))]
    assert shown == [(str(CODE), False)]  # the run dir and the data are in the code folder
    ro_code = container.mounts(cfg_of("container=podman", "cluster.container.image=i",
                                      "cluster.container.auto_mounts=false",
                                      "data.root=/d"), RUN)
    assert [(m.source, m.read_only) for m in ro_code] == [("/d", True)]


def test_a_script_path_under_no_mount_is_named() -> None:
    """What a script writes outside its container's mounts is lost with the container (the
    cluster's podman test met it): submit names each such argument."""
    cfg = cfg_of("container=podman", "cluster.container.image=i",
                 f"script={CODE}/train.py")
    cfg.script_args = ["--checkpoint", "/scratch/me/ck.pt", f"--out={RUN}/ck",
                       f"{CODE}/data/x", "--epochs", "2", "--log=/var/tmp/log.txt"]
    assert container.unmounted(cfg, RUN) == ["/scratch/me/ck.pt", "/var/tmp/log.txt"]
    assert container.unmounted(cfg_of(f"script={CODE}/train.py"), RUN) == []


def test_a_sweep_groups_points_by_their_image() -> None:
    a, b = (slurm.executor_parameters(cfg_of("container=apptainer",
                                             f"cluster.container.image=/i/{n}.sif"))
            for n in ("a", "b"))
    assert a != b and a == slurm.executor_parameters(cfg_of(
        "container=apptainer", "cluster.container.image=/i/a.sif"))


def test_a_step_of_an_allocation_runs_in_the_container_too() -> None:
    alloc = step.Allocation("42", ("n1", "n2"), (4, 4), None, in_step=False)
    argv = step.command(cfg_of("container=apptainer", "cluster.container.image=/i.sif"),
                        alloc, "/usr/bin/python3", RUN)
    start = argv.index("apptainer")
    assert argv[0] == "srun" and argv[start + 1] == "exec"
    assert argv[-4:] == ["python", "-u", "-m", "hpc_ddp.rank.main.step"]


def test_the_relay_starts_only_with_a_container() -> None:
    assert "hpc_ddp_slurm_relay" not in slurm.render(cfg_of(), RunDir(RUN))
    script = slurm.render(cfg_of("container=podman", "cluster.container.image=i"), RunDir(RUN))
    assert f"export HPC_DDP_SLURM_RELAY={RUN}/submitit/relay/\"$SLURM_JOB_ID\"" in script


@pytest.mark.parametrize("overrides, key", [
    (["container=podman"], "cluster.container.image=null"),
    (["container=docker"], "container=docker: no such container"),
    (["container=apptainer", "cluster.container.image=x", "cluster.container.rootfs=true"],
     "cluster.container.rootfs=true"),
    (["container=podman", "cluster.container.image=x", "cluster.container.mounts=[data:/d]"],
     "cluster.container.mounts=data:/d"),
    (["container=pyxis", PYXIS_IMAGE, "cluster.container.mounts=['/a,b:/c']"],
     "cluster.container.mounts=/a,b:/c"),
    (["container=podman", "cluster.container.image=x", "+cluster.container.env.A-B=x"],
     "cluster.container.env.A-B=x"),
    (["container=pyxis", PYXIS_IMAGE, "cluster.container.pass_env=[NCCL_*]"],
     "cluster.container.pass_env=NCCL_*"),
    (["container=podman", "cluster.container.image=x", "cluster.container.workdir=rel"],
     "cluster.container.workdir=rel"),
    (["cluster.venv=.venv"], "cluster.venv=.venv: is not an absolute path"),
    (["cluster.venv=/v", "cluster.conda_env=e"], "cluster.venv=/v: and cluster.conda_env=e"),
])
def test_bad_container_input_is_one_line_naming_the_key(overrides: list[str], key: str) -> None:
    message = compose_refusal(overrides)
    assert message.startswith(key) and "Fix:" in message and "\n" not in message


@pytest.mark.parametrize("extra", [["container=podman", "cluster.container.image=x"],
                                   ["cluster.venv=/opt/v"], ["cluster.conda_env=train"]])
def test_containers_and_envs_are_for_slurm_tasks_not_local_runs(extra: list[str]) -> None:
    with pytest.raises(UserError, match="this run is local"):
        resolve(compose(["cluster=local", *extra]), {}, CODE)


def test_the_stand_ins_refuse_what_the_runtimes_would() -> None:
    with pytest.raises(Refused):
        parse_pyxis(["--container-mounts=/a:/b", "python"])  # no image
    with pytest.raises(Refused):
        parse_pyxis(["--container-image=x", "--container-mounts=/a::ro", "py"])
    with pytest.raises(Refused):
        parse_apptainer(["exec", "--bind", "/a:/b:rx", "img", "python"])
    with pytest.raises(Refused):
        parse_apptainer(["run", "img", "python"])
