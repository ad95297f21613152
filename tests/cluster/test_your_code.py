"""A user's own code on the real 4-node cluster, at the three depths of docs/your-code.md:
the example project (examples/seqproject) through `_target_` configs and --config-dir, its own
loop as a function entry, and unchanged torchrun-style scripts. Each survives a requeue."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_ddp import events
from hpc_ddp.rank.services import checkpoint
from hpc_ddp.testcluster.cluster import TestCluster
from tests.cluster.slurm_final import assert_completed, assert_ended
from tests.cluster.test_fault_tolerance import (
    assert_completed_at_last,
    assert_one_start_completed,
    assert_same_as,
    finish_releasing_requeues,
    squeue_state,
    training_pid,
    wait_for_step,
)
from tests.cluster.test_slurm_submit import (
    activated,
    assert_sweep_completed,
    job_id_of,
    sacct_nodes,
    sbatch_and_wait,
    summary_of,
)
from tests.conftest import REPO

pytestmark = pytest.mark.cluster
Run = Callable[..., subprocess.CompletedProcess[str]]
PROJECT = REPO / "examples" / "seqproject"
# ~0.06 s a step on four 2-core "nodes" sharing this machine's two cores.
TARGET = ["--config-dir", "conf", "cluster=slurm", "nodes=4", "trainer.max_steps=120",
          "trainer.checkpoint_interval=10", "trainer.log_interval=10",
          "trainer.eval_interval=60", "trainer.stop_check_interval=2",
          "trainer.collective_timeout_s=30", "trainer.rendezvous_timeout_s=60"]
# A reference run (the uninterrupted one a resumed run is compared with, bitwise): each rank
# in its own process, without a supervisor; the same training, half the processes.
UNSUPERVISED = ["cluster.supervise=false"]
ENTRY = ["--config-dir", "conf", "cluster=slurm", "nodes=4", "entry=seqproj.loop:main",
         "app.steps=150", "app.checkpoint_every=20", "trainer.stop_check_interval=2",
         "trainer.collective_timeout_s=30"]


def submit(hpc_ddp: Run, args: list[str], env: dict[str, str], *extra: str) -> str:
    done = hpc_ddp("submit", [*args, *extra], env=env, cwd=PROJECT)
    assert done.returncode == 0, done.stdout + done.stderr
    return job_id_of(done.stdout)


def run_to_end(hpc_ddp: Run, args: list[str], env: dict[str, str], run_dir: Path) -> None:
    """An uninterrupted run, ended COMPLETED 0:0 in Slurm as well."""
    done = hpc_ddp("submit", [*args, f"run_dir={run_dir}", "wait=true"], env=env, cwd=PROJECT,
                   timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_completed(job_id_of(done.stdout), env, done.stdout)


def start_beside(hpc_ddp: Run, args: list[str], env: dict[str, str], run_dir: Path) -> str:
    """An uninterrupted run submitted without waiting for it: it runs beside the test's
    interrupted one (the nodes' second CPUs), so its start and its steps overlap that run's
    waits; :func:`finish_beside` waits for it."""
    return submit(hpc_ddp, args, env, f"run_dir={run_dir}")


def finish_beside(job: str, run_dir: Path, env: dict[str, str]) -> None:
    """The run :func:`start_beside` submitted ended uninterrupted, COMPLETED 0:0 in Slurm."""
    assert finish_releasing_requeues(job, run_dir, env) == 0
    assert_completed(job, env)


def requeue_signal(job: str, env: dict[str, str]) -> None:
    """The requeue signal to every step of the job, as --signal=USR2@T sends it (not to the
    batch shell)."""
    subprocess.run(["scancel", "--signal=USR2", job], env=env, check=True)


def test_target_project_trains_requeues_and_resumes_bitwise(
        hpc_ddp: Run, slurm_cluster: TestCluster, slurm_env: dict[str, str],
        tmp_path: Path) -> None:
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    beside = start_beside(hpc_ddp, [*TARGET, *UNSUPERVISED], slurm_env, reference_dir)
    job = submit(hpc_ddp, TARGET, slurm_env, f"run_dir={run_dir}")
    wait_for_step(run_dir, 40)
    requeue_signal(job, slurm_env)
    assert finish_releasing_requeues(job, run_dir, slurm_env) >= 1
    assert_completed_at_last(job, slurm_env)
    finish_beside(beside, reference_dir, slurm_env)
    reference = checkpoint.load_latest(reference_dir / "checkpoints")
    assert reference is not None
    summary = summary_of(reference_dir)
    assert summary["nodes"] == slurm_cluster.node_names
    # The project's own metric, and no accuracy: a regression task.
    assert {"loss", "mae", "within_tenth"} == set(summary["eval_metrics"])
    assert summary["eval_accuracy"] is None and summary["eval_loss"] < 0.5
    resumed = assert_same_as(reference, run_dir)  # weights bitwise, every TB step once
    assert resumed["restarts"] == 1 and resumed["resumed_from_step"] >= 40
    assert [e["kind"] for e in events.read(run_dir)] == ["stop", "requeue"]
    config = (run_dir / "config.yaml").read_text()
    assert "_target_: seqproj.model.TinyTransformer" in config
    assert f"config_dir: {PROJECT / 'conf'}" in config


def test_target_project_sweeps_as_a_job_array(hpc_ddp: Run, slurm_env: dict[str, str],
                                              tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    done = hpc_ddp("submit", ["-m", "--config-dir", "conf", "cluster=slurm", "nodes=2",
                              "optim.lr=0.001,0.003", "model.dim=16,32",
                              "trainer.max_steps=20", f"sweep.dir={sweep}"],
                   env=slurm_env, cwd=PROJECT)
    assert done.returncode == 0, done.stdout + done.stderr
    manifest = json.loads((sweep / "sweep.json").read_text())
    assert len(manifest["arrays"]) == 1 and len(manifest["points"]) == 4
    array = manifest["arrays"][0]
    assert [p["job_id"] for p in manifest["points"]] == [f"{array}_{i}" for i in range(4)]
    for point in manifest["points"]:
        run_dir = Path(point["run_dir"])
        finish_releasing_requeues(point["job_id"], run_dir, slurm_env, timeout=300)
        summary = summary_of(run_dir)
        assert summary["global_step"] == 20 and len(summary["nodes"]) == 2
        assert "hparam/eval_mae" in _hparam_tags(run_dir)
    assert_sweep_completed(sweep, slurm_env)
    dims = {json.loads((Path(p["run_dir"]) / "hparams.json").read_text())["model.dim"]
            for p in manifest["points"]}
    assert dims == {"16", "32"}


def _hparam_tags(run_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for folder in {p.parent for p in (run_dir / "tb").rglob("events.out.tfevents.*")}:
        acc = EventAccumulator(str(folder))
        acc.Reload()
        tags |= set(acc.Tags().get("scalars", []))
        tags |= {t for t in acc.summary_metadata if t.startswith("hparam/")}
    return tags


def test_function_entry_requeues_and_ends_as_uninterrupted(
        hpc_ddp: Run, slurm_cluster: TestCluster, slurm_env: dict[str, str],
        tmp_path: Path) -> None:
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    beside = start_beside(hpc_ddp, [*ENTRY, *UNSUPERVISED], slurm_env, reference_dir)
    job = submit(hpc_ddp, ENTRY, slurm_env, f"run_dir={run_dir}")
    wait_for_step(run_dir, 30)
    requeue_signal(job, slurm_env)
    assert finish_releasing_requeues(job, run_dir, slurm_env) >= 1
    assert_completed_at_last(job, slurm_env)
    finish_beside(beside, reference_dir, slurm_env)
    reference = _user_state(reference_dir)
    summary = summary_of(reference_dir)
    assert summary["program"] == "entry seqproj.loop:main" and summary["global_step"] == 150
    assert summary["hosts"] == slurm_cluster.node_names
    assert isinstance(summary["final_loss"], float)
    state = _user_state(run_dir)
    assert state["step"] == reference["step"] == 150
    for name, tensor in reference["model"].items():  # the loop resumed mid-epoch exactly
        assert torch.equal(tensor, state["model"][name]), name
    resumed = summary_of(run_dir)
    assert resumed["restarts"] == 1 and resumed["resumed_from_step"] >= 30
    assert [e["kind"] for e in events.read(run_dir)] == ["stop", "requeue"]

    # One rank's process killed (the out-of-memory killer): every rank restarts in place
    # from ctx.load(), in the same job, and ends as the uninterrupted run did.
    killed_dir = tmp_path / "killed"
    job = submit(hpc_ddp, ENTRY, slurm_env, f"run_dir={killed_dir}")
    wait_for_step(killed_dir, 30)
    os.kill(training_pid(killed_dir, 2, generation=0), signal.SIGKILL)
    assert finish_releasing_requeues(job, killed_dir, slurm_env) == 0
    assert_one_start_completed(job, slurm_env)
    state = _user_state(killed_dir)
    assert state["step"] == 150
    for name, tensor in reference["model"].items():
        assert torch.equal(tensor, state["model"][name]), name
    summary = summary_of(killed_dir)
    assert summary["restarts_in_place"] == 1 and summary["requeues"] == 0
    assert "died from SIGKILL" in summary["failures"][0]["cause"]
    assert [e["kind"] for e in events.read(killed_dir)] == [
        "failure", "restart_in_place", "recovered"]


def _user_state(run_dir: Path) -> dict[str, Any]:
    state = checkpoint.load_latest(run_dir / "checkpoints")
    assert state is not None
    # ctx.save's layout: the loop's own keys, and hpc_ddp's record beside them
    assert state["hpc_ddp"]["step"] == state["step"]
    return {k: v for k, v in state.items() if k != "hpc_ddp"}


PROBE = '''\
import json, os, socket, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
        "MASTER_PORT")
record = {k: os.environ.get(k) for k in keys}
record.update(host=socket.gethostname(), argv=sys.argv[1:], total=total.item(),
              backend=dist.get_backend())
out = sys.argv[1]
with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
'''


def test_unchanged_script_gets_the_torchrun_variables_on_four_nodes(
        hpc_ddp: Run, slurm_env: dict[str, str], tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    hostile = ["--name", "a b;$(touch pwned)'\"`touch pwned`", "--x=[1,2]", "--"]
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", ["cluster=slurm", "nodes=4", f"script={probe}",
                              f"run_dir={run_dir}", "wait=true", "--", str(out), *hostile],
                   env=slurm_env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    job = job_id_of(done.stdout)
    assert_completed(job, slurm_env, done.stdout)
    placed = sacct_nodes(job, slurm_env)
    for rank, record in enumerate(records):
        assert record["RANK"] == str(rank) and record["WORLD_SIZE"] == "4"
        assert record["LOCAL_RANK"] == "0" and record["LOCAL_WORLD_SIZE"] == "1"
        assert record["GROUP_RANK"] == str(rank)
        assert record["host"] == placed[rank]  # rank r on the r-th node of the allocation
        assert record["MASTER_ADDR"] == placed[0] and record["MASTER_PORT"].isdigit()
        assert record["argv"] == [str(out), *hostile]  # as data, nothing run by a shell
        assert record["total"] == 6.0 and record["backend"] == "gloo"
    assert not list(tmp_path.rglob("pwned"))
    assert summary_of(run_dir)["exit_codes"] == {str(r): 0 for r in range(4)}


def textbook_scripts_each_at_its_first_epoch(
        hpc_ddp: Run, env: dict[str, str], tmp_path: Path,
        actions: dict[str, Callable[[str, Path], None]]) -> dict[str, tuple[str, Path, Path]]:
    """examples/seqproject/train_ddp.py on 4 nodes for 6 epochs, one job per name, side by
    side on the same nodes (one CPU of each node's two each); each job's action(job, its
    checkpoint file) runs the moment that job saved its first epoch, not once both did (a job
    that started seconds earlier would be through its last epoch by then): name -> (job, its
    checkpoint file, the run dir)."""
    jobs = {}
    for name in actions:
        saved, run_dir = tmp_path / f"{name}.pt", tmp_path / name
        jobs[name] = (submit(hpc_ddp, ["cluster=slurm", "nodes=4", "script=train_ddp.py",
                                       f"run_dir={run_dir}", "--", "--epochs", "6",
                                       "--checkpoint", str(saved)], env), saved, run_dir)
    waiting = dict(actions)
    deadline = time.monotonic() + 300
    while waiting:
        assert time.monotonic() < deadline, f"{sorted(waiting)} never saved a first epoch"
        for name in [n for n in waiting if jobs[n][1].exists()]:
            waiting.pop(name)(jobs[name][0], jobs[name][1])
        time.sleep(0.1)
    return jobs


def kill_one_forked_script(job: str, saved: Path) -> None:
    """SIGKILL to the last of the job's 4 scripts, after checking each is a fork of its
    node's warm process."""
    scripts = subprocess.run(["pgrep", "-f", f"script_runner .*train_ddp.py .*{saved}"],
                             capture_output=True, text=True, check=False).stdout.split()
    assert len(scripts) == 4, scripts
    for pid in scripts:
        parent = Path(f"/proc/{pid}/status").read_text().split("PPid:")[1].split()[0]
        assert "hpc_ddp.rank.warm.server" in Path(f"/proc/{parent}/cmdline").read_text()
    os.kill(int(scripts[-1]), signal.SIGKILL)


def test_textbook_script_requeued_and_killed_continues_and_restarts_in_place(
        hpc_ddp: Run, slurm_env: dict[str, str], tmp_path: Path) -> None:
    """The textbook script unchanged, two jobs side by side: one gets the requeue signal (it
    requeues and continues from its own checkpoint), the other loses one rank's script to
    SIGKILL (every rank's script starts again in the same job and resumes: docs/your-code.md).
    Each script a fork of its node's warm process, as `ps` shows it."""
    jobs = textbook_scripts_each_at_its_first_epoch(hpc_ddp, slurm_env, tmp_path, {
        "requeued": lambda job, _: requeue_signal(job, slurm_env),
        "killed": kill_one_forked_script})
    job, saved, run_dir = jobs["killed"]
    requeued, requeued_saved, requeued_dir = jobs["requeued"]

    assert finish_releasing_requeues(job, run_dir, slurm_env) == 0
    assert_one_start_completed(job, slurm_env)
    assert torch.load(saved)["epoch"] == 6
    out = (run_dir / "submitit" / job / f"{job}_0_log.out").read_text()
    assert "resumed at epoch" in out and "epoch 5 loss" in out
    summary = summary_of(run_dir)
    assert summary["restarts_in_place"] == 1 and summary["requeues"] == 0
    assert "the script died from SIGKILL" in summary["failures"][0]["cause"]
    assert [e["kind"] for e in events.read(run_dir)] == ["failure", "restart_in_place"]

    finish_releasing_requeues(requeued, requeued_dir, slurm_env)
    assert squeue_state(requeued, slurm_env) == ""
    assert_completed_at_last(requeued, slurm_env)
    assert [e["kind"] for e in events.read(requeued_dir)] == ["stop", "requeue"]
    assert torch.load(requeued_saved)["epoch"] == 6
    out = (requeued_dir / "submitit" / requeued / f"{requeued}_0_log.out").read_text()
    assert "resumed at epoch" in out and "epoch 5 loss" in out
    summary = summary_of(requeued_dir)
    assert summary["restarts"] == 1 and summary["program"].startswith("script ")


def test_script_through_the_sbatch_wrapper(slurm_env: dict[str, str], tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    run_dir = tmp_path / "run"
    job, log = sbatch_and_wait(
        ["-N2", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10",
         str(REPO / "jobs" / "train.sbatch"), f"script={probe}", f"run_dir={run_dir}", "--",
         str(out), "two words"], tmp_path, activated(slurm_env))
    assert_completed(job, slurm_env, log)
    assert (run_dir / "summary.json").is_file(), log
    # The last line names the script (it saved no step), never "step None".
    assert f"hpc_ddp: done, script {probe} " in log and "step None" not in log, log
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["LOCAL_RANK"] for r in records] == ["0", "1", "0", "1"]
    assert [r["GROUP_RANK"] for r in records] == ["0", "0", "1", "1"]
    assert all(r["argv"] == [str(out), "two words"] for r in records)
    assert len({r["host"] for r in records}) == 2


def test_a_node_whose_environment_differs_is_named(hpc_ddp: Run, slurm_cluster: TestCluster,
                                                   slurm_env: dict[str, str],
                                                   tmp_path: Path) -> None:
    # The factory imports fine here and on three nodes; on node3 it fails, as a package
    # missing from one node's environment does.
    done = hpc_ddp("submit", ["cluster=slurm", "nodes=4", "wait=true",
                              "data._target_=tests.usercode.parts.differs_on_node3",
                              "model._target_=tests.usercode.parts.Mlp",
                              "trainer.collective_timeout_s=20", f"run_dir={tmp_path / 'run'}"],
                   env=slurm_env, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    node3 = slurm_cluster.node_names[2]
    assert (f"rank 2 on {node3}: data._target_=tests.usercode.parts.differs_on_node3"
            in done.stdout), done.stdout
    assert "site_only_package" in done.stdout
    assert [e["kind"] for e in events.read(tmp_path / "run")].count("requeue") == 0
    assert_ended(job_id_of(done.stdout), slurm_env, "FAILED", done.stdout)
