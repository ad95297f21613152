"""An environment activated on every node (the wrapper run by a real sh), and Slurm's
commands through the relay a container's ranks use (a real sh relay, a stand-in scontrol)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_ddp.config.schema import ClusterConfig
from hpc_ddp.launch import nodeenv
from hpc_ddp.slurm import relay as slurm_relay
from hpc_ddp.slurm import requeue


def run_wrapped(cluster: ClusterConfig, errors: Path | None, env: dict[str, str],
                *command: str) -> subprocess.CompletedProcess[str]:
    argv = nodeenv.wrapper(cluster, errors)
    return subprocess.run([*argv, *command], env={"PATH": os.environ["PATH"], **env},
                          capture_output=True, text=True, timeout=30, check=False)


def fake_venv(folder: Path) -> Path:
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "activate").write_text(f'export VIRTUAL_ENV="{folder}"\n'
                                             f'export PATH="{folder}/bin:$PATH"\n')
    return folder


def test_a_venv_is_activated_before_the_task_starts(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path / "venv")
    done = run_wrapped(ClusterConfig(venv=str(venv)), tmp_path / "logs", {},
                       "sh", "-c", 'echo "$VIRTUAL_ENV|$1"', "task", "arg with space")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{venv}|arg with space\n"  # the task's own argv, intact


def test_a_missing_venv_is_named_with_the_node_and_left_as_the_ranks_error(
        tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    done = run_wrapped(ClusterConfig(venv="/no/such/venv"), logs,
                       {"SLURMD_NODENAME": "node7", "SLURM_PROCID": "13"}, "true")
    assert done.returncode == 2
    line = ("cluster.venv=/no/such/venv: no virtual environment there (no bin/activate) on "
            "node node7.")
    assert line in done.stderr
    assert (logs / "rank13.error").read_text().startswith(f"rank 13 on node7: {line} Fix:")


def stand_in_conda(folder: Path, envs: Path) -> Path:
    """A `conda` whose shell hook defines conda(): `activate NAME` works for envs/NAME."""
    conda = folder / "conda"
    folder.mkdir(parents=True, exist_ok=True)
    conda.write_text("#!/bin/sh\n"
                     '[ "$1 $2" = "shell.posix hook" ] || exit 9\n'
                     "cat <<'EOF'\n"
                     "conda() {\n"
                     '  [ "$1" = activate ] || return 9\n'
                     f'  [ -d "{envs}/$2" ] || return 1\n'
                     f'  export CONDA_PREFIX="{envs}/$2"\n'
                     "}\n"
                     "EOF\n")
    conda.chmod(0o755)
    return conda


def test_a_conda_env_is_activated_with_condas_own_hook(tmp_path: Path) -> None:
    envs = tmp_path / "envs"
    (envs / "train").mkdir(parents=True)
    conda = stand_in_conda(tmp_path / "bin", envs)
    good = run_wrapped(ClusterConfig(conda_env="train"), None, {"CONDA_EXE": str(conda)},
                       "sh", "-c", 'echo "$CONDA_PREFIX"')
    assert good.returncode == 0 and good.stdout == f"{envs}/train\n", good.stderr
    missing = run_wrapped(ClusterConfig(conda_env="other"), None,
                          {"CONDA_EXE": str(conda), "SLURMD_NODENAME": "node2"}, "true")
    assert missing.returncode == 2
    assert "cluster.conda_env=other: conda has no such environment there on node node2" in (
        missing.stderr)
    absent = run_wrapped(ClusterConfig(conda_env="train"), None,
                         {"PATH": "/nonexistent", "SLURMD_NODENAME": "node2"}, "true")
    assert absent.returncode == 2 and "no conda (not on PATH, CONDA_EXE unset)" in absent.stderr


@pytest.fixture
def relay(tmp_path: Path) -> Path:
    """The relay as a batch script starts it (slurm_relay.start_lines), with a stand-in
    scontrol and squeue on its PATH; ends with the shell it serves."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, rc in (("scontrol", 0), ("squeue", 0)):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {tmp_path}/calls\n'
                                    f'echo "00:10:00"\nexit {rc}\n')
        (bin_dir / tool).chmod(0o755)
    folder = tmp_path / "relay"
    lines = slurm_relay.start_lines(folder, per_job=False)
    shell = subprocess.Popen(["sh", "-c", "\n".join([*lines, "sleep 20"])],
                             env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    yield folder
    shell.kill()
    shell.wait()


def test_requeue_and_squeue_go_through_the_relay_and_nothing_else_does(
        relay: Path, tmp_path: Path) -> None:
    environ = {slurm_relay.RELAY_ENV: str(relay), "PATH": "/nonexistent"}  # no scontrol here
    started = time.monotonic()
    assert requeue.requeue("1234", environ) is None
    left = requeue.squeue_job("1234", "%L", environ)
    assert left is not None and left.stdout == "00:10:00\n"
    assert time.monotonic() - started < 20  # answered, not timed out
    assert (tmp_path / "calls").read_text() == "scontrol requeue 1234\nsqueue -h -j 1234 -o %L\n"
    refused = slurm_relay.ask(relay, ["rm", "-rf", str(tmp_path)], 20)
    assert refused.returncode == 2 and "refused" in refused.stderr
    assert tmp_path.exists() and list(relay.iterdir()) == []  # answered and cleaned up


def test_without_a_relay_no_answer_comes_and_the_request_is_withdrawn(tmp_path: Path) -> None:
    with pytest.raises(subprocess.TimeoutExpired, match="timed out") as raised:
        slurm_relay.ask(tmp_path / "nobody", ["squeue", "-h", "-j", "1", "-o", "%T"], 0.2)
    assert "no answer from Slurm's relay" in str(raised.value.output)
    assert not list((tmp_path / "nobody").glob("*.req"))


def test_env_command_conda_steps_and_refusals(tmp_path: Path) -> None:
    from hpc_ddp import env as env_command

    steps = env_command.conda_steps("/opt/conda/bin/conda", "train", Path("/p/environment.yml"),
                                    Path("/p"), "timm", exists=False)
    assert [argv for _, argv in steps] == [
        ["/opt/conda/bin/conda", "env", "create", "-n", "train", "-f", "/p/environment.yml"],
        ["/opt/conda/bin/conda", "run", "-n", "train", "python", "-m", "pip", "install",
         "--no-deps", "--editable", "/p[timm]"],
        ["/opt/conda/bin/conda", "run", "-n", "train", "python", "-m", "pip", "check"]]
    update = env_command.conda_steps("conda", "/s/env", Path("/p/e.yml"), Path("/p"), "", True)
    assert update[0][1] == ["conda", "env", "update", "-p", "/s/env", "-f", "/p/e.yml",
                            "--prune"]
    done = subprocess.run([sys.executable, "-m", "hpc_ddp.env", "conda", "train"],
                          env={**os.environ, "PATH": "/nonexistent", "CONDA_EXE": ""},
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and done.stderr.startswith("error: --conda=conda: no conda")
    offline = env_command.venv_steps(tmp_path / "v", "py", Path("/p"), "", False,
                                     env_command.pip_options(True, "/wheels"))
    assert offline[1][1][3:8] == ["install", "--no-index", "--no-build-isolation",
                                  "--find-links", "/wheels"]
