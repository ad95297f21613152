"""The remote path's trust rules, each planted as a second user would and refused: the
login node's folders (hpc_ddp/remote/place.py), the laptop's handle and its fields
(hpc_ddp/remote/handle.py, trust.py), what a snapshot leaves out (snapshot.py). The whole
path over SSH with a real second user: tests/cluster/test_remote_trust.py."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from hpc_ddp.errors import UserError
from hpc_ddp.remote import handle, place, snapshot
from hpc_ddp.remote.submit_remote import env_names

OTHER = 12345  # a uid that is not ours (the tests run as root, see conftest)


def _archive(files: dict[str, str]) -> tuple[bytes, str]:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text.encode()))
    data = buffer.getvalue()
    import hashlib

    return data, hashlib.sha256(data).hexdigest()[:16]


def test_a_snapshot_is_unpacked_marked_and_then_reused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    data, digest = _archive({"train.py": "print('mine')\n"})
    assert place.check(str(root), digest)["present"] is False
    assert root.stat().st_mode & 0o777 == 0o700  # made private
    place.unpack(str(root), digest, data)
    copy = root / "code" / digest
    assert (copy / "train.py").read_text() == "print('mine')\n"
    assert json.loads((copy / place.MARKER).read_text()) == {"digest": digest,
                                                              "uid": os.geteuid()}
    assert place.check(str(root), digest)["present"] is True
    assert [p.name for p in (root / "code").iterdir()] == [digest]  # no leftovers


def test_an_archive_that_is_not_its_digest_is_refused(tmp_path: Path) -> None:
    data, digest = _archive({"a.py": "x"})
    other, _ = _archive({"a.py": "y"})
    with pytest.raises(UserError, match="is not that snapshot"):
        place.unpack(str(tmp_path / "root"), digest, other)
    assert not (tmp_path / "root" / "code" / digest).exists()


def test_a_shared_root_is_refused_with_the_fix(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(UserError) as refused:
        place.check(str(shared), "0" * 16)
    assert "writable by others" in refused.value.message
    assert "a folder of your own" in refused.value.message
    assert not (shared / "code").exists()  # nothing made there


@pytest.mark.parametrize("planted", ["code_of_another", "snapshot_of_another",
                                     "snapshot_link", "runs_of_another", "root_of_another"])
def test_what_another_user_planted_on_the_chain_is_refused(tmp_path: Path,
                                                            planted: str) -> None:
    root = tmp_path / "root"
    data, digest = _archive({"hpc_ddp/__init__.py": "open('/tmp/x', 'w')\n"})
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    root.mkdir()
    if planted == "root_of_another":
        os.chown(root, OTHER, OTHER)
    elif planted == "code_of_another":
        (root / "code").mkdir()
        os.chown(root / "code", OTHER, OTHER)
    elif planted == "runs_of_another":
        (root / "runs").mkdir()
        os.chown(root / "runs", OTHER, OTHER)
    elif planted == "snapshot_of_another":
        (root / "code" / digest).mkdir(parents=True)
        (root / "code" / digest / place.MARKER).write_text(
            json.dumps({"digest": digest, "uid": os.geteuid()}))
        os.chown(root / "code" / digest, OTHER, OTHER)
    else:  # a link where the snapshot should be, to a whole copy made elsewhere
        (root / "code").mkdir()
        place.unpack(str(theirs), digest, data)
        (root / "code" / digest).symlink_to(theirs / "code" / digest)
    with pytest.raises(UserError) as refused:
        place.check(str(root), digest)
    said = refused.value.message
    assert "not yours" in said or "symbolic link" in said, said
    with pytest.raises(UserError):
        place.unpack(str(root), digest, data)


def test_a_copy_cut_short_or_marked_by_another_uid_is_made_again(tmp_path: Path) -> None:
    root = tmp_path / "root"
    data, digest = _archive({"train.py": "print('mine')\n"})
    cut = root / "code" / digest
    cut.mkdir(parents=True, mode=0o750)
    (cut / "train.py").write_text("print('planted')\n")  # no marker: not whole
    assert place.check(str(root), digest)["present"] is False
    place.unpack(str(root), digest, data)
    assert (cut / "train.py").read_text() == "print('mine')\n"
    (cut / place.MARKER).write_text(json.dumps({"digest": digest, "uid": OTHER}))
    assert place.check(str(root), digest)["present"] is False


def test_a_job_json_is_read_only_from_a_run_dir_of_ours(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.json").write_text('{"job_id": "42"}')
    assert place.job_id(str(run)) == "42"
    os.chown(run / "job.json", OTHER, OTHER)
    assert place.job_id(str(run)) is None
    os.chown(run / "job.json", 0, 0)
    os.chown(run, OTHER, OTHER)
    assert place.job_id(str(run)) is None


def test_the_login_nodes_command_answers_one_json_line(tmp_path: Path) -> None:
    import sys

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    done = subprocess.run([sys.executable, "-P", "-m", "hpc_ddp.remote.place", "check",
                           str(shared), "0" * 16], capture_output=True, timeout=60,
                          cwd=Path(__file__).parents[2], check=False)
    assert done.returncode == 2, done.stderr
    with pytest.raises(UserError, match="writable by others"):
        place.answer(done.stdout)


# -- the laptop: a handle ------------------------------------------------------------------

def _handle(folder: Path, **fields: object) -> None:
    record = {"host": "login", "remote_dir": "/r/runs/x", "snapshot": "0" * 16,
              "python": ["python3"], "ssh_config": None, "job_id": "7", "sweep": False,
              "root": "/r", "secrets": []}
    record.update(fields)
    folder.mkdir(parents=True, exist_ok=True, mode=0o750)
    (folder / handle.FILE).write_text(json.dumps(record))


@pytest.fixture
def marker_ssh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An ``ssh`` on PATH that leaves a marker when anything runs it."""
    marker = tmp_path / "ran"
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {marker}\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    return marker


@pytest.mark.parametrize("plant", [
    "foreign_file", "foreign_folder", "group_writable_folder", "linked_file",
    "python_shell", "python_two_words", "host_option", "foreign_ssh_config",
    "writable_ssh_config", "secret_names"])
def test_a_planted_handle_is_refused_before_anything_runs(
        tmp_path: Path, marker_ssh: Path, plant: str) -> None:
    folder = tmp_path / "outputs" / "h1"
    config = tmp_path / "her_ssh_config"
    config.write_text("Host *\n  ProxyCommand touch /tmp/pwned\n")
    fields: dict[str, object] = {
        "python_shell": {"python": ["sh", "-c", "touch /tmp/pwned"]},
        "python_two_words": {"python": ["python3", "-c"]},
        "host_option": {"host": "-oProxyCommand=touch /tmp/pwned"},
        "foreign_ssh_config": {"ssh_config": str(config)},
        "writable_ssh_config": {"ssh_config": str(config)},
        "secret_names": {"secrets": ["HOME; id"]},
    }.get(plant, {})
    _handle(folder, **fields)
    if plant == "foreign_file":
        os.chown(folder / handle.FILE, OTHER, OTHER)
    elif plant == "foreign_folder":
        os.chown(folder, OTHER, OTHER)
    elif plant == "group_writable_folder":
        folder.chmod(0o770)
    elif plant == "linked_file":
        (folder / handle.FILE).rename(tmp_path / "elsewhere.json")
        (folder / handle.FILE).symlink_to(tmp_path / "elsewhere.json")
    elif plant == "foreign_ssh_config":
        os.chown(config, OTHER, OTHER)
    elif plant == "writable_ssh_config":
        config.chmod(0o666)
    with pytest.raises(UserError) as refused:
        handle.read(folder)
    assert "remote.json" in refused.value.message and "Fix:" in refused.value.message
    code = handle.forwarded("status", [str(folder)], io.StringIO())
    assert code == 2
    from hpc_ddp.remote.run import RemoteRun

    with pytest.raises(UserError):
        RemoteRun(folder)
    assert not marker_ssh.exists()  # no ssh (and so no ProxyCommand) ever ran


def test_a_handle_of_ours_is_read(tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text("Host login\n")
    config.chmod(0o600)
    _handle(tmp_path / "h", ssh_config=str(config), secrets=["HF_TOKEN"])
    record = handle.read(tmp_path / "h")
    assert record is not None and record.python == ["python3"] and record.job_id == "7"


def test_a_handle_is_never_written_into_a_folder_of_another(tmp_path: Path) -> None:
    folder = tmp_path / "premade"
    folder.mkdir()
    os.chown(folder, OTHER, OTHER)
    with pytest.raises(UserError, match="not yours"):
        handle.write(folder, handle.Handle("login", "/r", "0" * 16, ["python3"]))
    assert not (folder / handle.FILE).exists()


# -- the snapshot: what it leaves out --------------------------------------------------------

def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


@pytest.mark.parametrize("in_git", [False, True])
def test_secret_looking_files_are_left_out_and_named(tmp_path: Path, in_git: bool) -> None:
    root = tmp_path / "p"
    files = {"train.py": "x", ".env": "HF_TOKEN=s", ".env.local": "s", ".netrc": "s",
             ".ssh/id_ed25519": "k", "certs/server.key": "k", "conf/model.yaml": "a: 1",
             "committed.pem": "public cert"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    if in_git:
        _git(root, "init", "-q")
        _git(root, "add", "train.py", "committed.pem")
    left: list[str] = []
    kept = snapshot.project_files(root, left)
    assert left == sorted({".env", ".env.local", ".netrc", ".ssh/id_ed25519",
                           "certs/server.key", *([] if in_git else ["committed.pem"])})
    assert set(kept) == set(files) - set(left)
    assert "train.py" in kept and "conf/model.yaml" in kept


def test_every_variable_the_command_reads_is_sent(tmp_path: Path) -> None:
    conf = tmp_path / "conf" / "model"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_text("width: ${oc.env:MY_WIDTH,8}\n")
    names = env_names(["app.path=${oc.env:DATA_ROOT}", "optim.lr=0.1,0.2"],
                      ["--hf-token", "${oc.env:HPC_DDP_SECRET_ARG_HF_TOKEN}"],
                      str(tmp_path / "conf"))
    assert names == {"DATA_ROOT", "HPC_DDP_SECRET_ARG_HF_TOKEN", "MY_WIDTH"}


# -- a command there ends with its connection (hpc_ddp/remote/tether.py) ---------------------

HELD = ("import time; from hpc_ddp.remote.tether import hold; hold(silence_s={s}); "
        "print('held', flush=True); time.sleep(120)")


def _held(silence_s: float) -> subprocess.Popen[bytes]:
    import sys

    proc = subprocess.Popen([sys.executable, "-c", HELD.format(s=silence_s)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            cwd=Path(__file__).parents[2])
    assert proc.stdout is not None and proc.stdout.readline() == b"held\n"
    return proc


def test_a_held_command_ends_when_its_input_ends() -> None:
    import signal

    proc = _held(60.0)
    assert proc.stdin is not None
    proc.stdin.close()  # the laptop's ssh is gone
    assert proc.wait(timeout=30) == -signal.SIGTERM


def test_a_held_command_lives_on_heartbeats_and_ends_on_silence() -> None:
    import signal
    import time

    from hpc_ddp.remote.tether import Heartbeat

    proc = _held(1.0)
    beat = Heartbeat(proc, every_s=0.2)
    time.sleep(3.0)  # three times the silence it tolerates: the heartbeat keeps it
    assert proc.poll() is None
    beat._stopped.set()  # the link is cut: no more lines, the input stays open
    assert proc.wait(timeout=30) == -signal.SIGTERM
    beat.stop()
