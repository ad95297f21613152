"""From a laptop, over SSH: submit, follow, read the logs of a run on the test cluster.

The login node is a network namespace of its own on the cluster's bridge running OpenSSH's
sshd (hpc_ddp/testcluster/login.py). The "laptop" is this machine without the cluster's
Slurm configuration and with the remote root hidden (a private mount namespace with a tmpfs
over it): nothing can work by reading the cluster's files directly or by asking its
controller; everything goes over the connection.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc_ddp.remote import handle as handles
from hpc_ddp.testcluster.cluster import TestCluster
from hpc_ddp.testcluster.login import LoginNode, missing
from tests.cluster.slurm_final import assert_completed
from tests.conftest import REPO

pytestmark = pytest.mark.cluster

SCRIPT = """\
import torch
import torch.distributed as dist

import helper

dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(f"{helper.TAG} rank {dist.get_rank()} of {dist.get_world_size()} sum {int(t.item())}",
      flush=True)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def login(slurm_cluster: TestCluster, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[LoginNode]:
    problem = missing()
    if problem:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(problem)
        pytest.skip(problem)
    node = LoginNode(slurm_cluster.config, tmp_path_factory.mktemp("login"),
                     Path(slurm_cluster.env()["SLURM_CONF"]))
    node.up()
    try:
        yield node
    finally:
        node.down()


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def _project(root: Path) -> Path:
    """A user's project: a committed script, an untracked helper it imports, ignored data."""
    root.mkdir(parents=True)
    (root / "train.py").write_text(SCRIPT)
    (root / ".gitignore").write_text("data/\n")
    _git(root, "init", "-q")
    _git(root, "add", "train.py", ".gitignore")
    _git(root, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "one")
    (root / "helper.py").write_text("TAG = 'code-v1'\n")  # untracked, not ignored
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"\0" * 4096)  # ignored: never copied
    return root


def laptop(hidden: Path, module: str, args: list[str], cwd: Path, timeout: float = 300,
           sockets: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m hpc_ddp.<module> args`` as on a laptop: no SLURM_CONF, and ``hidden`` (the
    cluster's storage) covered by an empty tmpfs in a mount namespace of its own.
    ``sockets``: a folder for ssh's shared connections (one of its own: a connection that
    an earlier call left open to the same host would otherwise be reused)."""
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    env["PYTHONPATH"] = str(REPO)
    if sockets:
        env["XDG_RUNTIME_DIR"] = sockets
    command = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs none "{hidden}" && exec "$@"',
               "sh", sys.executable, "-m", f"hpc_ddp.{module}", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_a_laptop_submits_follows_and_reads_the_logs_over_ssh(
        login: LoginNode, slurm_env: dict[str, str], tmp_path: Path) -> None:
    remote = tmp_path / "cluster_storage"
    remote.mkdir()
    project = _project(tmp_path / "laptop" / "project")
    common = ["cluster=slurm", "nodes=2", "script=train.py", "cluster.remote=login",
              f"cluster.ssh_config={login.ssh_config}", f"cluster.remote_root={remote}",
              f"cluster.python={sys.executable}", "cluster.restarts_in_place=0"]
    started = time.monotonic()
    first = laptop(remote, "submit", [*common, "run_dir=runs/first"], project)
    said = first.stdout + first.stderr
    assert first.returncode == 0, said
    assert "copying the code" in said
    record = handles.read(project / "runs" / "first")
    assert record is not None and record.job_id and record.host == "login"
    assert record.remote_dir == f"{remote}/runs/runs/first"
    # On the cluster: the snapshot holds the committed and the untracked file, not the data.
    copy = remote / "code" / record.snapshot
    assert (copy / "helper.py").read_text() == "TAG = 'code-v1'\n"
    assert (copy / "train.py").is_file() and not (copy / "data").exists()

    watched = laptop(remote, "status", [str(project / "runs" / "first"), "--watch",
                                        "--interval", "1"], project)
    assert watched.returncode == 0, watched.stdout + watched.stderr
    assert "COMPLETED" in watched.stdout, watched.stdout
    assert_completed(record.job_id, slurm_env, said)
    logs = laptop(remote, "logs", [str(project / "runs" / "first"), "--rank", "1"], project)
    assert logs.returncode == 0, logs.stdout + logs.stderr
    assert "code-v1 rank 1 of 2 sum 3" in logs.stdout, logs.stdout
    # The handle is all the laptop holds: the run's files are only on the cluster.
    assert sorted(p.name for p in (project / "runs" / "first").iterdir()) == ["remote.json"]

    # The same tree again copies nothing; an edit makes a new snapshot, the old one stays.
    again = laptop(remote, "submit", [*common, "run_dir=runs/again", "wait=true"], project)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "copying the code" not in again.stdout + again.stderr
    second = handles.read(project / "runs" / "again")
    assert second is not None and second.snapshot == record.snapshot and second.job_id
    assert_completed(second.job_id, slurm_env)
    (project / "helper.py").write_text("TAG = 'code-v2'\n")
    edited = laptop(remote, "submit", [*common, "run_dir=runs/edited", "dry_run=true"],
                    project)
    assert edited.returncode == 0, edited.stdout + edited.stderr
    assert "copying the code" in edited.stdout and "#SBATCH" in edited.stdout, edited.stdout
    assert not (project / "runs" / "edited").exists()  # a dry run leaves no handle
    copies = sorted(p.name for p in (remote / "code").iterdir() if not p.name.startswith("."))
    assert len(copies) == 2 and record.snapshot in copies, copies
    (new,) = set(copies) - {record.snapshot}
    assert (remote / "code" / new / "helper.py").read_text() == "TAG = 'code-v2'\n"
    assert (copy / "helper.py").read_text() == "TAG = 'code-v1'\n"  # the run's own stays
    print(f"laptop: two runs and a dry run in {time.monotonic() - started:.1f} s")


def test_what_stops_a_connection_is_one_line_exit_2(login: LoginNode, tmp_path: Path) -> None:
    remote = tmp_path / "cluster_storage"
    remote.mkdir()
    project = _project(tmp_path / "project")
    stranger = tmp_path / "stranger_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)],
                   check=True)
    (tmp_path / "empty_known_hosts").write_text("")
    configs = {
        "unknown": login.client_config("login", login.folder / "user_key",
                                       tmp_path / "empty_known_hosts"),
        "refused": login.client_config("login", stranger),
        "silent": login.client_config("login", login.folder / "user_key").replace(
            "  User root\n", "  User root\n  Port 1\n"),
    }
    base = ["cluster=slurm", "nodes=1", "script=train.py", "cluster.remote=login",
            f"cluster.remote_root={remote}", f"cluster.python={sys.executable}"]
    said = {}
    for name, text in configs.items():
        path = tmp_path / f"{name}.ssh_config"
        path.write_text(text)
        done = laptop(remote, "submit", [*base, f"cluster.ssh_config={path}"], project, 120,
                      sockets=tempfile.mkdtemp(prefix="s", dir="/tmp"))
        said[name] = done.stderr
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, (
            name, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr and "Fix:" in done.stderr
    assert "host key is not known" in said["unknown"]
    assert "refused every key" in said["refused"]
    assert "does not answer" in said["silent"]
    no_hpc_ddp = laptop(remote, "submit", [*base, f"cluster.ssh_config={login.ssh_config}",
                                           "cluster.python=/usr/bin/python3"], project)
    assert no_hpc_ddp.returncode == 2, no_hpc_ddp.stdout + no_hpc_ddp.stderr
    assert "has no hpc_ddp for /usr/bin/python3" in no_hpc_ddp.stderr
    # A typo fails here, before any connection (the login node's sshd logs none).
    before = (login.folder / "sshd.log").read_text().count("Accepted publickey")
    typo = laptop(remote, "submit", [*base, f"cluster.ssh_config={login.ssh_config}",
                                     "trainer.max_stepz=3"], project)
    assert typo.returncode == 2 and "max_stepz" in typo.stderr, typo.stderr
    assert (login.folder / "sshd.log").read_text().count("Accepted publickey") == before
    assert not list((remote).iterdir())  # nothing copied, nothing started
