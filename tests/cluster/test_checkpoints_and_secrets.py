"""On the real cluster's nodes: checkpoint writers SIGKILLed at random moments leave a usable
latest (52 kills, one srun step per node); a Slurm submission carries secrets given through
every channel to the job without any file of the run dir (submitit's folder included), any
printed line, any command line on the node or the batch script Slurm keeps holding them; and
the job's pickle, swapped for a link to a payload while the job was held, is refused on every
node with the payload never run."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.checkpoint_kills import resumed_each_time
from tests.cluster.slurm_final import assert_completed, assert_ended
from tests.cluster.test_slurm_submit import job_id_of
from tests.conftest import REPO
from tests.integration.test_secrets import PLANTED, channels, files_holding, sha, submit

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
        assert resumed_each_time(r), r
        steps = [s for s in r["steps"] if s is not None]
        assert steps and steps == sorted(steps), r


def test_secrets_reach_a_slurm_job_and_nothing_written_holds_them(
        slurm_env: dict[str, str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = submit(channels(["nodes=1", "entry=tests.usercode.entries:secrets_reached",
                            "wait=true", f"run_dir={run_dir}",
                            f"app.api_token={PLANTED['app.api_token#0']}"], "slurm"),
                  tmp_path, {**slurm_env, "MY_SERVICE_PASSWORD": PLANTED["MY_SERVICE_PASSWORD"]})
    assert done.returncode == 0, done.stdout + done.stderr
    job = job_id_of(done.stdout)
    assert_completed(job, slurm_env, done.stdout)
    result = json.loads((run_dir / "summary.json").read_text())["result"]
    # The setup lines ran on the node with the values sbatch exported; the rank, the model's
    # factory and ctx.app read the rest; no command line on the node held any of them.
    assert result["sha256"] == {
        **{k: sha(PLANTED[k]) for k in ("WANDB_API_KEY", "HF_TOKEN", "MY_SERVICE_PASSWORD",
                                        "DB_PASSWORD", "model.api_token")},
        "app.api_token": sha(PLANTED["app.api_token#0"])}
    assert result["argv_holding"] == []
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


class Payload:
    """A pickle that runs ``touch marker`` when loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_job_pickle_swapped_for_a_link_to_a_payload_is_refused_on_every_node(
        hpc_ddp: Run, slurm_env: dict[str, str], tmp_path: Path) -> None:
    # Submitted held; then the pickle every task of the job unpickles is swapped for a link
    # to a payload (what a member of the group could do in a group-writable run dir).
    run_dir, marker = tmp_path / "run", tmp_path / "payload-ran"
    done = hpc_ddp("submit", ["cluster=slurm", "nodes=2", "entry=tests.usercode.entries:report",
                              "+cluster.sbatch_extra.hold=true", f"run_dir={run_dir}"],
                   env=slurm_env)
    assert done.returncode == 0, done.stdout + done.stderr
    job = job_id_of(done.stdout)
    pickled = run_dir / "submitit" / job / f"{job}_submitted.pkl"
    elsewhere = tmp_path / "payload.pkl"
    elsewhere.write_bytes(pickle.dumps(Payload(marker)))
    pickled.unlink()
    pickled.symlink_to(elsewhere)
    released = subprocess.run(["scontrol", "release", job], env=slurm_env, capture_output=True,
                              text=True, check=False)
    assert released.returncode == 0, released.stderr
    assert_ended(job, slurm_env, "FAILED", done.stdout)
    errors = "".join(p.read_text() for p in (run_dir / "submitit" / job).glob("*_log.err"))
    assert f"error: {pickled} is a symbolic link: hpc_ddp follows none inside a run dir" in errors
    assert not marker.exists() and not (run_dir / "summary.json").exists()
