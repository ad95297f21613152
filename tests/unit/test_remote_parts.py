"""The remote path's parts that need no cluster: which files a snapshot holds and its digest,
what ssh's failures mean, which commands go remote, paths moved into the copy, the
arguments a laptop sends on standard input. tests/cluster/test_remote.py runs it all
against the test cluster's login node."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from hpc_ddp.errors import UserError
from hpc_ddp.remote import handle, intent, snapshot, ssh, submit_remote
from hpc_ddp.submit import args_from_stdin


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('v1')\n")
    (root / "pkg" / "model.py").write_text("X = 1\n")
    (root / ".gitignore").write_text("data/\n*.ckpt\n")
    _git(root, "init", "-q")
    _git(root, "add", "train.py", "pkg/model.py", ".gitignore")
    _git(root, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "one")
    (root / "train.py").write_text("print('v2, not committed')\n")  # changed, uncommitted
    (root / "helper.py").write_text("TAG = 'new'\n")                  # untracked
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"\0" * 1000)             # ignored
    (root / "model.ckpt").write_bytes(b"w")                            # ignored
    handle.write(root / "outputs" / "r1", handle.Handle("h", "/r", "d", ["python3"]))
    handle.write(root / "runs" / "r2", handle.Handle("h", "/r", "d", ["python3"]))
    return root


def test_a_git_tree_is_copied_as_a_commit_now_would_hold_it(project: Path) -> None:
    files = snapshot.project_files(project)
    assert files == [".gitignore", "helper.py", "pkg/model.py", "train.py"]
    packed = snapshot.pack(project, files)
    with tarfile.open(fileobj=io.BytesIO(packed.archive)) as tar:
        member = tar.extractfile("train.py")
        assert member is not None and member.read() == b"print('v2, not committed')\n"
        assert all(m.mtime == 0 and m.uid == 0 for m in tar.getmembers())


def test_the_same_tree_has_the_same_digest_and_a_change_another(project: Path) -> None:
    first = snapshot.pack(project, snapshot.project_files(project))
    (project / "train.py").touch()  # a new mtime only
    again = snapshot.pack(project, snapshot.project_files(project))
    assert first.digest == again.digest and len(first.digest) == snapshot.DIGEST_CHARS
    (project / "helper.py").write_text("TAG = 'newer'\n")
    assert snapshot.pack(project, snapshot.project_files(project)).digest != first.digest


def test_a_plain_folder_skips_caches_and_outputs(tmp_path: Path) -> None:
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "a.pyc").write_bytes(b"x")
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "log").write_text("x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("b")
    (tmp_path / "a.py").write_text("a")
    assert snapshot.project_files(tmp_path) == ["a.py", "sub/b.py"]


def test_a_link_out_of_the_project_is_refused(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "secret.txt").write_text("s")
    (tmp_path / "p" / "link.txt").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(UserError) as info:
        snapshot.pack(tmp_path / "p", ["link.txt"])
    assert "outside the project" in info.value.message and "Fix:" in info.value.message


@pytest.mark.parametrize("stderr, said", [
    ("Host key verification failed.\r\n", "host key is not known"),
    ("@@@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @@@\nHost key verification failed.",
     "has changed"),
    ("root@10.77.0.200: Permission denied (publickey).\r\n", "refused every key"),
    ("ssh: connect to host 10.77.0.1 port 1: Connection refused\r\n", "does not answer"),
    ("ssh: connect to host 10.9.9.9 port 22: Connection timed out\r\n", "does not answer"),
    ("ssh: Could not resolve hostname nohost: Name or service not known\r\n", "does not resolve"),
    ("something new\n", "ssh failed (something new)"),
])
def test_ssh_failures_are_one_line_with_the_fix(stderr: str, said: str) -> None:
    message = ssh.failure("alice@login", stderr).message
    assert said in message and "Fix:" in message and "\n" not in message
    assert message.startswith("cluster.remote=alice@login: ")


def test_every_command_shares_one_connection_and_never_prompts(tmp_path: Path) -> None:
    argv = ssh.Ssh("login", tmp_path, "/cfg").argv("true")
    text = " ".join(argv)
    for option in ("BatchMode=yes", "ControlMaster=auto", f"ControlPath={tmp_path}/%C",
                   "ConnectTimeout=", "ServerAliveInterval="):
        assert option in text
    assert argv[:3] == ["ssh", "-F", "/cfg"] and argv[-2:] == ["login", "true"]


def test_remote_paths_keep_the_home_folder_and_quote_the_rest() -> None:
    assert ssh.remote_path("~/hpc_ddp/code") == '"$HOME"/hpc_ddp/code'
    assert ssh.remote_path("/a b/c") == "'/a b/c'"
    assert ssh.command_line(["python3", "-c", "x y"], "~/r") == (
        "cd \"$HOME\"/r && python3 -c 'x y'")


def test_which_commands_go_remote(tmp_path: Path) -> None:
    assert intent.wanted(["cluster=slurm", "cluster.remote=alice@login"])
    assert not intent.wanted(["cluster.remote=null", "nodes=2"])
    assert not intent.wanted([f"run_dir={tmp_path}", "resume=true"])
    handle.write(tmp_path, handle.Handle("login", "/r", "abc", ["python3"]))
    assert intent.wanted([f"run_dir={tmp_path}", "resume=true"])
    assert not intent.wanted([f"run_dir={tmp_path}"])


def test_paths_of_this_machine_move_into_the_copy(tmp_path: Path) -> None:
    project = tmp_path.resolve()
    (project / "conf").mkdir()
    moved = submit_remote._moved(f"config_dir={project / 'conf'}", project, "~/r/code/abc")
    assert moved == "config_dir=~/r/code/abc/conf"
    assert submit_remote._moved("script=train.py", project, "~/c") == "script=train.py"
    with pytest.raises(UserError) as info:
        submit_remote._moved("script=/etc/passwd", project, "~/c")
    assert "outside the project" in info.value.message


def test_the_arguments_come_on_standard_input_with_their_secrets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HPC_DDP_TEST_TOKEN", raising=False)
    sent = ('{"args": ["nodes=2", "model.token=${oc.env:HPC_DDP_TEST_TOKEN}"], '
            '"script_args": ["--epochs", "3"], "multirun": true, '
            '"env": {"HPC_DDP_TEST_TOKEN": "s3cret"}}')
    args = args_from_stdin(io.StringIO(sent))
    assert args == ["-m", "nodes=2", "model.token=${oc.env:HPC_DDP_TEST_TOKEN}", "--",
                    "--epochs", "3"]
    assert os.environ["HPC_DDP_TEST_TOKEN"] == "s3cret"  # monkeypatch takes it away again


FAKE_SSH = """#!/usr/bin/env python3
import sys
from pathlib import Path
calls = Path(sys.argv[0]).with_name("calls")
n = len(calls.read_text().splitlines()) if calls.exists() else 0
with calls.open("a") as f:
    f.write(sys.argv[-1] + "\\n")
line = "2026-12-04 20:04:{:02d}.000 [rank 0 node1] OUT step {}"
if n == 0:  # the first connection: three lines, then the link dies
    for i in (1, 2, 3):
        print(line.format(i, i), flush=True)
    sys.stderr.write("client_loop: send disconnect: Broken pipe\\n")
    sys.exit(255)
# again, from the minute of the last line printed: two lines seen already, then new ones
for i in (2, 3, 4):
    print(line.format(i, i), flush=True)
print("run ended", flush=True)
"""


def test_a_follow_that_loses_its_connection_goes_on_from_its_last_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text(FAKE_SSH)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(handle, "RECONNECT_S", 0.0)
    run = tmp_path / "handle"
    handle.write(run, handle.Handle("login", "/remote/run", "abc", ["python3"]))
    out = io.StringIO()
    code = handle.forward("logs", [str(run), "--follow"], out, {"XDG_RUNTIME_DIR": str(tmp_path)})
    assert code == 0
    shown = out.getvalue().splitlines()
    steps = [s.rsplit(" ", 1)[1] for s in shown if " OUT step " in s]
    assert steps == ["1", "2", "3", "4"], shown
    assert any("connection to login was lost (the run goes on there)" in s for s in shown)
    assert any(s == "hpc_ddp: reconnected to login; going on." for s in shown)
    assert shown[-1] == "run ended"
    first, second = (tmp_path / "bin" / "calls").read_text().splitlines()
    assert "hpc_ddp.logs /remote/run --follow" in first and "--since" not in first
    assert second.endswith("--since '2026-12-04 20:04'"), second


def test_a_status_through_a_handle_runs_where_the_run_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    said = tmp_path / "line"
    fake.write_text(f"#!/bin/sh\nfor last; do :; done\necho \"$last\" > {said}\n"
                    "echo \"ran: $last\"\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    run = tmp_path / "handle"
    handle.write(run, handle.Handle("login", "~/hpc_ddp/runs/x", "abc", ["/v/bin/python"]))
    out = io.StringIO()
    code = handle.forward("status", ["--interval", "2", str(run), "--json"], out,
                          {"XDG_RUNTIME_DIR": str(tmp_path)})
    assert code == 3  # the remote command's own exit code
    # held there: it ends with this connection (remote/tether.py)
    assert said.read_text() == ("/v/bin/python -P -m hpc_ddp.remote.tether hpc_ddp.status "
                                "--interval 2 '~/hpc_ddp/runs/x' --json\n")
    # what it prints names the run by its handle here (a resume line pasted here works)
    assert out.getvalue() == ("ran: /v/bin/python -P -m hpc_ddp.remote.tether hpc_ddp.status "
                              f"--interval 2 {run} --json\n")
    assert handle.forward("status", [str(tmp_path)], out, {}) is None  # not a handle


def test_collect_sends_the_results_and_then_only_what_changed(tmp_path: Path) -> None:
    import io
    import tarfile

    from hpc_ddp.remote import results

    run = tmp_path / "run"
    for rel, text in {"summary.json": "{}", "events.jsonl": "{}\n", "logs/rank0.log": "a\n",
                      "tb/events.out.tfevents.1": "x", "checkpoints/step_1.pt": "w",
                      "submitit/1_0_submitted.pkl": "p", "job.json": "{}", "sweep.json": "{}",
                      "p1/logs/rank0.log": "b\n", "p1/job.json": "{}"}.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(text)
    stream = io.BytesIO()
    assert results.send(run, {}, stream) == 5
    stream.seek(0)
    laptop = tmp_path / "laptop"
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        tar.extractall(laptop, filter="data")
    assert sorted(p.relative_to(laptop).as_posix() for p in laptop.rglob("*") if p.is_file()) \
        == ["events.jsonl", "logs/rank0.log", "p1/logs/rank0.log", "summary.json",
            "tb/events.out.tfevents.1"]
    # What the laptop has is not sent again; a grown log is.
    have = results.manifest(laptop)
    assert results.changed(run, have) == []
    with open(run / "logs" / "rank0.log", "a") as log:
        log.write("more\n")
    assert results.changed(run, have) == [run / "logs" / "rank0.log"]
