"""Containers on the real 4-node cluster: training, a requeue and a sweep inside Podman
(a tiny root file system without Slurm's commands, hpc_ddp/testcluster/podman.py), the
command lines of pyxis and Apptainer through stand-ins that check and record them."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp import events
from hpc_ddp.rundir import rank_records
from hpc_ddp.testcluster import podman
from hpc_ddp.testcluster.cluster import TestCluster
from tests.cluster.slurm_final import assert_completed
from tests.cluster.test_fault_tolerance import (
    assert_completed_at_last,
    finish_releasing_requeues,
    wait_for_step,
)
from tests.cluster.test_layouts import assert_step_completed
from tests.cluster.test_slurm_submit import assert_sweep_completed, job_id_of, summary_of
from tests.conftest import REPO, command_env

pytestmark = pytest.mark.cluster
Run = Callable[..., subprocess.CompletedProcess[str]]
TINY = ["data.train_size=256", "data.eval_size=64", "trainer.batch_size=16",
        "trainer.log_interval=5", "trainer.eval_interval=1000", "trainer.checkpoint_interval=5",
        "trainer.stop_check_interval=2", "trainer.collective_timeout_s=30",
        "trainer.rendezvous_timeout_s=60"]


@pytest.fixture(scope="module")
def in_podman(slurm_cluster: TestCluster) -> tuple[list[str], dict[str, str], Any]:
    """The overrides that run every task in Podman on the test cluster, the client
    environment (podman's configuration) and the setup."""
    problem = podman.missing()
    if problem:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"podman cannot run here: {problem}", pytrace=False)
        pytest.skip(f"podman cannot run here: {problem}")
    setup = podman.prepare(slurm_cluster.state_dir)
    overrides = ["container=podman", f"cluster.container.image={setup.rootfs}",
                 "cluster.container.rootfs=true",
                 f"cluster.container.mounts=[{','.join(setup.mounts)}]",
                 # The image's Python: the host's .venv, mounted with the working directory.
                 f"cluster.python={sys.executable}"]
    return overrides, {**os.environ, **slurm_cluster.env(), **setup.env}, setup


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in rank_records(run_dir / "ranks")]


def test_podman_trains_requeues_through_the_relay_and_sweeps(
        hpc_ddp: Run, slurm_cluster: TestCluster,
        in_podman: tuple[list[str], dict[str, str], Any], tmp_path: Path) -> None:
    overrides, env, setup = in_podman
    # A sweep of a function entry (2 points of 1 node) goes out first and returns at once;
    # its array runs beside the training job on the nodes' second CPUs.
    sweep = tmp_path / "sweep"
    swept = hpc_ddp("submit", ["-m", "cluster=slurm", "nodes=1", *overrides,
                               "entry=tests.usercode.entries:where", "app.point=1,2",
                               f"sweep.dir={sweep}"], env=env)
    assert swept.returncode == 0, swept.stdout + swept.stderr
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", ["cluster=slurm", "nodes=4", *overrides, *TINY,
                              "trainer.max_steps=100", f"run_dir={run_dir}"], env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    job = job_id_of(done.stdout)
    wait_for_step(run_dir, 10)
    subprocess.run(["scancel", "--signal=USR2", job], env=env, check=True)
    assert finish_releasing_requeues(job, run_dir, env) >= 1
    assert_completed_at_last(job, env)
    summary = summary_of(run_dir)
    assert summary["global_step"] == 100 and summary["restarts"] == 1
    assert [e["kind"] for e in events.read(run_dir)] == ["stop", "requeue"]
    assert summary["environment"]["mixed"] == [] and summary["environment"]["torch"]
    assert {r["container"] for r in records(run_dir)} == {"podman"}
    assert sorted(summary["nodes"]) == slurm_cluster.node_names
    # scontrol requeue and squeue (the stop's cause) ran outside, through the relay.
    rank0 = (run_dir / "logs" / "rank0.log").read_text()
    assert f"relay: scontrol requeue {job} -> exit 0" in rank0, rank0[-3000:]
    assert f"relay: squeue -h -j {job} -o %L -> exit 0" in rank0

    deadline = time.monotonic() + 240
    points = sorted(sweep.glob("*/summary.json"))
    while len(points) < 2:
        assert time.monotonic() < deadline, f"the sweep did not finish: {list(sweep.iterdir())}"
        time.sleep(1)
        points = sorted(sweep.glob("*/summary.json"))
    for path in points:
        (seen,) = json.loads(path.read_text())["result"]["ranks"]
        assert_inside_podman(seen)
    assert_sweep_completed(sweep, env)
    assert podman.leftover_containers(setup, env) == []


def assert_inside_podman(seen: dict[str, Any]) -> None:
    """What tests.usercode.entries:where saw: no shell, no Slurm command, podman's marker."""
    assert seen["slurm_tools"] == {"scontrol": None, "squeue": None, "srun": None, "sh": None}
    assert seen["podman_marker"] and not seen["usr_bin"]
    assert seen["python"] == sys.executable


def test_podman_in_a_step_of_an_allocation(
        slurm_cluster: TestCluster, in_podman: tuple[list[str], dict[str, str], Any],
        tmp_path: Path) -> None:
    overrides, env, setup = in_podman
    run_dir = tmp_path / "run"
    submit = shlex.join([sys.executable, "-m", "hpc_ddp.submit", "cluster=step", "nodes=2",
                         *overrides, "entry=tests.usercode.entries:where",
                         f"run_dir={run_dir}"])
    done = subprocess.run(["salloc", "-N2", "-Q", "bash", "-c", submit], cwd=REPO,
                          env=command_env(env), capture_output=True, text=True, timeout=240,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_step_completed(run_dir, env)
    ranks = summary_of(run_dir)["result"]["ranks"]
    assert sorted(r["host"] for r in ranks) == slurm_cluster.node_names[:2]
    for seen in ranks:
        assert_inside_podman(seen)
    assert podman.leftover_containers(setup, env) == []


def test_pyxis_and_apptainer_command_lines_through_stand_ins(
        hpc_ddp: Run, slurm_env: dict[str, str], tmp_path: Path) -> None:
    """Their dry-run scripts pass `sbatch --test-only`; then a job of each trains through a
    stand-in that checks its command line against the documented syntax and records it
    (tests/cluster/standins.py). Not proven on a real pyxis or Apptainer."""
    from tests.cluster import standins

    bin_dir, seen = tmp_path / "bin", tmp_path / "seen"
    standins.write(bin_dir, seen, REPO)
    image = tmp_path / "train.sif"
    image.write_text("a stand-in image\n")
    env = {**slurm_env, "PATH": f"{bin_dir}:{slurm_env['PATH']}"}  # the job's srun: pyxis'
    kinds = {"pyxis": ["container=pyxis", "cluster.container.image='nvcr.io#nvidia/pytorch:x'",
                       "+cluster.container.env.HELLO=pyxis world"],
             "apptainer": ["container=apptainer", f"cluster.container.image={image}",
                           f"cluster.container.runtime={bin_dir / 'apptainer'}",
                           "+cluster.container.env.HELLO=apptainer world"]}
    jobs = {}
    for kind, extra in kinds.items():
        args = ["cluster=slurm", "nodes=2", *extra, f"cluster.python={sys.executable}", *TINY,
                "trainer.max_steps=5", f"run_dir={tmp_path / kind}"]
        dry = hpc_ddp("submit", [*args, "dry_run=true"], env=env)
        assert dry.returncode == 0, dry.stderr
        script = tmp_path / f"{kind}.sh"
        script.write_text(dry.stdout)
        test_only = subprocess.run(["sbatch", "--test-only", str(script)], env=env,
                                   capture_output=True, text=True, check=False)
        assert test_only.returncode == 0, test_only.stderr
        jobs[kind] = subprocess.Popen([sys.executable, "-m", "hpc_ddp.submit", *args,
                                       "wait=true"], cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for kind, proc in jobs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        assert_completed(job_id_of(out), env, out)
        assert summary_of(tmp_path / kind)["global_step"] == 5
        assert {r["container"] for r in records(tmp_path / kind)} == {kind}
    found = [standins.parse_pyxis(json.loads(p.read_text()))[0] for p in seen.glob("srun-*")]
    pyxis = next(f for f in found if f)  # the apptainer job's srun has no pyxis options
    assert pyxis["container-image"] == "nvcr.io#nvidia/pytorch:x"
    assert f"{tmp_path / 'pyxis'}:{tmp_path / 'pyxis'}" in str(pyxis["container-mounts"])
    assert pyxis["container-workdir"] == str(REPO)
    assert pyxis["container-env"] == "HELLO,HPC_DDP_CONTAINER"
    assert str(pyxis["container-name"]).startswith("hpc_ddp-")
    for path in seen.glob("apptainer-*.json"):  # one per task, on both nodes
        options, shown_image, command = standins.parse_apptainer(json.loads(path.read_text()))
        task = [sys.executable, "-m", "hpc_ddp.rank.main.submitted", "-u"]  # launch/slurm.py
        assert shown_image == str(image) and command[:4] == task
        assert options["--pwd"] == [str(REPO)] and "HELLO=apptainer world" in options["--env"]
        assert f"{tmp_path / 'apptainer'}:{tmp_path / 'apptainer'}" in options["--bind"]
    assert len(list(seen.glob("apptainer-*.json"))) == 2


def test_podman_runs_the_sharded_trainer_and_a_script(
        hpc_ddp: Run, in_podman: tuple[list[str], dict[str, str], Any], tmp_path: Path) -> None:
    """The combinations the matrix cannot run locally: trainer.strategy=fsdp inside
    containers (NCCL-less here: gloo between the containers of 2 nodes), and script= (the
    example project's torchrun-style script, its supervisor and the script itself in the
    container). Both jobs go out at once and end COMPLETED 0:0."""
    overrides, env, setup = in_podman
    sharded, script = tmp_path / "fsdp", tmp_path / "script"
    jobs = []
    # From the repository (the container mounts the working directory, the venv's python
    # with it); the script's own folder puts its project (seqproj) on its path.
    for args in (
            ["trainer.strategy=fsdp", "model=resnet18", "data.image_size=16", *TINY,
             "trainer.max_steps=10", f"run_dir={sharded}"],
            ["script=examples/seqproject/train_ddp.py", f"run_dir={script}", "--",
             "--epochs", "1", "--checkpoint", str(script / "script.pt")]):
        done = hpc_ddp("submit", ["cluster=slurm", "nodes=2", *overrides, *args], env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        jobs.append(job_id_of(done.stdout))
    deadline = time.monotonic() + 300
    while not all((d / "summary.json").exists() for d in (sharded, script)):
        assert time.monotonic() < deadline, "the containers' jobs did not finish"
        time.sleep(1)
    for job in jobs:
        assert_completed(job, env)
    trained = summary_of(sharded)
    assert trained["global_step"] == 10 and trained["settings"]["strategy"] == "fsdp"
    assert trained["world_size"] == 2
    assert {r["container"] for r in records(sharded)} == {"podman"}
    assert {r["container"] for r in records(script)} == {"podman"}
    assert (script / "script.pt").is_file()  # the script saved its own checkpoint
    assert podman.leftover_containers(setup, env) == []
