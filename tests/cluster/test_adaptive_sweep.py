"""Adaptive sweeps on the real cluster: a study's workers as one Slurm job array, each
running its trials as steps of its own allocation; trials that start without waiting for a
batch, a real pruner whose pruned trial's node takes the next trial at once, a worker whose
job is requeued mid-trial resuming that trial from its checkpoint, and a study continued by
a second submit."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest

from tests.cluster.slurm_final import assert_completed
from tests.integration.test_adaptive_sweep import study_of

pytestmark = pytest.mark.cluster
Run = Callable[..., subprocess.CompletedProcess[str]]

SMALL = ["cluster=slurm", "nodes=1", "data.train_size=512", "data.eval_size=128",
         "trainer.log_interval=5", "trainer.checkpoint_interval=10"]


def workers_of(folder: Path) -> list[str]:
    return json.loads((folder / "study.json").read_text())["workers"]


def wait_for_workers(folder: Path, env: dict[str, str], timeout: float = 600) -> None:
    array = workers_of(folder)[0].split("_")[0]
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "-h", "-j", array], env=env, capture_output=True,
                         text=True, check=False).stdout.strip():
        assert time.monotonic() < deadline, f"the workers ({array}) did not end"
        time.sleep(1)


def worker_output(folder: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((folder / "workers").glob("*.out")))


def test_eight_trials_on_three_workers_no_batches_pruned_a_node_down_and_a_worker_gone(
        hpc_ddp: Run, slurm_env: dict[str, str], tmp_path: Path) -> None:
    from tests.cluster.test_fault_tolerance import take_down, wait_for_step

    # Three workers (one node each) and a grid of eight trials: lr=1000 diverges and Optuna's
    # ThresholdPruner stops it at its first evaluation (step 10); 10 or 600 steps; two
    # seeds. A grid sampler's seed orders the grid and trial n takes its point n: with seed
    # 15, trials 0 and 1 are the long ones (600, 0.05), 2 and 7 short (10, 0.05), 3 to 6
    # pruned. Each worker a node of its own (2 CPUs): a node down takes one worker.
    sweep = tmp_path / "study"
    done = hpc_ddp("submit", ["-m", "hydra/sweeper=optuna", "trainer.max_steps=choice(10, 600)",
                              "optim.lr=choice(0.05, 1000.0)", "trainer.seed=choice(0, 1)",
                              "hydra.sweeper.sampler=grid", "hydra.sweeper.sampler.seed=15",
                              "hydra.sweeper.n_trials=8", "hydra.sweeper.n_jobs=3",
                              "hydra.sweeper.pruner=threshold", "hydra.sweeper.pruner.upper=50",
                              "trainer.eval_interval=10", "cluster.cpus_per_task=2", *SMALL,
                              f"sweep.dir={sweep}"],
                   env=slurm_env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "workers: job array" in done.stdout  # it returned once the array was queued
    for long in (0, 1):
        wait_for_step(sweep / f"trial-{long}", 20, timeout=300)
    holder = {json.loads(p.read_text()).get("trial"): json.loads(p.read_text())["job"]
              for p in (sweep / "workers").glob("*.json")}
    downed, cancelled = holder[0], holder[1]
    node = subprocess.run(["squeue", "-h", "-j", downed, "-o", "%N"], env=slurm_env,
                          capture_output=True, text=True, check=True).stdout.strip()
    # Trial 1's worker is cancelled for good: its trial checkpoints and stays RUNNING, and a
    # worker that is free takes it over from that checkpoint (sweep/orphans.py).
    subprocess.run(["scancel", cancelled], env=slurm_env, check=True)
    # Trial 0's worker's node goes down: Slurm requeues the worker, which resumes trial 0.
    try:
        take_down(node, slurm_env)
        _release_when_pending(downed, slurm_env, back=node)
    finally:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"],
                       env=slurm_env, check=False)
    wait_for_workers(sweep, slurm_env)
    out = worker_output(sweep)
    for worker in workers_of(sweep):
        if worker != cancelled:  # each other worker's job: COMPLETED 0:0
            assert_completed(worker, slurm_env, out)
    trials = study_of(sweep).trials
    assert [(t.params["trainer.max_steps"], t.params["optim.lr"], t.state.name)
            for t in trials] == [
        (600, 0.05, "COMPLETE"), (600, 0.05, "COMPLETE"), (10, 0.05, "COMPLETE"),
        *[(s, 1000.0, "PRUNED") for s in (600, 600, 10, 10)], (10, 0.05, "COMPLETE")], out
    for number in (0, 1):  # each resumed from its checkpoint, not run again
        summary = json.loads((sweep / f"trial-{number}" / "summary.json").read_text())
        assert summary["global_step"] == 600 and summary["resumed_from_step"] >= 20, summary
    assert f"trial 1: its worker ({cancelled}) is gone; resumed here" in out, out
    jobs = {t.number: str(json.loads((sweep / f"trial-{t.number}" / "job.json").read_text())[
        "job_id"]).split(".")[0] for t in trials}
    assert set(jobs.values()) <= _worker_jobs(sweep, slurm_env)  # steps of the workers' jobs
    assert jobs[1] != _raw_id(cancelled, slurm_env), jobs  # finished by another worker
    # No batches: in batches of three, trial 3 would wait for all of trials 0 to 2; here it
    # starts while a long one still trains (not always both: on a loaded machine CI saw
    # trial 3's start, a step's start, take until 44 ms after the first long one ended).
    # (Trials 4 and 5 wait, rightly: the worker that pruned trial 3 takes over trial 1
    # first, and two workers are left.)
    last_long_end = max(trials[0].datetime_complete, trials[1].datetime_complete)
    assert trials[2].datetime_complete <= trials[3].datetime_start < last_long_end, out
    # A pruned trial's node takes the next trial at once (it is not left idle): the next
    # run its worker started (a new trial, or one taken over), from the trials' job.json.
    started = [(str(a["job_id"]).split(".")[0], a["submitted"]) for t in trials
               for a in json.loads((sweep / f"trial-{t.number}" / "job.json").read_text())[
                   "history"]]
    for pruned in trials[3:7]:
        end = pruned.datetime_complete.timestamp()
        after = [at for job, at in started if job == jobs[pruned.number] and at >= end]
        if after:
            assert min(after) - end < 10, (pruned.number, min(after) - end, started)
    status = hpc_ddp("status", [str(sweep)], env=slurm_env)
    assert status.returncode == 0, status.stderr
    assert "8 of 8 trials drawn, 4 complete, 4 pruned, 0 failed, 0 running" in status.stdout


def _raw_id(array_task: str, env: dict[str, str]) -> str:
    """An array task's own job id (``<array>_<task>`` -> JobIDRaw), from sacct."""
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", array_task, "-o", "JobIDRaw"],
                         env=env, capture_output=True, text=True, check=True).stdout
    return out.split()[0].strip()


def _worker_jobs(folder: Path, env: dict[str, str]) -> set[str]:
    """The workers' own job ids (an array task's SLURM_JOB_ID), from sacct."""
    array = workers_of(folder)[0].split("_")[0]
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", array, "-o", "JobIDRaw"], env=env,
                         capture_output=True, text=True, check=True).stdout
    return {line.strip() for line in out.splitlines() if line.strip()}


def test_a_requeued_worker_resumes_its_2_node_trial_and_a_second_submit_continues_the_study(
        hpc_ddp: Run, slurm_env: dict[str, str], tmp_path: Path) -> None:
    from tests.cluster.test_fault_tolerance import progress_step

    # Each trial a 2-node DDP run (the worker's allocation is two nodes; rank 0 alone talks
    # to the study, every rank trains the config the worker composed once).
    sweep = tmp_path / "study"
    args = ["-m", "hydra/sweeper=optuna", "optim.lr=choice(0.05)", "hydra.sweeper.n_jobs=1",
            "trainer.max_steps=400", "trainer.eval_interval=0", "nodes=2",
            *[a for a in SMALL if a != "nodes=1"], f"sweep.dir={sweep}"]
    done = hpc_ddp("submit", [*args, "hydra.sweeper.n_trials=1"], env=slurm_env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    worker = workers_of(sweep)[0]
    run_dir = sweep / "trial-0"
    deadline = time.monotonic() + 300
    while progress_step(run_dir) < 40:
        assert time.monotonic() < deadline, worker_output(sweep)
        time.sleep(0.5)
    # Requeue the worker mid-trial (as a preemption would): its ranks checkpoint on the
    # SIGTERM; the worker starts again and resumes trial 0, not a new one.
    subprocess.run(["scontrol", "requeue", worker], env=slurm_env, check=True)
    _release_when_pending(worker, slurm_env)
    wait_for_workers(sweep, slurm_env)
    assert_completed(worker, slurm_env, worker_output(sweep))  # its last start: COMPLETED 0:0
    trials = study_of(sweep).trials
    assert [t.state.name for t in trials] == ["COMPLETE"], worker_output(sweep)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 400 and summary["resumed_from_step"] >= 40, summary
    assert summary["num_nodes"] == 2 and summary["world_size"] == 2, summary
    # The same command, more trials: the study goes on to them.
    again = hpc_ddp("submit", [*args, "hydra.sweeper.n_trials=2"], env=slurm_env, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    wait_for_workers(sweep, slurm_env)
    for second in workers_of(sweep):
        assert_completed(second, slurm_env, worker_output(sweep))
    assert [t.state.name for t in study_of(sweep).trials] == ["COMPLETE"] * 2


def _release_when_pending(job: str, env: dict[str, str], timeout: float = 120,
                          back: str | None = None) -> None:
    """A requeued job waits ~2 min for its begin time: release it once it is pending (as
    tests/cluster/test_fault_tolerance.py does, 2 s later: the old credential's second) and,
    after its node went down (``back``), with that node back in service past KillWait (5 s):
    a job started on it while its slurmd still holds the killed one is refused there
    ("Duplicate jobid") and held."""
    deadline = time.monotonic() + timeout
    while True:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env,
                               capture_output=True, text=True, check=False).stdout.strip()
        if state == "PENDING" and back is not None:
            subprocess.run(["scontrol", "update", f"nodename={back}", "state=resume"], env=env,
                           check=False)
            time.sleep(8)
        if state == "PENDING":
            time.sleep(2)
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env,
                           check=False)
            return
        assert time.monotonic() < deadline, f"job {job} never went back to pending"
        time.sleep(0.5)




def test_a_study_in_the_clusters_mariadb(hpc_ddp: Run, slurm_env: dict[str, str],
                                         tmp_path: Path) -> None:
    # Optuna's RDB storage against a real server: the test cluster's MariaDB (accounting's),
    # its password in an option file named by the URL, not in the URL or in study.json.
    db, user, password = "hpc_ddp_optuna_test", "hpc_ddp_optuna", "s3cret-pw"
    subprocess.run(["mariadb", "-e", f"DROP DATABASE IF EXISTS {db}; CREATE DATABASE {db}; "
                    f"CREATE USER IF NOT EXISTS '{user}'@'localhost' IDENTIFIED BY "
                    f"'{password}'; GRANT ALL ON {db}.* TO '{user}'@'localhost';"],
                   check=True, timeout=60)
    option_file = tmp_path / "my.cnf"
    option_file.write_text(f"[client]\npassword={password}\n")
    option_file.chmod(0o600)
    url = (f"mysql+pymysql://{user}@localhost/{db}?unix_socket=/run/mysqld/mysqld.sock"
           f"&read_default_file={option_file}")
    sweep = tmp_path / "study"
    done = hpc_ddp("submit", ["-m", "hydra/sweeper=optuna", "optim.lr=choice(0.05, 0.01)",
                              "hydra.sweeper.sampler=grid", "hydra.sweeper.n_trials=2",
                              "hydra.sweeper.n_jobs=2", f"hydra.sweeper.storage='{url}'",
                              "cluster=local", "trainer.max_steps=10", "data.train_size=512",
                              "data.eval_size=128", f"sweep.dir={sweep}"], env=slurm_env,
                   timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    study = optuna.load_study(study_name="study", storage=url)
    assert sorted(t.params["optim.lr"] for t in study.trials) == [0.01, 0.05]
    assert all(t.state.name == "COMPLETE" for t in study.trials)
    assert password not in (sweep / "study.json").read_text()
