"""A job that can never start, on the real cluster (issue 21): refused before sbatch where one
sinfo tells (exit 2, one line, nothing written, nothing submitted); otherwise submitted and
shown with Slurm's reason and the fix in status, Run.wait and wait=true; sbatch's own
refusals name the key; states compare as one word (CANCELLED, not "CANCELLED by 0").
Every job submitted here never runs and is cancelled by id."""

from __future__ import annotations

import io
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from hpc_ddp.api import Run, RunFailed
from hpc_ddp.slurm import fit as slurm_fit
from hpc_ddp.submit import main as submit_main
from hpc_ddp.watch.status import main as status

pytestmark = pytest.mark.cluster
NAME = "hpc_ddp_i21_never"


def queued(env: dict[str, str]) -> list[str]:
    """Ids of this file's jobs that Slurm holds."""
    done = subprocess.run(["squeue", "-h", "-n", NAME, "-o", "%i"], env=env,
                          capture_output=True, text=True, check=True)
    return done.stdout.split()


def cancel(job_ids: list[str], env: dict[str, str]) -> None:
    if job_ids:
        subprocess.run(["scancel", *job_ids], env=env, check=False)


def submitted(run_dir: Path) -> str:
    return str(json.loads((run_dir / "job.json").read_text())["job_id"])


@pytest.mark.parametrize("override, said", [
    ("nodes=8", "nodes=8: can never start: partition normal has 4 nodes, the job asks for 8; "
                "no other partition here can run it either. Fix: nodes=4"),
    ("cluster.cpus_per_task=4", "cluster.cpus_per_task=4: can never start: no node of "
                                "partition normal has 4 CPUs per node (the most is 2)"),
    ("cluster.gpus_per_node=4", "cluster.gpus_per_node=4: can never start: no node of "
                                "partition normal has 4 GPUs (the most is 2)"),
    ("cluster.mem_gb=8", "cluster.mem_gb=8.0: can never start: no node of partition normal "
                         "has 8192 MB of memory (the most is 3000 MB)"),
    ("cluster.partition=urgent nodes=5", "nodes=5: can never start: partition urgent has 4 "
                                         "nodes, the job asks for 5. Fix: nodes=4"),
    ("cluster.partition=gpu", "cluster.partition=gpu: no such partition on this cluster "
                              "(sinfo lists normal, urgent)"),
])
def test_what_can_never_start_is_refused_before_sbatch(
        slurm_env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        override: str, said: str) -> None:
    run_dir = tmp_path / "run"
    code = submit_main(["cluster=slurm", *override.split(), f"run_dir={run_dir}",
                        f"cluster.job_name={NAME}"], out=io.StringIO())
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {said}"), err
    assert len(err.strip().splitlines()) == 1
    assert not run_dir.exists()
    assert queued(slurm_env) == []


def test_a_sweep_with_one_impossible_point_sends_none(
        slurm_env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "sweep"
    code = submit_main(["-m", "cluster=slurm", "nodes=2,8", f"sweep.dir={folder}",
                        f"cluster.job_name={NAME}"], out=io.StringIO())
    err = capsys.readouterr().err
    assert code == 2 and "(sweep point 1: nodes=8) can never start: partition normal has 4 " \
        "nodes" in err, err
    assert not folder.exists() and queued(slurm_env) == []


@pytest.mark.parametrize("override, said", [
    ("cluster.constraint=a100", "cluster.constraint=a100: sbatch refused the job: Batch job "
                                "submission failed: Invalid feature specification."),
    ("cluster.nodelist=node9", "cluster.nodelist=node9: sbatch refused the job: Batch job "
                               "submission failed: Invalid node name specified."),
    # What sinfo would have told, where it cannot (a site whose sinfo fails): sbatch's words.
    ("cluster.partition=gpu", "cluster.partition=gpu: sbatch refused the job: invalid "
                              "partition specified: gpu; Batch job submission failed: Invalid "
                              "partition name specified."),
    ("cluster.cpus_per_task=4", "cluster.cpus_per_task=4: sbatch refused the job: CPU count "
                                "per node can not be satisfied; Batch job submission failed: "
                                "Requested node configuration is not available."),
])
def test_sbatchs_refusals_name_the_key(slurm_env: dict[str, str], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch, override: str,
                                       said: str) -> None:
    monkeypatch.setattr(slurm_fit, "partitions", lambda environ: None)
    run_dir = tmp_path / "run"
    code = submit_main(["cluster=slurm", override, f"run_dir={run_dir}",
                        f"cluster.job_name={NAME}"], out=io.StringIO())
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {said}"), err
    assert len(err.strip().splitlines()) == 1 and not run_dir.exists()


def test_a_job_that_can_never_start_is_said_so_with_the_fix(
        slurm_env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two jobs Slurm accepts and never starts: one whose dependency failed (the check
    before sbatch passes it: nothing there says so), one asking 8 of 4 nodes, sent as if
    sinfo could not tell (the check then lets it through; status asks sinfo itself)."""
    failed = subprocess.run(["sbatch", "--parsable", f"--job-name={NAME}", "-o", "/dev/null",
                             "--wrap", "exit 1"], env=slurm_env, capture_output=True,
                            text=True, check=True).stdout.strip()
    jobs = [failed]
    try:
        deadline = time.monotonic() + 60
        while Run(tmp_path, {"kind": "slurm", "job_id": failed}).state != "FAILED":
            assert time.monotonic() < deadline, "the job to depend on did not fail"
            time.sleep(0.5)
        depends = tmp_path / "depends"
        out = io.StringIO()
        code = submit_main(["cluster=slurm", f"run_dir={depends}", f"cluster.job_name={NAME}",
                            f"+cluster.sbatch_extra.dependency=afterok:{failed}", "wait=true"],
                           out=out)
        jobs.append(submitted(depends))
        text = out.getvalue()
        assert code == 1, text
        assert (f"job {jobs[-1]} can never start (DependencyNeverSatisfied): a job it depends "
                f"on (cluster.sbatch_extra.dependency=afterok:{failed}) failed or was "
                "cancelled: cancel this one") in text
        assert "It stays queued until cancelled: python -m hpc_ddp.status" in text

        with monkeypatch.context() as patched:
            patched.setattr(slurm_fit, "partitions", lambda environ: None)
            big = tmp_path / "big"
            assert submit_main(["cluster=slurm", "nodes=8", f"run_dir={big}",
                                f"cluster.job_name={NAME}"], out=io.StringIO()) == 0
        jobs.append(submitted(big))
        run = Run.from_dir(big)
        # Slurm 22.05 gives this job PartitionConfig or PartitionNodeLimit (both seen, even
        # one after the other); the words and the fix are the same.
        assert run.job_state().reason in ("PartitionConfig", "PartitionNodeLimit")
        assert run.state == "PENDING"
        fix = re.compile(rf"job {jobs[-1]} can never start \((PartitionConfig|PartitionNodeLimit)"
                         r"\): partition normal has 4 nodes, the job asks for 8: nodes=4")
        out = io.StringIO()
        assert status([str(big)], out=out) == 0
        assert re.search(r"PENDING \((PartitionConfig|PartitionNodeLimit)\)", out.getvalue())
        assert fix.search(out.getvalue()), out.getvalue()
        with pytest.raises(RunFailed) as info:
            run.wait(progress=False)
        assert fix.fullmatch(str(info.value)), str(info.value)

        out = io.StringIO()
        assert status([str(big), "--cancel"], out=out) == 0
        said = out.getvalue()
        assert "before it ever started: nothing trained, nothing to resume" in said, said
        assert "first: nodes=4" in said
        deadline = time.monotonic() + 30
        while run.state != "CANCELLED":
            assert time.monotonic() < deadline, run.job_state()
            time.sleep(0.5)
        # One word to compare; Slurm's own text kept beside it.
        assert run.job_state().raw == "CANCELLED by 0"
    finally:
        cancel(jobs, slurm_env)
    capsys.readouterr()
