"""What a user sees of a run on the real 4-node cluster (docs/observability.md): every rank's
output in one time-ordered view through a requeue, followed live; a failure of every rank
said once; what the run cost, as sacct counts it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hpc_ddp import events, ranklines
from hpc_ddp.hostlist import collect
from hpc_ddp.testcluster.cluster import TestCluster
from tests.cluster.slurm_final import assert_ended
from tests.cluster.test_fault_tolerance import (
    assert_completed_at_last,
    finish_releasing_requeues,
)
from tests.cluster.test_slurm_submit import job_id_of
from tests.cluster.test_your_code import requeue_signal
from tests.conftest import REPO, command_env
from tests.wandb_records import history as wandb_history

pytestmark = pytest.mark.cluster
Run = Callable[..., subprocess.CompletedProcess[str]]

# A torchrun-style script that prints a line on every rank each step, and on SIGUSR2 (the
# requeue signal) saves its step and exits 75 (hpc_ddp requeues it), resuming from there.
# Rank 0 logs each step to the W&B and MLflow runs hpc_ddp names in its environment.
SCRIPT = '''\
import os, signal, sys, time
import torch, torch.distributed as dist
stop = False
tracked = os.environ.get("RANK") == "0" and "WANDB_RUN_ID" in os.environ
if tracked:
    import mlflow, wandb
    wandb_run = wandb.init(settings=wandb.Settings(console="off", silent=True))
    mlflow.start_run()  # MLFLOW_RUN_ID, MLFLOW_TRACKING_URI from the environment
def on_signal(*_):
    global stop
    stop = True
signal.signal(signal.SIGUSR2, on_signal)
dist.init_process_group("gloo")
rank = dist.get_rank()
state, steps = sys.argv[1], int(sys.argv[2])
start = int(open(state).read()) if os.path.exists(state) else 0
if start:
    print(f"resumed at step {start} on rank {rank}", flush=True)
for step in range(start, steps):
    time.sleep(0.2)
    flag = torch.tensor([float(stop)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    print(f"step {step} on rank {rank}", flush=True)
    if tracked:
        wandb_run.log({"value": step}, step=step)
        mlflow.log_metric("value", step, step=step)
    if rank == 0:
        with open(state + ".tmp", "w") as f:
            f.write(str(step + 1))
        os.replace(state + ".tmp", state)
    if flag.item():
        if tracked:
            wandb_run.finish(exit_code=1)
        dist.destroy_process_group()
        raise SystemExit(75)
if tracked:
    wandb_run.finish()
print(f"warning: rank {rank} is done", file=sys.stderr, flush=True)
dist.destroy_process_group()
'''


class Follower:
    """``python -m hpc_ddp.logs RUN --follow`` in the background: each line with when it came."""

    def __init__(self, run_dir: Path, env: dict[str, str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp.logs", str(run_dir),
                                      "--follow"], cwd=REPO, env=command_env(env),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for text in self.proc.stdout:
            self.lines.append((time.time(), text.rstrip("\n")))

    def delays(self) -> list[float]:
        """Seconds from a step line's time (as the rank wrote it) to its arrival here."""
        import datetime as dt

        found = []
        for came, text in self.lines:
            if " OUT step " in text:
                written = dt.datetime.combine(dt.date.today(), dt.time.fromisoformat(
                    text.split(" ", 1)[0])).timestamp()
                found.append(came - written)
        return found


def _sacct_starts(job: str, env: dict[str, str]) -> list[dict[str, str]]:
    """Every start of ``job`` as plain sacct reports it (not through hpc_ddp's parser)."""
    fields = ["Submit", "Start", "End", "ElapsedRaw", "AllocCPUS"]
    out = subprocess.run(["sacct", "-X", "-D", "-n", "-P", "-j", job, "-o", ",".join(fields)],
                         env=env, capture_output=True, text=True, check=True).stdout
    return [dict(zip(fields, line.split("|"), strict=True)) for line in out.splitlines() if line]


def test_every_rank_through_a_requeue_followed_live_and_its_cost(
        hpc_ddp: Run, node_names: list[str], slurm_env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "steps.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", ["cluster=slurm", "nodes=4", f"script={script}",
                              f"run_dir={run_dir}", "logger=[wandb,mlflow]",
                              "tracker.offline=true", "--", str(tmp_path / "state"), "60"],
                   env=slurm_env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    job = job_id_of(done.stdout)
    follower = Follower(run_dir, slurm_env)
    rank0 = run_dir / "logs" / "rank0.log"
    assert f"rank-0 log:  {rank0}" in done.stdout
    deadline = time.monotonic() + 240
    while "step 10 on rank 0" not in (rank0.read_text() if rank0.exists() else ""):
        assert time.monotonic() < deadline, "never reached step 10"
        time.sleep(0.3)
    requeue_signal(job, slurm_env)
    assert finish_releasing_requeues(job, run_dir, slurm_env) >= 1
    assert_completed_at_last(job, slurm_env)
    ended = time.time()
    follower.proc.wait(timeout=60)  # --follow ends by itself once the job has ended
    follower.thread.join(timeout=10)

    # The printed rank-0 log holds the program's own output (the script's print).
    assert "OUT step 0 on rank 0" in rank0.read_text()
    # One view of all ranks, in time order, both attempts marked.
    shown = hpc_ddp("logs", [str(run_dir)], env=slurm_env)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    markers = [ln for ln in lines if ln.startswith("--- attempt:")]
    assert [m.split(", ")[1] for m in markers] == ["restart 0", "restart 1"], markers
    for rank in range(4):
        node = node_names[rank]
        assert f"[rank {rank} {node}] OUT step 59 on rank {rank}" in shown.stdout
        assert f"[rank {rank} {node}] OUT resumed at step" in shown.stdout
        assert f"[rank {rank} {node}] ERR warning: rank {rank} is done" in shown.stdout
    stamps = [ln.split(" ", 1)[0] for ln in lines if not ln.startswith("---")]
    assert stamps == sorted(stamps)
    after = lines.index(markers[1])
    assert any("resumed at step" in ln for ln in lines[after:]) and not any(
        "resumed at step" in ln for ln in lines[:after])
    # One rank alone, and a search.
    one = hpc_ddp("logs", [str(run_dir), "--rank", "2", "--grep", "step 5[0-9] on"],
                  env=slurm_env).stdout.splitlines()
    assert [ln.split("] ", 1)[1] for ln in one if not ln.startswith("---")] == [
        f"OUT step {s} on rank 2" for s in range(50, 60)]
    # --follow printed the steps while the job ran.
    live = [came for came, text in follower.lines if " OUT step " in text and came < ended]
    assert live, follower.lines[-20:]
    delays = sorted(follower.delays())
    print(f"logs --follow: {len(delays)} step lines, median delay "
          f"{delays[len(delays) // 2]:.2f} s, max {delays[-1]:.2f} s")
    # Live, not at the end: it reads every 0.5 s (follow.POLL_S), and a line waits in no
    # buffer (the ranks' lines are written as they come). The slowest line may have waited
    # for one answer of a busy slurmctld (its --follow asks whether the job is done).
    assert delays[len(delays) // 2] < 2.0 and delays[-1] < 30.0, delays

    # The script's tracker runs, one each across the requeue, with every step.
    record = json.loads((run_dir / "trackers.json").read_text())
    ids, steps, _ = wandb_history(run_dir / "wandb")
    assert ids == {record["wandb"]["id"]} and sorted(steps) == list(range(60))
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 2
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=record["mlflow"]["tracking_uri"])
    assert sorted(m.step for m in client.get_metric_history(
        record["mlflow"]["run_id"], "value")) == list(range(60))

    # The cost, in status and in summary.json, as sacct counts it.
    status = hpc_ddp("status", [str(run_dir), "--json"], env=slurm_env)
    assert status.returncode == 0, status.stderr
    cost = json.loads(status.stdout)["runs"][0]["cost"]
    starts = _sacct_starts(job, slurm_env)
    assert cost["starts"] == len(starts) >= 2
    assert cost["running_s"] == sum(int(s["ElapsedRaw"]) for s in starts)
    assert cost["cpu_hours"] == pytest.approx(
        sum(int(s["ElapsedRaw"]) * int(s["AllocCPUS"]) for s in starts) / 3600, abs=1e-4)
    import datetime as dt

    def at(text: str) -> float:
        return dt.datetime.fromisoformat(text).timestamp()

    assert cost["queue_s"] == pytest.approx(
        sum(at(s["Start"]) - at(s["Submit"]) for s in starts), abs=1e-3)
    assert cost["wall_s"] == pytest.approx(
        max(at(s["End"]) for s in starts) - min(at(s["Submit"]) for s in starts), abs=1e-3)
    assert cost["gpu_hours"] == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["cost"] == cost
    table = hpc_ddp("status", [str(run_dir)], env=slurm_env).stdout
    assert "CPU-h" in table and "queued" in table


FAILING = '''\
import os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
print("about to fail", flush=True)
raise ValueError(f"bad learning rate on rank {dist.get_rank()}")
'''


def test_a_script_failing_on_every_rank_is_said_once(hpc_ddp: Run, slurm_cluster: TestCluster,
                                                     slurm_env: dict[str, str],
                                                     tmp_path: Path) -> None:
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    run_dir = tmp_path / "run"
    # A GPU per node (the test cluster's stand-ins, computing on the CPU): GPU-hours to count.
    done = hpc_ddp("submit", ["cluster=slurm", "nodes=4", f"script={script}", "wait=true",
                              "cluster.gpus_per_node=1", "trainer.device=cpu",
                              f"run_dir={run_dir}"], env=slurm_env, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    job = job_id_of(done.stdout)
    assert_ended(job, slurm_env, "FAILED", done.stdout)
    out = done.stdout
    assert out.count("Traceback (most recent call last)") == 1, out
    assert out.count("ValueError: bad learning rate on rank") == 1, out
    nodes = collect(slurm_cluster.node_names)  # node[1-4]
    assert f"ranks 0-3 of 4 on {nodes}: the script exited with code 1" in out, out
    assert "first to fail: rank " in out
    assert "the script exited with code 1; its last lines:" in out
    failures = [e for e in events.read(run_dir) if e["kind"] == "failure"]
    assert failures and all("\n" not in e["cause"] for e in failures), failures
    lines = (run_dir / failures[0]["lines"]).read_text()
    assert "ValueError: bad learning rate on rank" in lines
    for rank in range(4):  # every rank's program output is in its log
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert "OUT about to fail" in log and "ERR ValueError: bad learning rate" in log
        assert all(ranklines.parse(raw) for raw in log.splitlines())
    # GPU-hours as sacct counts them: the allocation's GPUs (AllocTRES) x its running time;
    # the test cluster's accounting tracks no GPUs (AccountingStorageTRES has no gres/gpu,
    # as at some sites): then its nodes x the 1 GPU per node asked for.
    status = hpc_ddp("status", [str(run_dir), "--json"], env=slurm_env)
    cost = json.loads(status.stdout)["runs"][0]["cost"]
    out = subprocess.run(["sacct", "-X", "-D", "-n", "-P", "-j", job, "-o",
                          "ElapsedRaw,AllocTRES,NNodes"], env=slurm_env, capture_output=True,
                         text=True, check=True).stdout
    gpu_s = 0
    for line in out.splitlines():
        elapsed, tres, nodes = line.split("|")
        tracked = dict(p.split("=", 1) for p in tres.split(",") if "=" in p).get("gres/gpu")
        gpu_s += int(elapsed) * int(tracked if tracked is not None else nodes)
    assert gpu_s > 0 and cost["gpu_hours"] == pytest.approx(gpu_s / 3600, abs=1e-4), out
    assert "GPU-h" in hpc_ddp("status", [str(run_dir)], env=slurm_env).stdout
