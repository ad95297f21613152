"""The local path end to end, as a user runs it: real processes, gloo, files on disk."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_ddp.rank.services import checkpoint
from tests.conftest import REPO, command_env
from tests.integration.test_warm_start import all_warm

Run = Callable[..., subprocess.CompletedProcess[str]]


def tb_scalars(tb_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) pairs as TensorBoard itself reads them (purged steps dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_acceptance_two_ranks(hpc_ddp: Run, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", ["cluster=local", "nodes=1", "cluster.tasks_per_node=2",
                              "trainer.max_steps=60", f"run_dir={run_dir}"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "eval accuracy" in done.stdout and str(run_dir) in done.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 60
    assert summary["eval_accuracy"] > 0.2
    assert summary["hosts"] == [os.uname().nodename] * 2
    assert summary["resumed_from_step"] is None and summary["restarts"] == 0
    # Both ranks forked from the machine's warm process (the default: rank/warm/).
    assert summary["start"] == "warm" and all_warm(run_dir, 2)
    # The id to quote is the one submitted and recorded: summary and job.json agree, and the
    # launch's own id names its rendezvous file (docs/run-directory.md).
    job = json.loads((run_dir / "job.json").read_text())
    assert summary["job_id"] == job["job_id"] and f"local job {job['job_id']}:" in done.stdout
    assert [p.name for p in (run_dir / "rendezvous").glob("*.json")] == [
        f"{summary['launch_id']}-r0.json"]
    for key in ("epochs_completed", "samples_seen", "final_train_loss", "samples_per_s"):
        assert summary[key] is not None
    loss = tb_scalars(run_dir / "tb", "train/loss")
    assert [s for s, _ in loss] == list(range(10, 61, 10))
    assert loss[-1][1] < loss[0][1]  # it learns
    for tag in ("train/lr", "train/samples_per_s", "eval/loss", "eval/accuracy"):
        assert tb_scalars(run_dir / "tb", tag)
    state = checkpoint.load_latest(run_dir / "checkpoints")
    assert state is not None and state["counters"]["global_step"] == 60
    assert sorted(p.name for p in (run_dir / "logs").glob("rank*.log")) == ["rank0.log",
                                                                           "rank1.log"]
    assert "[rank 1 " in (run_dir / "logs" / "rank1.log").read_text()
    assert (run_dir / "config.yaml").is_file()
    rank1 = json.loads((run_dir / "ranks" / "rank1.json").read_text())
    assert rank1["rank"] == 1 and rank1["world_size"] == 2 and "env" in rank1


def test_simulated_nodes_say_so_once(hpc_ddp: Run, tmp_path: Path) -> None:
    done = hpc_ddp("submit", ["cluster=local", "nodes=2", "cluster.tasks_per_node=2",
                              "trainer.max_steps=8", "data.train_size=512", "data.eval_size=128",
                              f"run_dir={tmp_path / 'r'}"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("simulating 2 nodes") == 1
    ranks = [json.loads((tmp_path / "r" / "ranks" / f"rank{r}.json").read_text())
             for r in range(4)]
    assert [(r["node_rank"], r["local_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]


# A run long enough to be killed in the middle; grad accumulation, augmentation and momentum
# make every piece of resumable state matter.
RESUME_ARGS = ["cluster=local", "cluster.tasks_per_node=2", "trainer.max_steps=120",
               "trainer.batch_size=16", "trainer.grad_accum=2", "trainer.checkpoint_interval=5",
               "trainer.log_interval=5", "trainer.eval_interval=40", "data.augment=true",
               "data.train_size=1024"]


def _final_state(run_dir: Path) -> dict[str, Any]:
    state = checkpoint.load_latest(run_dir / "checkpoints")
    assert state is not None
    return state


def test_killed_run_resumes_to_the_same_weights(hpc_ddp: Run, tmp_path: Path) -> None:
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    done = hpc_ddp("submit", [*RESUME_ARGS, f"run_dir={straight}"])
    assert done.returncode == 0, done.stdout + done.stderr

    proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp.submit", *RESUME_ARGS,
                             f"run_dir={killed}"], cwd=REPO, env=command_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    latest = killed / "checkpoints" / "latest"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if latest.exists() and checkpoint.latest_path(latest.parent).name >= "step_000000030.pt":
            break
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)  # the submitter, the controller and every rank
    proc.wait(timeout=30)
    killed_at = _final_state(killed)["counters"]["global_step"]
    assert not (killed / "summary.json").exists(), "the run ended before it could be killed"
    assert 30 <= killed_at < 120

    done = hpc_ddp("submit", [f"run_dir={killed}", "resume=true"])
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["global_step"] == 120 and summary["resumed_from_step"] == killed_at
    assert summary["restarts"] == 1 and summary["restart_history"][0]["cause"] == "resume"

    a, b = _final_state(straight), _final_state(killed)
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name  # bitwise
    assert a["counters"]["samples_seen"] == b["counters"]["samples_seen"]
    assert a["counters"]["epoch"] == b["counters"]["epoch"]
    # TensorBoard: every logged step exactly once, with the values of the straight run.
    assert tb_scalars(killed / "tb", "train/loss") == tb_scalars(straight / "tb", "train/loss")


def test_a_dead_rank_fails_the_command_with_its_log(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp.submit", "cluster=local",
                             "trainer.max_steps=100000", "trainer.collective_timeout_s=20",
                             f"run_dir={run_dir}"], cwd=REPO, env=command_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rank1 = run_dir / "ranks" / "rank1.json"
    deadline = time.monotonic() + 120
    while not (rank1.exists() and (run_dir / "progress.json").exists()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    os.kill(json.loads(rank1.read_text())["pid"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert "failed" in out and "rank 0 on " in out and "[rank 0 " in out
    assert "rank 1 on " in out and "stopped answering" in out  # the dead rank is named


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_checkpoints_and_says_how_to_continue(hpc_ddp: Run, tmp_path: Path,
                                                     signum: int) -> None:
    run_dir = tmp_path / "run"
    # A terminal's Ctrl-C: SIGINT to the whole foreground process group; a `kill`: SIGTERM
    # to the command alone.
    proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp.submit", *RESUME_ARGS,
                             "trainer.max_steps=100000", f"run_dir={run_dir}"], cwd=REPO,
                            env=command_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while (json.loads((run_dir / "progress.json").read_text()).get("step", 0)
           if (run_dir / "progress.json").exists() else 0) < 20:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signum)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signum, out
    assert "Traceback" not in out
    assert f"Continue with: python -m hpc_ddp.submit run_dir={run_dir} resume=true" in out
    assert all_warm(run_dir, 2)  # the signal reached ranks forked from the warm process
    stops = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "stop"]
    assert len(stops) == 1 and "Ctrl-C" in stops[0]["cause"]
    stopped_at = stops[0]["step"]
    assert _final_state(run_dir)["counters"]["global_step"] == stopped_at  # nothing lost
    assert json.loads((run_dir / "progress.json").read_text())["step"] == stopped_at
    done = hpc_ddp("submit", [f"run_dir={run_dir}", "resume=true", "trainer.max_steps=200"])
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] == stopped_at and summary["global_step"] == 200


def _started(run_dir: Path, proc: subprocess.Popen[str], steps: int = 3) -> None:
    """Until the run has logged ``steps`` steps (its ranks train)."""
    progress = run_dir / "progress.json"
    deadline = time.monotonic() + 120
    while (json.loads(progress.read_text()).get("step", 0) if progress.exists() else 0) < steps:
        assert time.monotonic() < deadline and proc.poll() is None, proc.poll()
        time.sleep(0.05)


# How the two interrupts of one Ctrl-C reach the command: through `timeout` (the terminal's
# to the group, then timeout's copy), or two to the group some seconds apart (a few timings,
# to land the second in each part of the first one's handling).
DOUBLE_INTERRUPTS = [("timeout", 0.0), ("pair", 0.002), ("pair", 0.02), ("pair", 0.2)]


def test_a_double_interrupt_still_stops_the_ranks_at_a_checkpoint(tmp_path: Path) -> None:
    """Ctrl-C as a terminal sends it when a wrapper passes it on too: two SIGINTs at once.
    They are one Ctrl-C: the ranks agree on a step, checkpoint there and stop (never left
    running, never killed), and the command says so in one line, without a traceback."""
    args = ["cluster=local", "cluster.tasks_per_node=2", "trainer.max_steps=100000",
            "trainer.log_interval=1", "trainer.checkpoint_interval=1000",
            "trainer.stop_check_interval=2", "data.train_size=512", "data.eval_size=64"]
    for n, (how, gap) in enumerate(DOUBLE_INTERRUPTS):
        run_dir, log = tmp_path / f"run{n}", tmp_path / f"out{n}.txt"
        command = [sys.executable, "-m", "hpc_ddp.submit", *args, f"run_dir={run_dir}"]
        # Output into a file: ranks left running would hold a pipe open after the command.
        with open(log, "w") as sink:
            proc = subprocess.Popen(["timeout", "300", *command] if how == "timeout" else
                                    command, cwd=REPO, env=command_env(), stdout=sink,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            _started(run_dir, proc)
            os.killpg(proc.pid, signal.SIGINT)
            if how == "pair":
                time.sleep(gap)
                os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=120)
        finally:  # whatever went wrong, no rank of this try trains on behind the next one
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        out = log.read_text()
        said = f"try {n} ({how}, {gap} s apart):\n{out}"
        assert proc.returncode == 130 and "Traceback" not in out, said
        assert all_warm(run_dir, 2), said  # forked ranks, stopped as the table says
        ended = [line for line in out.splitlines() if line.startswith(("stopped", "killed"))]
        assert len(ended) == 1 and ended[0].startswith("stopped at step "), said
        assert f"Continue with: python -m hpc_ddp.submit run_dir={run_dir} resume=true" in out
        stops = [e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
                 if e["kind"] == "stop"]
        assert len(stops) == 1 and "Ctrl-C" in stops[0]["cause"], said
        assert f"stopped at step {stops[0]['step']} " in ended[0], said
        # The ranks checkpointed at the step they agreed on and did not train on.
        assert _final_state(run_dir)["counters"]["global_step"] == stops[0]["step"] < 100000
        assert not (run_dir / "summary.json").exists()


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``signum`` (/proc's SigCgt)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def test_sigterm_while_submitting_says_what_was_submitted_and_stops_cleanly(
        tmp_path: Path) -> None:
    """A `kill` while the command plans (nothing submitted yet) and while it submits (the
    job goes out, is named, and its ranks are stopped): one line each, no traceback."""
    args = ["cluster=local", "cluster.tasks_per_node=2", "trainer.max_steps=100000",
            "data.train_size=512", "data.eval_size=64"]
    outcomes = {}
    for when in ("planning", "submitting"):
        run_dir, log = tmp_path / when, tmp_path / f"{when}.txt"
        with open(log, "w") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp.submit", *args,
                                     f"run_dir={run_dir}"], cwd=REPO, env=command_env(),
                                    stdout=sink, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            # Planning: as soon as the command handles SIGTERM (its first act). Submitting:
            # as soon as the submission writes the run's config, before the job is out.
            while not (_catches(proc.pid, signal.SIGTERM) if when == "planning"
                       else (run_dir / "config.yaml").exists()):
                assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
                time.sleep(0.002)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        outcomes[when] = out = log.read_text()
        assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in out, out
    planning, submitting = outcomes["planning"], outcomes["submitting"]
    assert planning.strip() == ("stopped (SIGTERM) before anything was submitted: nothing "
                                "runs."), planning
    assert not (tmp_path / "planning").exists()
    # What went out is said (its first line), then how it ended: the ranks were stopped.
    job = json.loads((tmp_path / "submitting" / "job.json").read_text())
    assert submitting.startswith(f"hpc_ddp: local job {job['job_id']}: "), submitting
    last = submitting.strip().splitlines()[-1]
    assert last.startswith("stopped") and "Continue with: python -m hpc_ddp.submit" in last
    from hpc_ddp.procs import pid_alive

    assert not pid_alive(job["controller_pid"], job["controller_start"])


@pytest.mark.parametrize("args, key", [
    (["nodes=0"], "nodes=0"),
    (["trainer.batch_size=-2"], "trainer.batch_size=-2"),
    (["model=vgg"], "model=vgg"),
    (["data=imagenet"], "data=imagenet"),
    (["data=cifar10", "data.root=/no/such/dir"], "data.root=/no/such/dir"),
    (["run_dir=/sys/hpc_ddp_run"], "run_dir=/sys/hpc_ddp_run"),
    (["trainer.bach_size=8"], "trainer.bach_size=8"),
    (["--frobnicate"], "option=--frobnicate"),
])
def test_bad_input_exits_2_with_one_line(hpc_ddp: Run, args: list[str], key: str) -> None:
    done = hpc_ddp("submit", args, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}:") and "Fix:" in lines[0]
    assert "Traceback" not in done.stderr


def test_existing_run_is_never_touched(hpc_ddp: Run, tmp_path: Path) -> None:
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.iterdir())
    for args in (["trainer.max_steps=1"], ["nodes=0"], ["resume=true"]):
        done = hpc_ddp("submit", [*args, f"run_dir={run_dir}"], timeout=120)
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(("error: run_dir=", "error: nodes=0")), done.stderr
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.iterdir()) == before


def test_a_stop_signal_checkpoints_at_one_step_and_resumes_exactly(hpc_ddp: Run,
                                                                  tmp_path: Path) -> None:
    """USR2 reaches the ranks at different moments; they agree on one step, rank 0 saves,
    the command says how to continue, and the continued run ends as an uninterrupted one."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    args = [*RESUME_ARGS, "trainer.stop_check_interval=2"]
    assert hpc_ddp("submit", [*args, f"run_dir={straight}"]).returncode == 0
    proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp.submit", *args,
                             f"run_dir={stopped}"], cwd=REPO, env=command_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranks = [stopped / "ranks" / f"rank{r}.json" for r in range(2)]
    deadline = time.monotonic() + 120
    while not (all(p.exists() for p in ranks) and (stopped / "progress.json").exists()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    for path in ranks:
        os.kill(json.loads(path.read_text())["pid"], signal.SIGUSR2)
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert "stopped at step" in out and f"run_dir={stopped} resume=true" in out
    at = _final_state(stopped)["counters"]["global_step"]
    assert at < 120 and not (stopped / "summary.json").exists()
    done = hpc_ddp("submit", [f"run_dir={stopped}", "resume=true"])
    assert done.returncode == 0, done.stdout + done.stderr
    a, b = _final_state(straight), _final_state(stopped)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert json.loads((stopped / "summary.json").read_text())["resumed_from_step"] == at
