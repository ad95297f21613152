"""``python -m hpc_ddp.status``: bad paths and options end in one line and exit code 2."""

from __future__ import annotations

import io
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from hpc_ddp.procs import start_time
from hpc_ddp.watch.status import main


def run_status(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    out = io.StringIO()
    code = main(args, out=out)
    return code, out.getvalue(), capsys.readouterr().err


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.yaml").write_text("cluster:\n  job_name: hpc_ddp\n")
    return folder


def test_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "job.json"
    afile.write_text("{}")
    code, _, err = run_status([str(afile)], capsys)
    assert code == 2 and "is a file, not a folder" in err and str(tmp_path) in err
    assert len(err.strip().splitlines()) == 1


def test_a_missing_path_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_status([str(tmp_path / "nope")], capsys)
    assert code == 2 and "does not exist" in err


@pytest.mark.parametrize("interval", ["-1", "0", "nan", "inf"])
def test_interval_must_be_positive(run_dir: Path, interval: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_status([str(run_dir), "--watch", "--interval", interval], capsys)
    assert code == 2 and "--interval=" in err and "positive" in err and out == ""


def test_plot_into_a_missing_folder_is_refused_first(run_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_status([str(run_dir), "--plot", str(tmp_path / "no" / "x.png")],
                                capsys)
    assert code == 2 and "does not exist" in err and out == ""  # before the table


def test_plot_needs_an_image_type(run_dir: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_status([str(run_dir), "--plot", str(tmp_path / "x.foo")], capsys)
    assert code == 2 and ".png" in err


@pytest.mark.parametrize("marker, job_name, said", [
    ("doctor.json", "hpc_ddp", "a doctor run"),
    (None, "hpc_ddp_doctor", "a doctor run"),
    ("bench/comm.json", "hpc_ddp", "bench comm"),
    (None, "hpc_ddp_bench-comm", "bench comm"),
    ("bench/train.json", "x", "bench train"),
])
def test_doctor_and_bench_folders_say_what_they_are(tmp_path: Path, marker: str | None,
                                                    job_name: str, said: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "config.yaml").write_text(f"cluster:\n  job_name: {job_name}\n")
    if marker:
        (folder / marker).parent.mkdir(parents=True, exist_ok=True)
        (folder / marker).write_text("{}")
    code, out, err = run_status([str(folder)], capsys)
    assert code == 2 and said in err and "NOT SUBMITTED" not in out


def test_a_run_made_by_train_still_shows(run_dir: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_status([str(run_dir)], capsys)
    assert code == 0 and "NOT SUBMITTED" in out


def test_best_point_without_accuracy_is_the_lowest_eval_loss() -> None:
    from hpc_ddp.watch.status import best, render

    rows = [{"label": f"p{i}", "run_dir": f"/r{i}", "job_id": None, "state": "COMPLETED",
             "restarts": 0, "step": 5, "total_steps": 5, "loss": 0.1, "eval_accuracy": None,
             "eval_loss": loss} for i, loss in enumerate([0.3, 0.1, 0.2])]
    assert best(rows) == rows[1]
    assert "best point: p1 (eval loss 0.1000, /r1)" in render(rows, is_sweep=True)
    rows[2]["eval_accuracy"] = 0.5
    assert best(rows) == rows[2]


def test_a_resumed_attempt_that_runs_shows_its_restart_and_its_own_step(tmp_path: Path) -> None:
    """While a resumed run trains, the first attempt's summary.json (restarts 0, step 40) is
    not the run's state: restarts 1 (as the summary will say at its end), the logged step."""
    import json
    import os
    import time

    from hpc_ddp.watch.status import row

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"restarts": 0, "global_step": 40,
                                                  "total_steps": 40, "eval_accuracy": 0.5}))
    os.utime(run / "summary.json", (time.time() - 60, time.time() - 60))
    first = {"kind": "local", "job_id": "7", "submitted": time.time() - 120}
    again = {"kind": "local", "job_id": "9", "submitted": time.time() - 10,
             "controller_pid": os.getpid(), "controller_start": None}
    (run / "job.json").write_text(json.dumps({**again, "history": [first, again]}))
    (run / "progress.json").write_text(json.dumps({"step": 55, "total_steps": 100,
                                                   "time": time.time()}))
    shown = row("run", run)
    assert (shown["restarts"], shown["step"], shown["total_steps"]) == (1, 55, 100), shown
    assert shown["eval_accuracy"] is None  # the first attempt's, not this one's
    # Once the attempt ends, its own summary counts.
    (run / "summary.json").write_text(json.dumps({"restarts": 1, "global_step": 100}))
    assert row("run", run)["restarts"] == 1 and row("run", run)["step"] == 100


def _sweep(tmp_path: Path, ids: list[str]) -> Path:
    import json

    folder = tmp_path / "sweep"
    points = []
    for n, job_id in enumerate(ids):
        run = folder / f"{n:03d}"
        run.mkdir(parents=True)
        (run / "job.json").write_text(json.dumps({"kind": "slurm", "job_id": job_id}))
        points.append({"index": n, "label": f"p{n}", "run_dir": str(run), "job_id": job_id})
    arrays = sorted({i.split("_")[0] for i in ids})
    (folder / "sweep.json").write_text(json.dumps({"kind": "slurm", "arrays": arrays,
                                                   "points": points}))
    return folder


@pytest.mark.parametrize("ids, squeue, cancelled, said", [
    # Every point COMPLETED: nothing is cancelled, and that is what is said.
    (["4_0", "4_1"], "", [], "every point had ended already (2 COMPLETED); nothing to cancel"),
    # One array ended, one still queued: only the queued one.
    (["4_0", "1_0", "1_1"], "1_0|PENDING|JobHeldUser|normal\n1_1|PENDING|JobHeldUser|normal\n",
     ["1"], "cancelled job array(s) 1; 1 other array(s) had ended already"),
])
def test_cancel_of_a_sweep_cancels_only_what_has_not_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        ids: list[str], squeue: str, cancelled: list[str], said: str) -> None:
    from tests.unit.slurm_records import SACCT_2205_CANCELLED, calls, fake_slurm

    folder, log = fake_slurm(tmp_path / "bin", {"squeue": squeue, "sacct": SACCT_2205_CANCELLED,
                                                "scancel": "", "sinfo": ""})
    monkeypatch.setenv("PATH", str(folder))
    code, out, _ = run_status([str(_sweep(tmp_path, ids)), "--cancel"], capsys)
    assert code == 0 and said in out, out
    assert [c.split()[1:] for c in calls(log) if c.startswith("scancel")] == (
        [cancelled] if cancelled else [])


@pytest.mark.skipif(os.geteuid() != 0, reason="making a second user's files needs root")
@pytest.mark.parametrize("action", ["--stop", "--cancel"])
@pytest.mark.parametrize("kind", ["local", "slurm"])
def test_stop_and_cancel_refuse_a_job_file_another_user_planted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str, kind: str) -> None:
    """In a folder of another uid, a job.json naming a process of ours (a sleeper started
    here) or a Slurm job id: refused in one line, the process alive, no scancel run."""
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        run = tmp_path / "theirs"
        run.mkdir()
        record = {"kind": kind, "job_id": "4242" if kind == "slurm" else str(sleeper.pid),
                  "submitted": time.time(), "controller_pid": sleeper.pid,
                  "controller_start": start_time(sleeper.pid)}
        (run / "job.json").write_text(json.dumps({**record, "history": [record]}))
        os.chown(run / "job.json", 4242, 4242)
        os.chown(run, 4242, 4242)
        calls = tmp_path / "calls"
        fake = tmp_path / "bin"
        fake.mkdir()
        for tool in ("scancel", "squeue", "sacct"):
            (fake / tool).write_text(f"#!/bin/sh\necho {tool} \"$@\" >> {calls}\n")
            (fake / tool).chmod(0o755)
        old_path = os.environ["PATH"]
        os.environ["PATH"] = f"{fake}:{old_path}"
        try:
            code, _, err = run_status([str(run), action], capsys)
        finally:
            os.environ["PATH"] = old_path
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: path={run}: ") and "act only on runs you made" in err
        assert sleeper.poll() is None  # not signalled
        assert not calls.exists() or "scancel" not in calls.read_text()
    finally:
        sleeper.kill()


def test_a_pending_sbatch_jobs_run_dir_is_found_from_its_arguments(tmp_path: Path) -> None:
    """Issue 46: `sbatch jobs/train.sbatch run_dir=...` makes its run dir when the job starts;
    until then squeue's folder (%Z) and command (%o) name it, as the script reads them."""
    from hpc_ddp.slurm import queued

    lines = "\n".join([
        f"41|PENDING|{tmp_path}|/x/jobs/train.sbatch trainer.max_steps=5 run_dir=runs/a",
        f"42|PENDING|{tmp_path}|/x/jobs/train.sbatch run_dir=a run_dir='/abs/b' -- run_dir=c",
        f"43_2|RUNNING|{tmp_path}|/x/jobs/train.sbatch model=resnet18",
        "junk line"])
    found = {q.job_id: q for q in queued.parse(lines)}
    assert set(found) == {"41", "42", "43_2"}
    assert found["41"].run_dir == tmp_path / "runs" / "a" and found["41"].state == "PENDING"
    assert found["42"].run_dir == Path("/abs/b")  # the last before a script's --, unquoted
    assert found["43_2"].run_dir == tmp_path / "outputs" / "job-43_2"
    assert found["41"].record() == {"kind": "slurm", "job_id": "41", "started_by": "sbatch"}
    assert queued.is_job_id("123") and queued.is_job_id("12_3") and not queued.is_job_id("a1")
