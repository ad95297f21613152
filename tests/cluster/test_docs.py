"""The docs' `cluster` blocks, run against the test cluster as a reader would run them on a
login node (tests/docblocks.py): each page's blocks in page order, in one folder that looks
like a clone of this repository, with SLURM_CONF set, so cluster=auto finds the cluster."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from hpc_ddp.testcluster.cluster import TestCluster
from tests import docblocks
from tests.cluster.slurm_final import assert_completed

PAGES = docblocks.runnable("cluster")
JOB_END_TIMEOUT_S = 300
pytestmark = pytest.mark.cluster


def jobs_run_from(folder: Path, since: str, env: dict[str, str],
                  timeout_s: float = 30) -> list[str]:
    """Ids of the Slurm jobs (array tasks one by one) that started from ``folder`` or below it
    since ``since``: what a page's blocks ran, whichever way (submit, sbatch, srun, salloc).
    slurmctld hands job records to slurmdbd asynchronously (seconds on a busy machine), so
    sacct is read until it lists some and two reads a second apart agree."""
    deadline = time.monotonic() + timeout_s
    last: list[str] | None = None
    while True:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-S", since, "-o", "JobID,WorkDir"],
                             env=env, capture_output=True, text=True, timeout=30,
                             check=True).stdout
        rows = [line.split("|", 1) for line in out.splitlines() if "|" in line]
        jobs = [job for job, workdir in rows
                if Path(workdir) == folder or folder in Path(workdir).parents]
        if (jobs and jobs == last) or time.monotonic() > deadline:
            return jobs
        last = jobs
        time.sleep(1.0)


@pytest.mark.parametrize("page, blocks", PAGES, ids=[page for page, _ in PAGES])
def test_cluster_blocks_do_what_the_page_shows(page: str, blocks: list[docblocks.Block],
                                               slurm_cluster: TestCluster,
                                               tmp_path: Path) -> None:
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 1))
    folder = docblocks.checkout(tmp_path / "checkout")
    env = docblocks.environment(folder, slurm_cluster.env())
    problems: list[str] = []
    for block in blocks:
        problems += docblocks.check_block(block, folder, env)
        if problems:
            break
    assert not problems, "\n\n".join(problems)
    # What the page shows succeeding succeeded for Slurm too: every job it ran, COMPLETED 0:0.
    jobs = jobs_run_from(folder.resolve(), since, env)
    assert jobs, f"no Slurm job ran from {folder}"
    # Excused: a job that never started and was cancelled, as many as the page's own
    # scancel commands (it shows a job that cannot start, then cancels it); any other
    # cancelled job is a failure of what the page shows.
    cancels = sum(line.lstrip("$ ").startswith("scancel ")
                  for block in blocks for line in block.text.splitlines())
    excused = 0
    # A page's `submit` returns once its job is queued (your-code.md queues three 4-node
    # jobs of 30-60 s each, one after another): each is waited for until it ends.
    for job in jobs:
        if excused < cancels and never_started_and_cancelled(job, env):
            excused += 1
            continue
        assert_completed(job, env, timeout_s=JOB_END_TIMEOUT_S)


def never_started_and_cancelled(job: str, env: dict[str, str]) -> bool:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State,NodeList"],
                         env=env, capture_output=True, text=True, timeout=30, check=True).stdout
    state, _, nodes = (out.splitlines() or [""])[0].partition("|")
    return state.startswith("CANCELLED") and nodes.strip() == "None assigned"
