"""Files of a run dir that run code when read, planted by someone else or swapped for a link:
refused with the fix, and the payload never runs (docs/security.md, hpc_ddp/owned.py).

Every payload here would create a marker file; each test checks the marker is absent, and
where the file would otherwise be read, a control shows the payload does run from a file the
user owns (so the refusal, not an accident of the setup, is what stops it)."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from hpc_ddp.config.compose import compose, to_yaml
from hpc_ddp.inputs.run_dir import write_run_config
from hpc_ddp.owned import Untrusted, open_owned
from hpc_ddp.rank.services import checkpoint
from hpc_ddp.rundir import RunDir
from hpc_ddp.submit import main as submit_main
from tests.conftest import REPO, command_env

ROOT = os.geteuid() == 0


class Payload:
    """A pickle that runs ``touch marker`` when loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _run(tmp_path: Path, first: list[str]) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.root.mkdir(mode=0o750)
    write_run_config(run, compose(first), first)
    return run


def _plant_checkpoint(run: RunDir, marker: Path, step: int = 64) -> Path:
    run.checkpoints.mkdir(mode=0o750, exist_ok=True)
    path = run.checkpoints / checkpoint.name_for(step)
    torch.save({"counters": {"epoch": Payload(marker), "global_step": step}}, path)
    (run.checkpoints / checkpoint.LATEST).write_text(path.name)
    return path


def _resume(run: RunDir, *extra: str) -> tuple[int, str]:
    err = io.StringIO()
    out = io.StringIO()
    sys_err, sys.stderr = sys.stderr, err
    try:
        code = submit_main([f"run_dir={run.root}", "resume=true", *extra, "--cfg"], out=out)
    finally:
        sys.stderr = sys_err
    return code, err.getvalue()


@pytest.mark.parametrize("length", [["trainer.epochs=1"], ["trainer.max_steps=64"]])
def test_a_planted_checkpoint_is_refused_at_the_resume_of_an_epochs_or_steps_run(
        tmp_path: Path, length: list[str]) -> None:
    marker = tmp_path / "payload-ran"
    run = _run(tmp_path, ["cluster=local", "model=tiny_cnn", *length])
    _plant_checkpoint(run, marker)
    more = "trainer.epochs=2" if "epochs" in length[0] else "trainer.max_steps=128"
    code, err = _resume(run, more)
    assert code == 2 and err.count("\n") == 1, err
    assert "holds os.system, which hpc_ddp does not unpickle" in err
    assert not marker.exists()


def test_a_checkpoint_swapped_for_a_link_is_refused(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    checkpoint.save({"step": 10}, run.checkpoints, 10, keep=3)
    elsewhere = tmp_path / "elsewhere.pt"
    torch.save({"step": 20}, elsewhere)
    (run.checkpoints / checkpoint.name_for(20)).symlink_to(elsewhere)
    (run.checkpoints / checkpoint.LATEST).write_text(checkpoint.name_for(20))
    with pytest.raises(Untrusted, match="step_000000020.pt is a symbolic link: hpc_ddp follows "
                                        "none inside a run dir"):
        checkpoint.load_usable(run.checkpoints)  # refused, not skipped for step 10
    # A linked folder on the way is refused the same way.
    (tmp_path / "real").mkdir(mode=0o750)
    checkpoint.save({"step": 30}, tmp_path / "real", 30, keep=3)
    other = RunDir(tmp_path / "other")
    other.root.mkdir(mode=0o750)
    other.checkpoints.symlink_to(tmp_path / "real")
    with pytest.raises(Untrusted, match="checkpoints is a symbolic link"):
        checkpoint.load_usable(other.checkpoints)


def test_a_run_dir_others_can_write_is_refused_and_the_message_says_how_to_use_data(
        tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    checkpoint.save({"step": 10}, run.checkpoints, 10, keep=3)
    run.root.chmod(0o770)  # checkpoints/ and the file are fine, the run dir is not
    with pytest.raises(Untrusted, match=f"{run.root} is writable by your group"):
        checkpoint.load_usable(run.checkpoints)
    run.root.chmod(0o750)
    assert checkpoint.load_latest(run.checkpoints) == {"step": 10}
    if not ROOT:
        return
    os.chown(run.checkpoints / checkpoint.name_for(10), 4321, 4321)
    with pytest.raises(Untrusted) as info:
        checkpoint.load_usable(run.checkpoints)
    said = str(info.value)
    assert "is not yours: the file belongs to uid 4321" in said
    assert "cp -r" not in said and "weights_only=True" in said and "new run_dir" in said


@pytest.mark.parametrize("where", ["overrides.yaml", "config.yaml"])
def test_a_planted_target_in_the_saved_config_never_runs(tmp_path: Path, where: str) -> None:
    marker = tmp_path / "payload-ran"
    run = _run(tmp_path, ["cluster=local", "model=tiny_cnn", "trainer.max_steps=64"])
    checkpoint.save({"counters": {"global_step": 64}}, run.checkpoints, 64, keep=3)
    payload = ["model._target_=tests.usercode.parts.planted", f"model.marker={marker}"]
    if where == "overrides.yaml":
        run.overrides.write_text(yaml.safe_dump(payload))
    else:
        planted = to_yaml(compose(["cluster=local", "trainer.max_steps=64", *payload]))
        run.config.write_text(planted)
    path = run.root / where
    # Control: as the user's own file, --cfg builds it (the model is built to compare it).
    code, err = _resume(run, "trainer.max_steps=128")
    assert marker.exists(), err
    marker.unlink()
    path.chmod(0o664)  # now anyone in the group could have written it
    code, err = _resume(run, "trainer.max_steps=128")
    assert code == 2 and err.count("\n") == 1, err
    assert f"{path} is writable by your group (mode 664)" in err and "chmod go-w" in err
    assert not marker.exists()
    if ROOT:
        path.chmod(0o640)
        os.chown(path, 4321, 4321)
        code, err = _resume(run, "trainer.max_steps=128")
        assert code == 2 and "is not yours" in err and not marker.exists()


def _delayed(target: Any) -> bytes:
    import cloudpickle
    from submitit.core.utils import DelayedSubmission

    return cloudpickle.dumps(DelayedSubmission(target))


def _run_task(folder: Path) -> subprocess.CompletedProcess[str]:
    """A local submitit task as the executor starts it (rank/main/submitted.py)."""
    env = command_env({"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": "77",
                       "SUBMITIT_LOCAL_NTASKS": "1", "SUBMITIT_LOCAL_NNODES": "1",
                       "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_GLOBALID": "0",
                       "SUBMITIT_LOCAL_LOCALID": "0"})
    return subprocess.run([sys.executable, "-m", "hpc_ddp.rank.main.submitted", "-u", "-m",
                           "submitit.core._submit", str(folder)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_a_planted_submitit_pickle_is_refused_on_the_node(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    folder = run.submitit
    folder.mkdir(parents=True, mode=0o750)
    done_file, marker = tmp_path / "task-ran", tmp_path / "payload-ran"
    pickled = folder / "77_submitted.pkl"
    pickled.write_bytes(_delayed(done_file.touch))
    pickled.chmod(0o640)
    done = _run_task(folder)  # the user's own task runs as ever
    assert done.returncode == 0 and done_file.exists(), done.stderr
    pickled.write_bytes(pickle.dumps(Payload(marker)))
    for plant in ("group-writable", "link"):
        if plant == "link":
            pickled.chmod(0o640)
            (tmp_path / "payload.pkl").write_bytes(pickled.read_bytes())
            pickled.unlink()
            pickled.symlink_to(tmp_path / "payload.pkl")
        else:
            pickled.chmod(0o660)
        done = _run_task(folder)
        assert done.returncode == 2, done.stderr
        assert "error: " in done.stderr and ("writable by your group" in done.stderr
                                             or "is a symbolic link" in done.stderr)
        assert not marker.exists()


def test_the_executors_start_tasks_through_the_checked_loader(tmp_path: Path) -> None:
    from hpc_ddp.launch import slurm

    cfg = compose(["cluster=slurm", f"run_dir={tmp_path / 'run'}"])
    script = slurm.render(cfg, RunDir(tmp_path / "run"))
    assert "-m hpc_ddp.rank.main.submitted -u -m submitit.core._submit" in script


def test_a_planted_entry_pickle_is_refused(tmp_path: Path) -> None:
    import cloudpickle

    from hpc_ddp.rank.main.entry import PICKLED, from_pickle

    marker = tmp_path / "payload-ran"
    root = tmp_path / "run"
    root.mkdir(mode=0o750)
    (root / PICKLED).write_bytes(cloudpickle.dumps(lambda ctx: ctx.run_dir))
    ctx = SimpleNamespace(run_dir=str(root))
    assert from_pickle(ctx) == str(root)  # type: ignore[arg-type]
    (root / PICKLED).write_bytes(pickle.dumps(Payload(marker)))
    (root / PICKLED).chmod(0o666)
    with pytest.raises(Untrusted, match="writable by others"):
        from_pickle(ctx)  # type: ignore[arg-type]
    assert not marker.exists()


def test_a_planted_step_pickle_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from hpc_ddp.rank.contract import TASK_ENV
    from hpc_ddp.rank.main import step

    marker = tmp_path / "payload-ran"
    folder = tmp_path / "run" / "submitit"
    folder.mkdir(parents=True, mode=0o750)
    task = folder / "step-abc.pkl"
    task.write_bytes(pickle.dumps(Payload(marker)))
    (tmp_path / "run").chmod(0o777)
    monkeypatch.setenv(TASK_ENV, str(task))
    assert step.main() == 2
    assert "run is writable by others" in capsys.readouterr().err
    assert not marker.exists()


def test_a_run_dir_or_sweep_dir_others_can_write_is_refused_at_submission(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o777)  # empty, as a fresh run's: still anyone's to plant files in
    assert submit_main(["cluster=local", f"run_dir={run}", "dry_run=true"]) == 2
    assert f"run_dir={run}: {run} is writable by others" in capsys.readouterr().err
    assert submit_main(["-m", "cluster=local", f"sweep.dir={run}", "optim.lr=0.1,0.2",
                        "dry_run=true"]) == 2
    assert f"sweep.dir={run}: {run} is writable by others" in capsys.readouterr().err
    assert os.listdir(run) == []


def test_only_files_inside_the_run_dir_are_opened(tmp_path: Path) -> None:
    with pytest.raises(Untrusted, match="is not inside"):
        open_owned(tmp_path / "x", tmp_path / "run")


@pytest.mark.parametrize("args, mode", [([], 0o750), (["cluster.umask=077"], 0o700),
                                        (["cluster.umask=002"], 0o750)])
def test_the_sbatch_wrapper_sets_the_umask_before_it_makes_anything(
        tmp_path: Path, args: list[str], mode: int) -> None:
    # A submitting shell's umask of 002 (common on shared project setups) must not leave the
    # run dir or its logs/ group-writable: the ranks would refuse to load from it.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/bin/sh\numask > "$UMASK_SEEN"\n')
    (fake / "srun").chmod(0o755)
    run, seen = tmp_path / "outputs" / "run", tmp_path / "umask"
    done = subprocess.run(["bash", "-c", 'umask 002; exec bash jobs/train.sbatch "$@"', "-",
                           f"run_dir={run}", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=False,
                          env=command_env({"PATH": f"{fake}:{os.environ['PATH']}",
                                           "SLURM_JOB_ID": "77", "UMASK_SEEN": str(seen)}))
    assert done.returncode == 0, done.stderr
    for folder in (run.parent, run, run / "logs"):
        assert folder.stat().st_mode & 0o777 == mode, folder
    assert int(seen.read_text(), 8) == 0o777 & ~mode  # and the ranks start with it


@pytest.mark.skipif(os.geteuid() != 0, reason="making a second user's files needs root")
@pytest.mark.parametrize("plant", ["link", "their_logs"])
def test_the_sbatch_wrapper_writes_nothing_through_a_planted_output(
        tmp_path: Path, plant: str) -> None:
    """outputs/job-<id>/logs/slurm-<id>.out planted as a symbolic link to a file of ours, or
    logs/ made by another user: the job's output never reaches the link's target."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\necho from-the-job\n")
    (fake / "srun").chmod(0o755)
    work = tmp_path / "work"
    logs = work / "outputs" / "job-77" / "logs"
    logs.mkdir(parents=True, mode=0o750)
    target = tmp_path / "victim.txt"
    target.write_text("mine\n")
    if plant == "link":
        (logs / "slurm-77.out").symlink_to(target)
    else:
        os.chown(logs, 4242, 4242)
    done = subprocess.run(["bash", str(REPO / "jobs" / "train.sbatch")], cwd=work,
                          capture_output=True, text=True, timeout=60, check=False,
                          env=command_env({"PATH": f"{fake}:{os.environ['PATH']}",
                                           "SLURM_JOB_ID": "77"}))
    assert done.returncode == 0, done.stderr
    assert target.read_text() == "mine\n"  # nothing appended through the link
    assert "from-the-job" in (work / "slurm-77.out").read_text()  # where sbatch ran instead


def test_a_rank_log_planted_as_a_link_is_not_written_through(tmp_path: Path) -> None:
    from hpc_ddp.errors import UserError
    from hpc_ddp.rank.join import ranklog
    from hpc_ddp.ranklines import open_for_append

    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    target = tmp_path / "victim.txt"
    target.write_text("mine\n")
    (logs / "rank0.log").symlink_to(target)
    with pytest.raises(OSError):  # ELOOP: every open of a rank log refuses a link
        open_for_append(logs / "rank0.log")
    with pytest.raises(UserError) as raised:
        ranklog.setup(logs / "rank0.log", 0, "node1", echo=False)
    assert "rank0.log is a symbolic link" in raised.value.message
    assert target.read_text() == "mine\n"
