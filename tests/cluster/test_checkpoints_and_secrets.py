"""On the real cluster's nodes: checkpoint writers SIGKILLed at random moments leave a usable
latest (52 kills, one srun step per node), and a Slurm submission carries secrets to the job
without any file of the run dir (submitit's folder included), any printed line or the batch
script Slurm keeps holding them."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cluster.slurm_final import assert_completed
from tests.cluster.test_slurm_submit import job_id_of
from tests.conftest import REPO
from tests.integration.test_secrets import PLANTED, files_holding

pytestmark = pytest.mark.cluster
Run = Callable[..., subprocess.CompletedProcess[str]]
NODES, KILLS_PER_NODE = 4, 13


def test_sigkill_during_background_checkpoints_on_every_node(slurm_env: dict[str, str],
                                                             tmp_path: Path) -> None:
    # One task per node imports torch once and forks a writer child per kill
    # (tests/checkpoint_kills.py): 52 kills for the price of four interpreter starts.
    kills = (f"echo job=$SLURM_JOB_ID; {sys.executable} -m tests.checkpoint_kills "
             f"{tmp_path}/$SLURMD_NODENAME {KILLS_PER_NODE} $SLURM_PROCID")
    done = subprocess.run(["srun", f"--nodes={NODES}", "--ntasks-per-node=1", "--time=5",
                           "--job-name=hpc_ddp_ckpt_kills", "bash", "-c", kills], cwd=REPO,
                          env=slurm_env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    # srun's own job: the writers' kills are their children's, the tasks end COMPLETED 0:0.
    assert_completed(done.stdout.split("job=", 1)[1].split()[0], slurm_env)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len({r["host"] for r in results}) == NODES
    assert sum(r["kills"] for r in results) >= 50
    assert [p for r in results for p in r["problems"]] == []
    for r in results:  # every node's run went on across its kills, never backwards
        steps = [s for s in r["steps"] if s is not None]
        assert steps and steps == sorted(steps), r


def sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def test_secrets_reach_a_slurm_job_and_nothing_written_holds_them(
        hpc_ddp: Run, slurm_env: dict[str, str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", [
        "cluster=slurm", "nodes=1", "entry=tests.usercode.entries:secrets_seen", "wait=true",
        f"cluster.setup=['export WANDB_API_KEY={PLANTED['WANDB_API_KEY']}']",
        f"+nccl.extra_env.HF_TOKEN={PLANTED['HF_TOKEN']}", f"run_dir={run_dir}"],
        env={**slurm_env, "MY_SERVICE_PASSWORD": PLANTED["MY_SERVICE_PASSWORD"]})
    assert done.returncode == 0, done.stdout + done.stderr
    job = job_id_of(done.stdout)
    assert_completed(job, slurm_env, done.stdout)
    summary = json.loads((run_dir / "summary.json").read_text())
    # The setup line ran on the node with the value sbatch exported; the rank read the rest.
    assert summary["sha256"] == {k: sha(v) for k, v in PLANTED.items()}
    planted = list(PLANTED.values())
    assert files_holding(run_dir, planted) == []  # config, overrides, job.json, submitit/
    assert not [v for v in planted if v in done.stdout + done.stderr]
    scripts = list((run_dir / "submitit").rglob("*.sh"))
    assert scripts and all("export WANDB_API_KEY=${WANDB_API_KEY}" in s.read_text()
                           for s in scripts)
    # What Slurm keeps of the job for its owner: the batch script, which holds the reference.
    kept = subprocess.run(["scontrol", "write", "batch_script", job, "-"],
                          env=slurm_env, capture_output=True, text=True, check=False)
    assert kept.returncode == 0 and "${WANDB_API_KEY}" in kept.stdout, kept.stderr
    assert not [v for v in planted if v in kept.stdout]
