"""The remote path against a second user (on the laptop or the cluster) and a hostile login
node, with real parts: tar streams a login node could send into a real handle, a run dir with
another user's files planted in it, socket folders planted where ours would be, ssh_config
files. Planting another user's files needs root (os.chown); those tests are skipped as any
other user."""

from __future__ import annotations

import io
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc_ddp.errors import UserError
from hpc_ddp.remote import handle, results, ssh

OTHER = 12345  # a uid that is not ours
MTIME = 1_700_000_000
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a second user's files needs root")


def _stream(files: dict[str, bytes], links: dict[str, str] | None = None) -> io.BytesIO:
    """A tar stream as a login node could send it (the names exactly as given)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), MTIME
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    out.seek(0)
    return out


@pytest.fixture
def laptop(tmp_path: Path) -> Path:
    folder = tmp_path / "handle"
    handle.write(folder, handle.Handle("login", "/remote/run", "abc", ["python3"]))
    return folder


def _one_line(info: pytest.ExceptionInfo[UserError]) -> str:
    message = info.value.message
    assert "\n" not in message and "Fix:" in message, message
    return message


# -- (5) the laptop writes only results, never its own records, never through a link ---------

def test_a_stream_never_writes_the_handles_own_records(laptop: Path) -> None:
    evil = b'{"host": "evil", "remote_dir": "/x", "snapshot": "s", "python": ["sh"], ' \
           b'"ssh_config": "/tmp/lax"}'
    got = results.receive(_stream({
        "remote.json": evil, "p1/remote.json": evil, ".remote.json.tmp": evil,
        "job.json": b"{}", "p1/sweep.json": b"{}", "logs/x.pkl": b"p", ".ssh/config": b"x",
        "summary.json": b"{}"}), laptop)
    assert (got.files, got.bytes) == (1, 2)
    assert sorted(got.passed_over) == [".remote.json.tmp", ".ssh/config", "job.json",
                                       "logs/x.pkl", "p1/remote.json", "p1/sweep.json",
                                       "remote.json"]
    record = handle.read(laptop)
    assert record is not None and record.host == "login" and record.ssh_config is None
    assert sorted(p.relative_to(laptop).as_posix() for p in laptop.rglob("*")) == [
        "remote.json", "summary.json"]


def test_a_link_named_like_a_result_is_replaced_not_written_through(laptop: Path) -> None:
    before = (laptop / handle.FILE).read_bytes()
    (laptop / "summary.json").symlink_to(handle.FILE)  # tarfile's data filter follows it
    assert results.receive(_stream({"summary.json": b'{"new": 1}'}), laptop).files == 1
    assert (laptop / handle.FILE).read_bytes() == before
    assert not (laptop / "summary.json").is_symlink()
    assert (laptop / "summary.json").read_bytes() == b'{"new": 1}'


@pytest.mark.parametrize("inside", [True, False])
def test_a_linked_folder_is_never_written_through(laptop: Path, tmp_path: Path,
                                                  inside: bool) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (laptop / "logs").symlink_to("." if inside else outside)
    with pytest.raises(UserError) as info:
        results.receive(_stream({"logs/rank0.log": b"a\n"}), laptop)
    assert "logs" in _one_line(info)
    assert not (laptop / "rank0.log").exists() and not (outside / "rank0.log").exists()


# -- (11a) a name out of the folder: one line, the stream refused ----------------------------

@pytest.mark.parametrize("files, links", [
    ({"../x": b"x"}, {}),
    ({"a/../../x": b"x"}, {}),
    ({"/x": b"x"}, {}),
    ({}, {"out": "../../x"}),     # tarfile's data filter: a link out of the folder
    ({}, {"abs": "/etc/passwd"}),
])
def test_a_member_out_of_the_folder_refuses_the_stream_in_one_line(
        laptop: Path, files: dict[str, bytes], links: dict[str, str]) -> None:
    with pytest.raises(UserError) as info:
        results.receive(_stream({"summary.json": b"{}", **files}, links), laptop)
    message = _one_line(info)
    assert "the stream was refused" in message
    assert repr(next(iter({**files, **links}))) in message
    assert not (laptop.parent / "x").exists() and not (laptop / "x").exists()
    assert (laptop / "summary.json").is_file()  # what came before it stays


def test_what_one_side_sends_the_other_receives_and_only_once(tmp_path: Path,
                                                             laptop: Path) -> None:
    run = tmp_path / "run"
    for rel in ("summary.json", "logs/rank0.log", "p1/logs/rank0.log", "job.json"):
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(rel)
    stream = io.BytesIO()
    assert results.send(run, {}, stream) == 3
    stream.seek(0)
    assert results.receive(stream, laptop).files == 3
    assert results.changed(run, results.manifest(laptop)) == []


# -- (7) the login node sends only this user's files -----------------------------------------

def _plant(run: Path) -> None:
    """Ours: summary.json, logs/rank0.log. Not sent: another user's file, a group-writable
    file of ours, our file in another user's folder and in a folder anyone can write."""
    for rel in ("summary.json", "logs/rank0.log", "logs/theirs.log", "tb/gw.txt",
                "other/a.log", "shared/b.log"):
        (run / rel).parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        (run / rel).write_text(rel)
    os.chown(run / "logs" / "theirs.log", OTHER, OTHER)
    os.chmod(run / "tb" / "gw.txt", 0o664)
    os.chown(run / "other", OTHER, OTHER)
    os.chmod(run / "shared", 0o777)


def _names(stream: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(stream), mode="r|") as tar:
        return sorted(m.name for m in tar)


@as_root
def test_the_login_node_sends_only_your_own_files(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o750)
    _plant(run)
    stream, left_out = io.BytesIO(), Counter[str]()
    assert results.send(run, {}, stream, left_out) == 2
    assert _names(stream.getvalue()) == ["logs/rank0.log", "summary.json"]
    assert left_out == {"file(s) not yours": 1, "file(s) writable by others": 1,
                        "folder(s) not yours": 1, "folder(s) writable by others": 1}


@as_root
def test_the_login_node_says_what_it_left_out_in_one_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o750)
    _plant(run)
    done = subprocess.run([sys.executable, "-m", "hpc_ddp.remote.results", str(run)],
                          input=b"{}", capture_output=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert _names(done.stdout) == ["logs/rank0.log", "summary.json"]
    said = done.stderr.decode().splitlines()
    assert len(said) == 1 and said[0].startswith("hpc_ddp: collect left out of "), said
    assert "1 file(s) not yours" in said[0] and "1 folder(s) writable by others" in said[0]


@as_root
@pytest.mark.parametrize("owner, mode, said", [(OTHER, 0o750, "is not yours"),
                                               (None, 0o770, "is writable by others")])
def test_a_run_dir_not_yours_alone_is_refused_in_one_line(
        tmp_path: Path, owner: int | None, mode: int, said: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text("{}")
    os.chmod(run, mode)
    if owner is not None:
        os.chown(run, owner, owner)
    done = subprocess.run([sys.executable, "-m", "hpc_ddp.remote.results", str(run)],
                          input=b"{}", capture_output=True, timeout=120, check=False)
    assert done.returncode == 2 and done.stdout == b""
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: run_dir={run}: {said}"), lines
    assert "Fix:" in lines[0]


@as_root
def test_collect_end_to_end_over_a_local_ssh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Both sides for real: an "ssh" that runs the remote line in a local shell."""
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nfor last; do :; done\nexec sh -c "$last"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    run = tmp_path / "run"
    run.mkdir(mode=0o750)
    _plant(run)
    folder = tmp_path / "my handle"
    handle.write(folder, handle.Handle("login", str(run), "abc", [sys.executable]))
    environ = {"XDG_RUNTIME_DIR": str(tmp_path)}
    done = results.collect(folder, environ=environ)
    assert done.files == 2 and (folder / "logs" / "rank0.log").read_text() == "logs/rank0.log"
    assert not (folder / "logs" / "theirs.log").exists()
    assert "hpc_ddp: collect left out of " in capsys.readouterr().err
    os.chown(run, OTHER, OTHER)
    with pytest.raises(UserError) as info:
        results.collect(folder, environ=environ)
    message = _one_line(info)
    assert "is not yours" in message
    assert f"python -m hpc_ddp.status {shlex.quote(str(folder))}." in message


# -- (10) the sockets' folder: ours alone, whatever another user planted ---------------------

@pytest.fixture
def short() -> Iterator[Path]:
    """A base as short as /tmp's (a socket's path must fit 104 bytes)."""
    base = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    yield base
    shutil.rmtree(base)


def _private(folder: Path) -> None:
    info = os.lstat(folder)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
    assert stat.S_IMODE(info.st_mode) == 0o700


@as_root
def test_a_planted_socket_folder_is_passed_over_for_one_of_ours(short: Path) -> None:
    xdg, home, tmp = short / "x", short / "h", short / "t"
    for folder in (xdg, home):
        folder.mkdir(mode=0o700)
    tmp.mkdir()
    os.chmod(tmp, 0o1777)  # as /tmp
    environ = {"XDG_RUNTIME_DIR": str(xdg), "HOME": str(home)}
    assert ssh.control_dir(environ, tmp) == xdg / "hpc_ddp-ssh"
    os.chown(xdg / "hpc_ddp-ssh", OTHER, OTHER)               # another user's
    found = ssh.control_dir(environ, tmp)
    assert found == tmp / f"hpc_ddp-ssh-{os.getuid()}"
    _private(found)
    os.rmdir(found)
    mine = short / "mine"
    mine.mkdir(mode=0o700)
    found.symlink_to(mine)                                     # a link, even to ours
    found = ssh.control_dir(environ, tmp)
    assert found == home / ".ssh" / "hpc_ddp"
    _private(found)
    _private(home / ".ssh")
    os.chmod(found, 0o770)                                     # ours, but group-writable
    found = ssh.control_dir(environ, tmp)
    assert found.parent == tmp and found.name.startswith("hpc_ddp-ssh-")
    assert found.name != f"hpc_ddp-ssh-{os.getuid()}"
    _private(found)
    assert os.lstat(xdg / "hpc_ddp-ssh").st_uid == OTHER       # nothing planted was touched
    assert (tmp / f"hpc_ddp-ssh-{os.getuid()}").is_symlink()


def test_a_socket_folder_too_long_for_a_socket_is_passed_over(short: Path) -> None:
    longest = Path("/run/user/4294967294") / "hpc_ddp-ssh"    # the largest uid there is
    socket = ssh.Ssh("login", longest, "/home/alice/.ssh/cluster_config").socket()
    assert len(socket.replace("%C", "c" * 40)) + len(".") + 16 < ssh.SUN_PATH
    assert ssh.fits(longest) and ssh.fits(Path("/tmp/hpc_ddp-ssh-4294967294"))
    deep = short / ("d" * 60)
    deep.mkdir()
    found = ssh.control_dir({"XDG_RUNTIME_DIR": str(deep), "HOME": str(deep)}, short)
    assert deep not in found.parents and ssh.fits(found)
    _private(found)


# -- (6) a master opened under one ssh_config is not reused under another --------------------

def test_each_ssh_config_has_its_own_control_socket(tmp_path: Path) -> None:
    lax, strict = tmp_path / "lax", tmp_path / "strict"
    lax.write_text("Host *\n  StrictHostKeyChecking no\n")
    strict.write_text("Host *\n  StrictHostKeyChecking yes\n")

    def socket(config: Path | None) -> str:
        return ssh.Ssh("login", tmp_path, str(config) if config else None).socket()

    assert socket(lax) != socket(strict) != socket(None) != socket(lax)
    assert socket(strict) == socket(strict)
    before = socket(lax)
    lax.write_text("Host *\n  StrictHostKeyChecking yes\n")  # the same file, changed
    assert socket(lax) != before
    assert f"ControlPath={socket(lax)}" in ssh.Ssh("login", tmp_path, str(lax)).argv("true")


# -- a destination is a host, and a suggested command quotes it ------------------------------

@pytest.mark.parametrize("destination", ["-oProxyCommand=touch /tmp/x", "-oProxyCommand=id",
                                         "login host", "login\n", "login\x1b[2J", ""])
def test_a_destination_that_is_not_a_host_is_refused_before_ssh_runs(
        tmp_path: Path, destination: str) -> None:
    with pytest.raises(UserError) as info:
        ssh.Ssh(destination, tmp_path)
    assert _one_line(info).startswith("cluster.remote=")
    assert "\x1b" not in info.value.message
    assert ssh.failure(destination, "Permission denied").message == info.value.message


@pytest.mark.parametrize("stderr", ["Permission denied (publickey).", "something new"])
def test_the_fix_quotes_the_destination_it_suggests_to_run(stderr: str) -> None:
    destination = "alice@login;touch${IFS}/tmp/pwned"
    message = ssh.failure(destination, stderr).message
    assert f"ssh {shlex.quote(destination)}" in message
    assert f"ssh {destination}" not in message
