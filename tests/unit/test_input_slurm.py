"""Slurm input: sbatch_extra, the requeue signal, and a machine without (a working) Slurm."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from hpc_ddp.config.compose import compose
from hpc_ddp.config.schema import Config
from hpc_ddp.errors import UserError
from hpc_ddp.launch import slurm
from hpc_ddp.launch.resolve import resolve
from hpc_ddp.rundir import RunDir
from hpc_ddp.slurm.state import JobState, SlurmJobView
from tests.conftest import compose_refusal


@pytest.mark.parametrize("entry, fix", [
    ("nodes=8", "use nodes=8 instead"),
    ("signal=USR1@10", "cluster.signal=<name> and cluster.signal_delay_s=<seconds>"),
    ("no-requeue=true", "cluster.max_restarts=0"),
    ("requeue=true", "always asks for --requeue"),
    ("output=/tmp/x", "run_dir"),
    ("error=/tmp/x", "run_dir"),
    ("ntasks-per-node=2", "cluster.tasks_per_node=2"),
    ("ntasks_per_node=2", "cluster.tasks_per_node=2"),
    ("ntasks=8", "nodes and cluster.tasks_per_node"),
    ("gpus-per-node=4", "cluster.gpus_per_node=4"),
    ("gpus_per_task=1", "cluster.gpu_binding=per_task"),
    ("time=10", "cluster.time_min=<minutes>"),
    ("partition=gpu", "cluster.partition=gpu"),
    ("part=gpu", "cluster.partition=gpu"),  # sbatch reads --part as --partition
    ("job-name=x", "cluster.job_name=x"),
    ("job_name=x", "cluster.job_name=x"),
    ("array=0-3", "-m"),
    ("wrap=hostname", "cluster.setup"),
    ("mem=4G", "cluster.mem_gb"),
    ("exclusive=true", "cluster.exclusive=true"),
    ("parsable=true", "drop it"),
])
def test_sbatch_extra_cannot_replace_what_hpc_ddp_sets(entry: str, fix: str) -> None:
    message = compose_refusal([f"+cluster.sbatch_extra.{entry}", "nodes=4"])
    key = entry.partition("=")[0]
    assert message.startswith(f"cluster.sbatch_extra.{key}="), message
    assert "itself" in message and fix in message, message


def test_sbatch_extra_spelling_and_conflicts() -> None:
    dashes = compose_refusal(["+cluster.sbatch_extra.mail_type=END"])
    assert "+cluster.sbatch_extra.mail-type=END" in dashes
    assert "cluster.mem_gb" in compose_refusal(["+cluster.sbatch_extra.mem-per-cpu=2G",
                                         "cluster.mem_gb=4"])
    # Allowed: other options, a mode of --exclusive the boolean cannot express.
    cfg = compose(["+cluster.sbatch_extra.mail-type=END", "+cluster.sbatch_extra.exclusive=user",
                   "+cluster.sbatch_extra.mem-per-cpu=2G"])
    assert cfg.cluster.sbatch_extra["exclusive"] == "user"


def test_sbatch_extra_true_is_a_bare_flag(tmp_path: Path) -> None:
    assert slurm.sbatch_extra_flags({"hold": "True", "comment": "false", "mail-type": "END"}) == {
        "hold": True, "mail-type": "END"}
    script = slurm.dry_run(_slurm_cfg(tmp_path, "+cluster.sbatch_extra.hold=true"),
                           RunDir(tmp_path / "run"))
    assert "#SBATCH --hold\n" in script


@pytest.mark.parametrize("signal, words", [
    ("SIGFOO", "is not a signal name"),
    ("PWR", "is not a signal sbatch --signal takes by name"),
    ("10", "use cluster.signal=USR1"),
    ("usr2", "use cluster.signal=USR2"),
    ("KILL", "cannot be caught"),
    ("SIGSTOP", "cannot be caught"),
    ("TERM", "Slurm itself sends"),
    ("INT", "Ctrl-C"),
    ("CONT", "job control"),
])
def test_signal_must_be_one_the_ranks_can_catch(signal: str, words: str) -> None:
    message = compose_refusal([f"cluster.signal={signal}"])
    assert message.startswith(f"cluster.signal={signal}:") and words in message, message


@pytest.mark.parametrize("signal", ["USR2", "SIGUSR1", "HUP", "SIGXCPU"])
def test_signal_names_slurm_and_python_know(signal: str) -> None:
    assert compose([f"cluster.signal={signal}"]).cluster.signal == signal


@pytest.mark.parametrize("overrides, words", [
    (["cluster.time_min=100000", "cluster.signal_delay_s=65535"], "must be below 65535"),
    (["cluster.signal_delay_s=3600"], "not below the time limit (cluster.time_min=60 min"),
    (["cluster.time_min=1", "cluster.signal_delay_s=60"], "e.g. cluster.signal_delay_s=15"),
])
def test_signal_delay_fits_slurm_and_the_time_limit(overrides: list[str], words: str) -> None:
    message = compose_refusal(overrides)
    assert message.startswith("cluster.signal_delay_s=") and words in message, message


def test_signal_delay_just_inside_the_limits() -> None:
    compose(["cluster.time_min=100000", "cluster.signal_delay_s=65534"])
    compose(["cluster.time_min=2", "cluster.signal_delay_s=119"])


@pytest.mark.parametrize("overrides, start", [
    (["cluster.mem_gb=0.0001"], "cluster.mem_gb=0.0001: must be positive"),  # --mem=0M: all
    (["cluster.partition="], "cluster.partition=: is empty"),
])
def test_values_slurm_would_misread(overrides: list[str], start: str) -> None:
    assert compose_refusal(overrides).startswith(start)


# --- a machine without Slurm, or with a client but no controller --------------------------

def _slurm_cfg(tmp_path: Path, *overrides: str) -> Config:
    cfg = compose(["cluster=slurm", *overrides])
    return resolve(cfg, {"PATH": str(tmp_path / "empty")}, tmp_path)


def _fake_bin(tmp_path: Path, scontrol_up: bool, sbatch_stderr: str) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    ping = "echo 'Slurmctld(primary) at ctl is UP'" if scontrol_up else \
        "echo 'scontrol: error: could not reach the controller' >&2; exit 1"
    scripts = {"scontrol": ping,
               "sbatch": f"printf '%s\\n' {' '.join(repr(x) for x in sbatch_stderr.splitlines())} "
                         ">&2; exit 1"}
    for name, body in scripts.items():
        path = folder / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return folder


NO_CONTROLLER = ("sbatch: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host\n"
                 "sbatch: error: fetch_config: DNS SRV lookup failed\n"
                 "sbatch: fatal: Could not establish a configuration source")
BAD_PARTITION = "sbatch: error: Batch job submission failed: Invalid partition name specified"


def test_dry_run_needs_no_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no srun, no sbatch
    run = RunDir(tmp_path / "run")
    script = slurm.dry_run(_slurm_cfg(tmp_path), run)
    assert script.startswith("#!/bin/bash") and "srun --unbuffered" in script
    assert not run.root.exists()


def test_submit_without_sbatch_says_so(tmp_path: Path) -> None:
    with pytest.raises(UserError) as info:
        slurm.submit(_slurm_cfg(tmp_path), RunDir(tmp_path / "run"), _task,
                     environ={"PATH": str(tmp_path / "empty")})
    assert info.value.message.startswith("cluster.kind=slurm: no Slurm here: sbatch is not on")
    assert "cluster=local" in info.value.message


def test_no_controller_is_named_not_the_partition(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    folder = _fake_bin(tmp_path, scontrol_up=False, sbatch_stderr=NO_CONTROLLER)
    monkeypatch.setenv("PATH", str(folder))
    with pytest.raises(UserError) as info:
        slurm.submit(_slurm_cfg(tmp_path), RunDir(tmp_path / "run"), _task,
                     environ={"PATH": str(folder)})
    message = info.value.message
    assert "no Slurm controller answers (scontrol ping)" in message, message
    assert "Could not establish a configuration source" in message
    assert "partition, account" not in message and "DNS SRV" not in message
    assert "SLURM_CONF" in message and "cluster=local" in message
    assert capsys.readouterr().err == ""  # submitit's echo of sbatch's stderr is held back


def test_a_refusal_carries_sbatchs_reason(tmp_path: Path) -> None:
    from submitit.core.utils import FailedJobError

    folder = _fake_bin(tmp_path, scontrol_up=True, sbatch_stderr=BAD_PARTITION)
    cfg = _slurm_cfg(tmp_path, "cluster.partition=nope")
    error = slurm.refusal(cfg, FailedJobError(f"sbatch: warning: x\n{BAD_PARTITION}"),
                          {"PATH": str(folder)})
    assert error is not None
    # The key the user set and its value, then sbatch's words.
    assert error.message.startswith("cluster.partition=nope: sbatch refused the job: Batch "
                                    "job submission failed: Invalid partition name specified")
    assert slurm.refusal(cfg, RuntimeError("other"), {"PATH": str(folder)}) is None
    missing = FileNotFoundError(2, "No such file or directory", "sbatch")
    assert "sbatch is not on PATH" in str(slurm.refusal(cfg, missing, {}))
    # submitit's own executor for job arrays (sweeps) still wants srun on PATH.
    srun = RuntimeError('Could not detect "srun", are you indeed on a slurm cluster?')
    assert "srun is not on PATH" in str(slurm.refusal(cfg, srun, {}))


def test_sbatch_key_line() -> None:
    assert slurm.sbatch_key_line(NO_CONTROLLER) == (
        "sbatch: fatal: Could not establish a configuration source")
    assert slurm.sbatch_key_line("sbatch: error: a\nsbatch: error: b") == "sbatch: error: a"
    assert slurm.sbatch_key_line("") == "(no message)"


def test_cancel_without_scancel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(UserError, match="scancel 42"):
        SlurmJobView("42").cancel()


def test_an_empty_state_is_not_an_end() -> None:
    assert not JobState("").finished
    assert JobState("CANCELLED by 1000").finished


def _task() -> None:  # pickled by reference, never run
    pass
