"""Slurm's requeue signal at any moment of a task's start (rank/services/early_signals.py): a
1-minute limit's warning, or one that comes while a site's setup is slow, may reach the step
while its interpreter starts, while it waits for its node's warm process to import torch,
or while its supervisor joins. Each of them is a checkpoint and a requeue, for the built-in
trainer with and without a supervisor and for a torchrun-style script. Before, the task died
from the signal (the job ended FAILED) or the signal was lost (it ran into its limit).

The signal is sent by hand (``scancel --signal``, as slurmctld does it, to every process of
the step) at the moment each case is about: as soon as the task's process runs its first line
(the unsupervised task then waits for its warm process), or as soon as the rank's supervisor
logged its start (it then joins, its training process not started yet).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hpc_ddp.rank.supervise import handover
from tests.cluster.test_slurm_submit import job_id_of

pytestmark = pytest.mark.cluster
Run = Callable[..., subprocess.CompletedProcess[str]]

LONG = ["cluster=slurm", "nodes=1", "data.train_size=1024", "data.eval_size=128",
        "trainer.max_steps=100000", "trainer.checkpoint_interval=20", "trainer.log_interval=20",
        "trainer.eval_interval=0", "trainer.stop_check_interval=2", "cluster.time_min=10"]
SCRIPT = "examples/seqproject/train_ddp.py"


def task_holding(run_dir: Path) -> bool:
    """A process of the run's task (its command line names the run's folder) holds the stop
    signals: its first line ran (the moments before, its interpreter's start, are a few
    hundredths of a second no Python code can cover)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"hpc_ddp.rank.main.submitted" in w for w in words) and any(
                str(run_dir).encode() in w for w in words):
            held = handover.caught(int(cmdline.parent.name)) or set()
            if signal.SIGUSR2 in held:
                return True
    return False


def supervisor_started(run_dir: Path) -> bool:
    """The rank's supervisor logged its attempt (it joins next)."""
    log = run_dir / "logs" / "rank0.log"
    return log.exists() and "ATTEMPT" in log.read_text(errors="replace")


def squeue_state(job: str, env: dict[str, str]) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True,
                          text=True, check=False).stdout.strip()


def event_kinds(run_dir: Path) -> list[str]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line).get("kind", "") for line in path.read_text().splitlines()
            if line.strip()]


def test_a_requeue_signal_while_tasks_start_is_a_checkpoint_and_a_requeue(
        hpc_ddp: Run, slurm_env: dict[str, str], tmp_path: Path) -> None:
    cases: dict[str, tuple[list[str], Callable[[Path], bool]]] = {
        "unsupervised trainer, its task waiting for the warm process":
            (["cluster.supervise=false"], task_holding),
        "supervised trainer, its supervisor joining": ([], supervisor_started),
        "script, its supervisor joining":
            ([f"script={SCRIPT}", "--", "--epochs", "500", "--checkpoint",
              str(tmp_path / "script.pt")], supervisor_started),
    }
    jobs: dict[str, tuple[str, Path]] = {}
    for n, (name, (extra, _)) in enumerate(cases.items()):
        run_dir = tmp_path / f"run{n}"
        overrides = extra[:extra.index("--")] if "--" in extra else extra
        after = extra[extra.index("--"):] if "--" in extra else []
        done = hpc_ddp("submit", [*LONG, f"run_dir={run_dir}", *overrides, *after],
                       env=slurm_env)
        assert done.returncode == 0, done.stdout + done.stderr
        jobs[name] = (job_id_of(done.stdout), run_dir)
    try:
        waiting = dict(jobs)
        deadline = time.monotonic() + 180
        while waiting:
            assert time.monotonic() < deadline, f"never started: {sorted(waiting)}"
            for name, (job, run_dir) in list(waiting.items()):
                if cases[name][1](run_dir):
                    sent = subprocess.run(["scancel", "-s", "USR2", f"{job}.0"], env=slurm_env,
                                          capture_output=True, text=True, check=False)
                    assert sent.returncode == 0, (name, sent.stderr)
                    del waiting[name]
            time.sleep(0.05)
        deadline = time.monotonic() + 180
        for name, (job, run_dir) in jobs.items():
            # Requeued: pending again (its begin time ~2 minutes ahead), the stop recorded.
            while not ("requeue" in event_kinds(run_dir) and squeue_state(job, slurm_env)
                       == "PENDING"):
                state = squeue_state(job, slurm_env)
                log = run_dir / "logs" / "rank0.log"
                said = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
                assert state in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"), (
                    f"{name}: job {job} ended {state or 'out of the queue'} instead of a "
                    f"requeue; its log ends:\n{said}")
                assert time.monotonic() < deadline, f"{name}: not requeued; log:\n{said}"
                time.sleep(0.5)
            assert "stop" in event_kinds(run_dir), name
    finally:
        subprocess.run(["scancel", *[job for job, _ in jobs.values()]], env=slurm_env,
                       check=False)
