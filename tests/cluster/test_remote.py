"""From a laptop, over SSH: submit, follow, read the logs of a run on the test cluster.

The login node is a network namespace of its own on the cluster's bridge running OpenSSH's
sshd (hpc_ddp/testcluster/login.py). The "laptop" is this machine without the cluster's
Slurm configuration and with the remote root hidden (a private mount namespace with a tmpfs
over it): nothing can work by reading the cluster's files directly or by asking its
controller; everything goes over the connection.
"""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from hpc_ddp.rank.services import checkpoint
from hpc_ddp.remote import handle as handles
from hpc_ddp.testcluster.cluster import TestCluster
from hpc_ddp.testcluster.login import LoginNode, missing
from tests.cluster.slurm_final import assert_completed, final_rows
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


def on_laptop(hidden: Path, argv: list[str], sockets: str | None = None) -> tuple[
        list[str], dict[str, str]]:
    """``python argv`` as on a laptop: no SLURM_CONF, and ``hidden`` (the cluster's storage)
    covered by an empty tmpfs in a mount namespace of its own. ``sockets``: a folder for
    ssh's shared connections (one of its own: a connection that an earlier call left open
    to the same host would otherwise be reused)."""
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    env["PYTHONPATH"] = str(REPO)
    if sockets:
        env["XDG_RUNTIME_DIR"] = sockets
    command = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs none "{hidden}" && exec "$@"',
               "sh", sys.executable, *argv]
    return command, env


def laptop(hidden: Path, module: str, args: list[str], cwd: Path, timeout: float = 300,
           sockets: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m hpc_ddp.<module> args`` as on a laptop (:func:`on_laptop`)."""
    command, env = on_laptop(hidden, ["-m", f"hpc_ddp.{module}", *args], sockets)
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
    # the lines that follow a submission are the laptop's, with its handle's path only
    assert "Run.from_dir" not in said and "follow:" not in said, said
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
        sockets = tempfile.mkdtemp(prefix="s", dir="/tmp")
        done = laptop(remote, "submit", [*base, f"cluster.ssh_config={path}"], project, 120,
                      sockets=sockets)
        said[name] = done.stderr
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, (
            name, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr and "Fix:" in done.stderr
        # nothing left running: no ssh (a shared connection's master) outlives the failure
        left = subprocess.run(["pgrep", "-af", sockets], capture_output=True, text=True)
        assert not left.stdout.strip(), (name, left.stdout)
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


SEQPROJECT = REPO / "examples" / "seqproject"
LOOP = ["cluster=slurm", "entry=seqproj.loop:main", "app.checkpoint_every=100",
        "trainer.stop_check_interval=2", "trainer.collective_timeout_s=30"]


def _seqproject(root: Path) -> Path:
    """The example project (its own loop, model and configs) as a user's git work tree."""
    shutil.copytree(SEQPROJECT, root, ignore=shutil.ignore_patterns("__pycache__", "outputs"))
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "one")
    return root


class Following:
    """``logs HANDLE --follow`` on the laptop, its lines gathered as they come."""

    def __init__(self, remote: Path, handle: Path, cwd: Path) -> None:
        command, env = on_laptop(remote, ["-m", "hpc_ddp.logs", str(handle), "--rank", "0",
                                          "--follow"])
        self.proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def until(self, text: str, timeout: float, after: int = 0) -> int:
        """The index of the first line from ``after`` on that holds ``text``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [i for i, line in enumerate(self.lines) if i >= after and text in line]
            if found:
                return found[0]
            assert self.proc.poll() is None or self.reader.is_alive(), "".join(self.lines)
            time.sleep(0.2)
        raise AssertionError(f"no {text!r} within {timeout:.0f} s:\n" + "".join(self.lines))

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=30)


def _saved_step(run_dir: Path) -> int:
    """The step of the run's latest checkpoint (0: none yet)."""
    saved = checkpoint.latest_path(run_dir / "checkpoints")
    return (checkpoint.step_of(saved) or 0) if saved else 0


def test_a_laptop_follows_through_a_cut_stops_resumes_collects_sweeps_and_cancels(
        login: LoginNode, slurm_env: dict[str, str], tmp_path: Path) -> None:
    """The user's own loop (examples/seqproject) from a laptop: follow it while the login
    node's link goes down and up (the job unaffected), stop it with a checkpoint, edit the
    laptop's code and resume (the run's own snapshot runs), collect the results, the Python
    API's remote form, a 4-point sweep, a cancel."""
    remote = tmp_path / "cluster_storage"
    remote.mkdir()
    project = _seqproject(tmp_path / "laptop" / "seqproject")
    where = ["cluster.remote=login", f"cluster.ssh_config={login.ssh_config}",
             f"cluster.remote_root={remote}", f"cluster.python={sys.executable}"]
    common = ["--config-dir", "conf", *LOOP, "nodes=2", *where]
    sub = laptop(remote, "submit", [*common, "app.steps=100000", "run_dir=runs/loop"], project)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    handle = project / "runs" / "loop"
    record = handles.read(handle)
    assert record is not None and record.job_id
    there = Path(record.remote_dir)

    # The connection cut under a follow: the follow says so, reconnects and goes on; the
    # job trains on all along.
    follow = Following(remote, handle, project)
    try:
        follow.until("INFO checkpoint", 120)
        login.link(False)
        cut_at = _saved_step(there)
        lost = follow.until("connection to login was lost", 60)
        assert _saved_step(there) > cut_at  # training goes on without the login node
        login.link(True)
        back = follow.until("reconnected to login", 60, after=lost)
        follow.until("INFO checkpoint", 60, after=back)
    finally:
        login.link(True)
        follow.end()

    # Stop: a checkpoint at a step the ranks agree on, and the line that continues it.
    stop = laptop(remote, "status", [str(handle), "--stop"], project, timeout=200)
    assert stop.returncode == 0 and "Continue with:" in stop.stdout, stop.stdout + stop.stderr
    # the resume line names the handle here (pasted here, it works), not the run dir there
    resume_line = stop.stdout[stop.stdout.index("Continue with:"):].splitlines()[0]
    assert f"run_dir={handle}" in resume_line and str(remote) not in resume_line, resume_line
    stopped = _saved_step(there)
    assert stopped > 0, stop.stdout

    # The laptop's code changes (this copy would fail at once); the resume runs the snapshot
    # the run started with, to the end.
    loop = project / "seqproj" / "loop.py"
    loop.write_text(loop.read_text().replace(
        "    app = ctx.app", "    raise RuntimeError('edited on the laptop')\n    app = ctx.app"))
    resumed = laptop(remote, "submit", ["run_dir=runs/loop", "resume=true",
                                        f"app.steps={stopped + 20}", "wait=true"], project)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "copying the code" not in resumed.stdout
    again = handles.read(handle)
    assert again is not None and again.snapshot == record.snapshot
    assert again.job_id and again.job_id != record.job_id
    assert_completed(again.job_id, slurm_env, resumed.stdout)
    summary = json.loads((there / "summary.json").read_text())
    assert summary["global_step"] == stopped + 20, summary

    # The results on the laptop: summary, events, TensorBoard files, logs; no checkpoint;
    # a second collect copies nothing.
    got = laptop(remote, "collect", [str(handle)], project)
    assert got.returncode == 0 and "tensorboard --logdir" in got.stdout, got.stdout + got.stderr
    assert json.loads((handle / "summary.json").read_text()) == summary
    assert list((handle / "tb").rglob("events.out.tfevents.*"))
    assert (handle / "logs" / "rank1.log").read_text() == (there / "logs" / "rank1.log"
                                                           ).read_text()
    assert not (handle / "checkpoints").exists() and not (handle / "job.json").exists()
    nothing = laptop(remote, "collect", [str(handle)], project)
    assert "collected 0 new" in nothing.stdout, nothing.stdout + nothing.stderr
    exported = laptop(remote, "collect", [str(handle), "--checkpoint"], project)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    model = torch.load(handle / "exported" / "model.pt", weights_only=True)
    assert model["hpc_ddp"]["step"] == stopped + 20, model.keys()

    # The Python API in a notebook on the laptop: the same call, a remote run's handle.
    loop.write_text(loop.read_text().replace(
        "    raise RuntimeError('edited on the laptop')\n", ""))
    notebook = (
        "import hpc_ddp, json\n"
        f"run = hpc_ddp.submit({[*LOOP, 'nodes=2', *where, 'app.steps=20', 'run_dir=runs/api']!r},"
        " config_dir='conf')\n"
        "summary = run.wait(progress=False)\n"
        "again = hpc_ddp.open_run('runs/api')\n"
        "print(json.dumps({'step': summary['global_step'], 'kind': again.kind, "
        "'state': again.state, 'losses': len(again.scalars('loss')['loss'])}))\n")
    command, env = on_laptop(remote, ["-c", notebook])
    api = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert api.returncode == 0, api.stdout + api.stderr
    said = json.loads(api.stdout.strip().splitlines()[-1])
    assert said == {"step": 20, "kind": "remote", "state": "COMPLETED", "losses": 2}, said

    # A 4-point sweep: one submit, arrays on the cluster, watched from the laptop.
    sweep = laptop(remote, "submit", ["-m", "--config-dir", "conf", *LOOP, "nodes=1", *where,
                                      "app.steps=10", "app.lr=0.003,0.002,0.001,0.0005",
                                      "sweep.max_array_size=2", "sweep.dir=runs/sweep"],
                   project)
    assert sweep.returncode == 0, sweep.stdout + sweep.stderr
    watched = laptop(remote, "status", [str(project / "runs" / "sweep"), "--watch",
                                        "--interval", "2"], project)
    assert watched.returncode == 0, watched.stdout + watched.stderr
    swept = handles.read(project / "runs" / "sweep")
    assert swept is not None and swept.sweep
    manifest = json.loads((Path(swept.remote_dir) / "sweep.json").read_text())
    assert len(manifest["points"]) == 4
    for point in manifest["points"]:
        assert json.loads((Path(point["run_dir"]) / "summary.json").read_text())[
            "global_step"] == 10

    # A cancel from the laptop: the job ends CANCELLED in Slurm's accounts.
    long = laptop(remote, "submit", [*common, "app.steps=100000", "run_dir=runs/cancelled"],
                  project)
    assert long.returncode == 0, long.stdout + long.stderr
    victim = handles.read(project / "runs" / "cancelled")
    assert victim is not None and victim.job_id
    cancel = laptop(remote, "status", [str(project / "runs" / "cancelled"), "--cancel"],
                    project)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    rows = final_rows(victim.job_id, slurm_env, timeout_s=120)
    assert rows and rows[0][1].startswith("CANCELLED"), rows


# -- a second user on the same machines (docs/security.md#the-remote-path) ------------------

OTHER_USER = "hpcddp_other"


def _other_user() -> str:
    """A second local user (made once): what she plants, she plants as herself."""
    if subprocess.run(["id", OTHER_USER], capture_output=True, check=False).returncode != 0:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", OTHER_USER],
                       check=True, capture_output=True)
    return OTHER_USER


def _as_other(script: str) -> None:
    subprocess.run(["runuser", "-u", _other_user(), "--", "sh", "-c", script], check=True,
                   capture_output=True, timeout=60)


@pytest.fixture
def shared_places() -> Iterator[tuple[Path, Path]]:
    """(a cluster folder, a laptop folder), each with a group-scratch-like ``shared`` folder
    in it (mode 1777): folders the second user can reach, unlike pytest's own (0700)."""
    base = Path(tempfile.mkdtemp(prefix="hpc_ddp_shared_", dir="/tmp"))
    try:
        places = []
        for side in ("cluster", "laptop"):
            (base / side / "shared").mkdir(parents=True)
            (base / side).chmod(0o755)
            (base / side / "shared").chmod(0o1777)
            places.append(base / side)
        base.chmod(0o755)
        yield places[0], places[1]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_what_a_second_user_plants_on_the_remote_path_never_runs(
        login: LoginNode, slurm_env: dict[str, str], shared_places: tuple[Path, Path]) -> None:
    """A planted snapshot (her code/<digest>, her code/, a link), a shared remote root, a
    planted handle on the laptop (her ssh_config's ProxyCommand, her interpreter) and a
    secret in an sbatch option: each refused in one line, exit 2, her marker never made;
    the victim's own run, from a folder of his own, completes."""
    from hpc_ddp.remote import snapshot

    cluster, laptop_side = shared_places
    shared = cluster / "shared"
    project = _project(laptop_side / "project")
    digest = snapshot.pack(project, snapshot.project_files(project)).digest
    marker = shared / "PWNED"
    payload = f"open({str(marker)!r}, 'a').write('ran as you\\n')\n"
    where = ["cluster=slurm", "nodes=1", "script=train.py", "cluster.remote=login",
             f"cluster.ssh_config={login.ssh_config}", f"cluster.python={sys.executable}",
             "dry_run=true"]

    def refused(root: Path, fragment: str, *extra: str) -> None:
        done = laptop(cluster, "submit", [*where, f"cluster.remote_root={root}", *extra],
                      project)
        said = done.stdout + done.stderr
        assert done.returncode == 2, said
        assert "Traceback" not in said and fragment in done.stderr, said
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert not marker.exists(), marker.read_text()

    # 1. The shared folder itself as the root: writable by others.
    refused(shared, "writable by others")
    # 2. Her root, with her snapshot of the victim's (public, so predictable) tree in it.
    _as_other(f"mkdir -p {shared}/alice/code/{digest}/hpc_ddp && "
              f"printf %s {shlex.quote(payload)} > {shared}/alice/code/{digest}/hpc_ddp/"
              f"__init__.py && cp {shared}/alice/code/{digest}/hpc_ddp/__init__.py "
              f"{shared}/alice/code/{digest}/train.py && "
              f"echo '{{\"digest\": \"{digest}\", \"uid\": 0}}' > "
              f"{shared}/alice/code/{digest}/.complete")
    refused(shared / "alice", "not yours")
    # 3. The victim's own root, but a code/ that is hers (as it would be had the root once
    # been writable to her): she could swap his copy for hers between two submits.
    mine = shared / "victim"
    mine.mkdir(mode=0o755)
    (mine / "code").mkdir()
    os.chown(mine / "code", *_ids())
    refused(mine, "not yours")
    # 4. A link where the snapshot should be, to her copy.
    (mine / "code").rmdir()
    (mine / "code").mkdir(mode=0o755)
    (mine / "code" / digest).symlink_to(shared / "alice" / "code" / digest)
    refused(mine, "symbolic link")
    (mine / "code" / digest).unlink()

    # A handle she wrote in a project folder shared on the laptop, naming her ssh_config
    # (its ProxyCommand makes the marker) or her interpreter; each command refuses it.
    hers = laptop_side / "shared" / "outputs" / "h1"
    config = laptop_side / "shared" / "her_ssh_config"
    _as_other(f"mkdir -p {hers} && chmod 755 {hers} && "
              f"printf 'Host *\\n  ProxyCommand touch {marker}\\n' > {config}")
    for fields in ({"ssh_config": str(config)}, {"python": ["sh", "-c", f"touch {marker}"]}):
        record = {"host": "login", "remote_dir": str(mine / "runs" / "x"), "snapshot": digest,
                  "python": [sys.executable], "ssh_config": str(login.ssh_config),
                  "job_id": None, "sweep": False, "root": str(mine), "secrets": [], **fields}
        _as_other(f"printf %s {shlex.quote(json.dumps(record))} > {hers}/remote.json")
        for module, args in (("status", [str(hers)]), ("logs", [str(hers), "--tail", "3"]),
                             ("collect", [str(hers)]),
                             ("submit", [f"run_dir={hers}", "resume=true"])):
            done = laptop(cluster, module, args, laptop_side)
            assert done.returncode == 2, (module, done.stdout, done.stderr)
            assert "remote.json" in done.stderr and "Traceback" not in done.stderr, (
                module, done.stderr)
        opened = f"import hpc_ddp; hpc_ddp.open_run({str(hers)!r})"
        command, env = on_laptop(cluster, ["-c", opened])
        api = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120,
                             check=False)
        assert api.returncode != 0 and "remote.json" in api.stderr, api.stderr
        assert not marker.exists()

    # 5. A secret in an sbatch option (scontrol show job shows it to every user): refused
    # here, before anything is copied; nothing of it anywhere on the cluster.
    refused(mine, "sbatch_extra", "+cluster.sbatch_extra.comment=password=hunter2")
    assert not (mine / "runs").exists() or not any((mine / "runs").iterdir())

    # The victim's own run, in a root of his own (made by the submit, 0700), is unaffected.
    own = shared / "victim_own"
    done = laptop(cluster, "submit", [*where[:-1], f"cluster.remote_root={own}",
                                      "run_dir=runs/mine", "wait=true"], project)
    assert done.returncode == 0, done.stdout + done.stderr
    record = handles.read(project / "runs" / "mine")
    assert record is not None and record.job_id and record.snapshot == digest
    assert_completed(record.job_id, slurm_env, done.stdout)
    assert own.stat().st_mode & 0o777 == 0o700
    assert json.loads((own / "code" / digest / ".complete").read_text())["uid"] == 0
    # A run dir she made, with a job.json of hers: the submit there is refused, and no
    # handle is left on the laptop (her job.json does not say that anything was submitted).
    premade = shared / "premade"
    _as_other(f"mkdir -m 755 {premade} && echo '{{\"job_id\": \"1\"}}' > "
              f"{premade}/job.json")
    into = laptop(cluster, "submit", [*where[:-1], f"cluster.remote_root={own}",
                                      f"run_dir={premade}"], project)
    assert into.returncode == 2 and "not yours" in into.stderr, into.stdout + into.stderr
    assert not list((project / "outputs").rglob("remote.json")), into.stdout
    assert not marker.exists()


def _ids() -> tuple[int, int]:
    entry = pwd.getpwnam(_other_user())
    return entry.pw_uid, entry.pw_gid


ECHO_SCRIPT = """\
import os
import sys

import torch.distributed as dist

dist.init_process_group("gloo")
token_ok = sys.argv[1:] == ["--hf-token", "tok-" + "8391"]
print(f"args ok {token_ok} laptop value {os.environ.get('FROM_LAPTOP')}", flush=True)
dist.destroy_process_group()
"""


def test_every_documented_way_of_passing_a_value_works_over_ssh(
        login: LoginNode, slurm_env: dict[str, str], tmp_path: Path) -> None:
    """A ``${oc.env:NAME}`` of the laptop's (not a secret) and a literal secret in a script's
    arguments reach the job over SSH as they do on the login node."""
    remote = tmp_path / "cluster_storage"
    remote.mkdir()
    project = _project(tmp_path / "project")
    (project / "echo.py").write_text(ECHO_SCRIPT)
    command, env = on_laptop(remote, [
        "-m", "hpc_ddp.submit", "cluster=slurm", "nodes=1", "script=echo.py",
        "cluster.remote=login", f"cluster.ssh_config={login.ssh_config}",
        f"cluster.remote_root={remote}", f"cluster.python={sys.executable}",
        "+nccl.extra_env.FROM_LAPTOP=${oc.env:LAPTOP_VALUE}", "run_dir=runs/echo",
        "wait=true", "--", "--hf-token", "tok-8391"])
    env["LAPTOP_VALUE"] = "blue-42"
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    record = handles.read(project / "runs" / "echo")
    assert record is not None and record.job_id
    assert_completed(record.job_id, slurm_env, done.stdout)
    log = (Path(record.remote_dir) / "logs" / "rank0.log").read_text()
    assert "args ok True laptop value blue-42" in log, log
    # the secret went on standard input: not in the run's saved overrides or config
    for name in ("overrides.yaml", "config.yaml"):
        assert "tok-8391" not in (Path(record.remote_dir) / name).read_text()


def _ours_on_login(pattern: str) -> list[str]:
    """Processes of ours whose command line matches (the login node's are this machine's:
    its namespaces are for the network and the host name only)."""
    found = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True)
    return [ln for ln in found.stdout.splitlines() if "pgrep" not in ln]


def _until(check: Callable[[], bool], timeout: float, what: str) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"{what} after {timeout:.0f} s"
        time.sleep(0.5)
    return time.monotonic() - started


def test_nothing_of_ours_lingers_on_the_login_node_after_the_laptop_is_gone(
        login: LoginNode, slurm_env: dict[str, str], tmp_path: Path) -> None:
    """A laptop's ``submit ... wait=true`` killed (SIGKILL), and a ``logs --follow`` whose
    link drops: each command there ends by itself; the job goes on; the laptop's shared
    connection ends within its ControlPersist."""
    from hpc_ddp.remote.ssh import PERSIST_S
    from hpc_ddp.remote.tether import SILENCE_S

    remote = tmp_path / "cluster_storage"
    remote.mkdir()
    project = _seqproject(tmp_path / "laptop" / "seqproject")
    sockets = tempfile.mkdtemp(prefix="s", dir="/tmp")
    where = ["cluster.remote=login", f"cluster.ssh_config={login.ssh_config}",
             f"cluster.remote_root={remote}", f"cluster.python={sys.executable}"]
    command, env = on_laptop(remote, ["-m", "hpc_ddp.submit", "--config-dir", "conf", *LOOP,
                                      "nodes=1", *where, "app.steps=100000",
                                      "run_dir=runs/long", "wait=true"], sockets)
    waiting = subprocess.Popen(command, cwd=project, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    there = remote / "runs" / "runs" / "long"
    try:
        _until(lambda: (there / "logs" / "rank0.log").is_file(), 120, "no rank started")
        assert _ours_on_login("hpc_ddp.submit --args-stdin")
        waiting.kill()  # the laptop's command, SIGKILL: nothing of it says goodbye
        waiting.wait(timeout=30)
        ended = _until(lambda: not _ours_on_login("hpc_ddp.submit --args-stdin"), 30,
                       "the submit on the login node still runs")
        job = json.loads((there / "job.json").read_text())["job_id"]
        state = subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%T"], env=slurm_env,
                               capture_output=True, text=True, check=False).stdout.strip()
        assert state == "RUNNING", state  # the job goes on

        # A follow whose link drops for good: the laptop retries, the command there ends.
        command, env = on_laptop(remote, ["-m", "hpc_ddp.logs", str(project / "runs" / "long"),
                                          "--follow"], sockets)
        follow = subprocess.Popen(command, cwd=project, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            _until(lambda: bool(_ours_on_login("hpc_ddp.remote.tether hpc_ddp.logs")), 60,
                   "no follow there")
            login.link(False)
            silent = _until(lambda: not _ours_on_login("hpc_ddp.remote.tether hpc_ddp.logs"),
                            SILENCE_S + 20, "the follow there still runs with its link down")
        finally:
            login.link(True)
            follow.kill()
            follow.wait(timeout=30)
        # A SIGTERM (a closed terminal) once the job is out: said so, the job goes on.
        command, env = on_laptop(remote, ["-m", "hpc_ddp.submit", "--config-dir", "conf", *LOOP,
                                          "nodes=1", *where, "app.steps=100000",
                                          "run_dir=runs/termed", "wait=true"], sockets)
        termed = subprocess.Popen(command, cwd=project, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        other = remote / "runs" / "runs" / "termed"
        _until(lambda: (other / "logs" / "rank0.log").is_file(), 120, "no rank started")
        termed.terminate()
        out, _ = termed.communicate(timeout=60)
        second = json.loads((other / "job.json").read_text())["job_id"]
        assert f"job {second} goes on" in out and "before anything was submitted" not in out, out
        _until(lambda: not _ours_on_login("hpc_ddp.submit --args-stdin"), 30,
               "the submit on the login node still runs")
        for ended_job in (job, second):
            subprocess.run(["scancel", str(ended_job)], env=slurm_env, check=True)
            final_rows(str(ended_job), slurm_env, timeout_s=120)
        # The laptop's shared connection: no command of ours keeps it any more.
        closed = _until(lambda: not _ours_on_login(sockets), PERSIST_S + 30,
                        "the laptop's ssh master still runs")
    finally:
        login.link(True)
        waiting.kill()
    print(f"login node: the killed laptop's submit ended after {ended:.1f} s, the cut "
          f"follow's after {silent:.1f} s; the laptop's ssh master after {closed:.1f} s more")


def test_a_remote_wait_ends_at_once_at_a_job_that_can_never_start(
        login: LoginNode, slurm_env: dict[str, str], tmp_path: Path) -> None:
    """The API's remote form on a job Slurm accepts and never starts (its dependency failed:
    nothing before sbatch can tell): ``wait()`` ends at its first looks with the reason and
    the fix, as a local Run's does (issue 46), not at its timeout."""
    name = "hpc_ddp_i46_never"
    failed = subprocess.run(["sbatch", "--parsable", f"--job-name={name}", "-o", "/dev/null",
                             "--wrap", "exit 1"], env=slurm_env, capture_output=True,
                            text=True, check=True).stdout.strip()
    remote = tmp_path / "cluster_storage"
    remote.mkdir()
    project = _project(tmp_path / "laptop" / "project")
    try:
        final_rows(failed, slurm_env, timeout_s=60)
        overrides = ["cluster=slurm", "nodes=1", "script=train.py", "cluster.remote=login",
                     f"cluster.ssh_config={login.ssh_config}", f"cluster.remote_root={remote}",
                     f"cluster.python={sys.executable}", f"cluster.job_name={name}",
                     f"+cluster.sbatch_extra.dependency=afterok:{failed}", "run_dir=runs/never"]
        notebook = (
            "import time, hpc_ddp\n"
            f"run = hpc_ddp.submit({overrides!r})\n"
            "started = time.monotonic()\n"
            "try:\n"
            "    run.wait(progress=False, timeout=240, poll_s=2)\n"
            "except hpc_ddp.RunFailed as exc:\n"
            "    print(f'{time.monotonic() - started:.0f} s: {exc}')\n")
        command, env = on_laptop(remote, ["-c", notebook])
        api = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True,
                             timeout=300, check=False)
        said = api.stdout.strip().splitlines()
        assert api.returncode == 0 and said, api.stdout + api.stderr
        seconds, _, reason = said[-1].partition(" s: ")
        job = handles.read(project / "runs" / "never")
        assert job is not None and job.job_id
        assert reason.startswith(f"job {job.job_id} on login can never start "
                                 "(DependencyNeverSatisfied): a job it depends on"), said
        assert "cancel this one" in reason, reason
        assert int(seconds) < 120, said  # the scheduler's pass or two, not the timeout
    finally:
        subprocess.run(["scancel", "-n", name], env=slurm_env, check=False)
