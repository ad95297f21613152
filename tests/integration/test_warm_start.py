"""Warm starts (hpc_ddp/rank/warm/): a node's warm process, its forks, and a local run's ranks
forked from it or, when asked, started cold. Real processes and a real warm process; the
signal paths of forked ranks are the local runs' own tests (test_local_run.py, test_detach.py,
all warm by default, each asserting it) and the cluster's (tests/cluster/)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.rank.contract import LAUNCH_ID_ENV
from hpc_ddp.rank.warm import client, wire
from tests.conftest import REPO, command_env

Run = Callable[..., subprocess.CompletedProcess[str]]
SCRIPT = REPO / "tests" / "usercode" / "warm_facts.py"
RUNNER = "hpc_ddp.rank.main.script_runner"


@pytest.fixture(scope="module")
def warm() -> Iterator[tuple[client.Warm, dict[str, str]]]:
    """A warm process of a launch of its own, started from a rank's environment."""
    env = {**command_env(), LAUNCH_ID_ENV: uuid.uuid4().hex[:12], "RANK": "3",
           "CUDA_VISIBLE_DEVICES": "1"}
    link = client.connect(env)
    assert isinstance(link, client.Warm), link
    yield link, env
    link.close()  # the starter waits for it to leave: no client is left
    assert not link.path.exists() and not link.path.with_suffix(".lock").exists()


def _spawn(link: client.Warm, env: dict[str, str], out: Path, *args: str,
           **how: Any) -> tuple[client.WarmProc, Any]:
    read, write = os.pipe()
    stderr = os.fdopen(read, "rb")
    try:
        proc = link.spawn(f"{RUNNER}:main", [str(SCRIPT), str(out), *args],
                          ["script_runner.py", str(SCRIPT), str(out), *args], env,
                          (0, 1, write), stderr=stderr,
                          title=[sys.executable, "-m", RUNNER, str(SCRIPT), str(out), *args],
                          **how)
    finally:
        os.close(write)
    return proc, stderr


def test_the_warm_process_holds_no_cuda_no_rank_and_no_thread_of_its_own(
        warm: tuple[client.Warm, dict[str, str]]) -> None:
    facts = warm[0].describe()
    assert facts["pid"] != os.getpid() and facts["modules"] > 1000  # torch is in
    assert facts["missing"] == []  # every module of the preload imported
    assert facts["cuda_initialized"] is False and facts["devices_open"] == []
    assert facts["process_group"] is False
    assert facts["rank_variables"] == []  # the starter's RANK, CUDA_VISIBLE_DEVICES left out
    assert facts["python_threads"] == 1
    # Its imports' objects frozen, its collector off (server.preload): a fork's collections
    # never walk them; the forks turn it on (below).
    assert facts["gc_frozen"] > 100_000 and facts["gc_enabled"] is False


def test_a_forked_script_sees_a_fresh_interpreter_of_its_own(
        warm: tuple[client.Warm, dict[str, str]], tmp_path: Path) -> None:
    link, env = warm
    out = tmp_path / "facts.json"
    rank_env = {**env, "RANK": "5", "CUDA_VISIBLE_DEVICES": "2", "OMP_NUM_THREADS": "3"}
    proc, stderr = _spawn(link, rank_env, out, "7", pgid=0, sigmask=[signal.SIGUSR1],
                          ignored=[signal.SIGINT])
    assert proc.wait(timeout=120) == 7, stderr.read().decode()
    facts = json.loads(out.read_text())
    assert facts["name"] == "__main__" and facts["main_is_me"]
    assert facts["argv"] == [str(SCRIPT), str(out), "7"]
    assert facts["path0"] == str(SCRIPT.parent)
    assert facts["torch_preloaded"] and facts["sibling_fresh"]
    assert (facts["rank"], facts["cuda_visible"], facts["threads"]) == ("5", "2", 3)
    assert facts["affinity"] == sorted(os.sched_getaffinity(0))
    assert facts["cwd"] == os.getcwd()
    assert facts["sigint_ignored"] and facts["sigterm_default"]
    assert int(signal.SIGUSR1) in facts["blocked"] and facts["own_group"]
    assert facts["note"].startswith("warm: forked from this node's warm process")
    assert facts["cuda_initialized"] is False and facts["gc_enabled"] is True
    # ps and pgrep -f show the command it would have been started with, not the warm one's.
    assert facts["cmdline"] == " ".join([sys.executable, "-m", RUNNER, str(SCRIPT), str(out),
                                         "7"])
    # A second fork of the same warm process imports the script's own module afresh: the
    # first fork's imports stayed in the first fork.
    again = tmp_path / "again.json"
    proc, stderr = _spawn(link, env, again, "0")
    assert proc.wait(timeout=120) == 0, stderr.read().decode()
    assert json.loads(again.read_text())["sibling_fresh"]


def test_a_forked_script_fails_and_dies_of_a_signal_as_python_would(
        warm: tuple[client.Warm, dict[str, str]], tmp_path: Path) -> None:
    link, env = warm
    proc, stderr = _spawn(link, env, tmp_path / "a.json", "raise")
    assert proc.wait(timeout=120) == 1
    said = stderr.read().decode()
    assert "ValueError: the script's own error" in said and "warm_facts.py" in said
    assert "server.py" not in said and "forked.py" not in said  # from the script's frames on
    out = tmp_path / "b.json"
    proc, _ = _spawn(link, env, out, "wait")
    deadline = time.monotonic() + 120
    while not out.exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM


def test_a_client_killed_takes_its_fork_with_it(
        warm: tuple[client.Warm, dict[str, str]], tmp_path: Path) -> None:
    link, env = warm
    out = tmp_path / "facts.json"
    code = ("import os, sys, time\nfrom hpc_ddp.rank.warm import client\n"
            "link = client.connect(os.environ)\n"
            f"proc = link.spawn('{RUNNER}:main', [{str(SCRIPT)!r}, {str(out)!r}, 'wait'], "
            f"['x'], os.environ, (0, 1, 2))\nprint(proc.pid, flush=True)\ntime.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    pid = int(holder.stdout.readline())
    deadline = time.monotonic() + 120
    while not out.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    holder.kill()
    holder.wait()
    deadline = time.monotonic() + 30
    while _alive(pid):
        assert time.monotonic() < deadline, f"the fork {pid} outlived its client"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_local_run_started_cold_says_why(hpc_ddp: Run, tmp_path: Path) -> None:
    """cluster.warm_start=false: every rank a fresh interpreter, and the logs say so (the
    warm default is asserted by test_local_run.py's runs)."""
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", ["cluster=local", "cluster.tasks_per_node=2",
                              "cluster.warm_start=false", "trainer.max_steps=4",
                              "data.train_size=256", "data.eval_size=64",
                              f"run_dir={run_dir}"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert started(run_dir) == {0: "cold: cluster.warm_start=false",
                                1: "cold: cluster.warm_start=false"}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["start"] == "cold"


def _warm_pids(run_dir: Path) -> set[int]:
    """The warm processes the ranks of a run forked from, as their logs say."""
    return {int(note.split("(pid ", 1)[1].split(",", 1)[0])
            for note in started(run_dir).values() if note.startswith("warm: ")}


def test_later_local_runs_fork_from_the_warm_process_an_earlier_one_kept(
        hpc_ddp: Run, tmp_path: Path) -> None:
    """cluster.warm_keep_s: a local run's warm process stays for the next run of the same
    interpreter, files and environment (the trainer's, a script's, an entry's), in a session
    of its own; with 0 one leaves with its run; a run whose environment differs gets its own,
    and one idle for 10 s leaves for it; a kept one leaves once idle for its keep. The token gives
    this test warm processes of its own (another environment)."""
    token = {"KEPT_TEST_TOKEN": uuid.uuid4().hex}
    small = ["cluster=local", "cluster.warm_keep_s=60", "data.train_size=256",
             "data.eval_size=64", "trainer.max_steps=2"]

    def run(name: str, *args: str, env: dict[str, str] = token) -> Path:
        done = hpc_ddp("submit", [*small, f"run_dir={tmp_path / name}", *args], env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        return tmp_path / name

    first = run("first", "cluster.tasks_per_node=2")
    (kept_pid,) = _warm_pids(first)
    assert "kept 60 s after each run for the next" in started(first)[0]
    assert _alive(kept_pid) and os.getsid(kept_pid) == kept_pid  # it stays, on its own
    out = tmp_path / "facts.json"
    run("script", "cluster.tasks_per_node=1", f"script={SCRIPT}", "--", str(out), "0")
    entry = run("entry", "cluster.tasks_per_node=2", "entry=tests.usercode.entries:report")
    assert _warm_pids(entry) == {kept_pid}
    facts = json.loads(out.read_text())  # the script still met a fresh interpreter of its own
    assert facts["note"].startswith(f"warm: forked from this node's warm process (pid "
                                    f"{kept_pid},"), facts["note"]
    assert facts["name"] == "__main__" and facts["main_is_me"] and facts["sibling_fresh"]
    assert facts["argv"] == [str(SCRIPT), str(out), "0"] and facts["torch_preloaded"]
    once = run("once", "cluster.tasks_per_node=2", "cluster.warm_keep_s=0")
    (once_pid,) = _warm_pids(once)
    assert once_pid != kept_pid and not _alive(once_pid)  # it left with its run
    # Another environment: a kept warm process of its own, and the one idle for 10 s leaves
    # for it (rank/warm/tidy.py) long before its 60 s; the new one leaves after its 8 s.
    time.sleep(11)
    other = run("other", "cluster.tasks_per_node=2", "cluster.warm_keep_s=8",
                env={"KEPT_TEST_TOKEN": "other"})
    (other_pid,) = _warm_pids(other)
    assert other_pid not in (kept_pid, once_pid)
    _gone_within(kept_pid, 30, "an idle kept warm process stayed when a newer one started")
    _gone_within(other_pid, 120, "a kept warm process outlived its keep")


def _gone_within(pid: int, seconds: float, why: str) -> None:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        assert time.monotonic() < deadline, why
        time.sleep(0.2)


def started(run_dir: Path) -> dict[int, str]:
    """How each rank's training process started, as its log says (rank/join/joined.py)."""
    found = {}
    for log in sorted((run_dir / "logs").glob("rank*.log")):
        lines = [line.partition(" INFO start: ")[2] for line in log.read_text().splitlines()
                 if " INFO start: " in line]
        if lines:
            found[int(log.stem.removeprefix("rank"))] = lines[-1]
    return found


def all_warm(run_dir: Path, ranks: int) -> bool:
    """Every rank's training process forked from its node's warm process."""
    notes = started(run_dir)
    return sorted(notes) == list(range(ranks)) and all(
        n.startswith("warm: forked from this node's warm process") for n in notes.values())


def test_a_warm_process_no_rank_came_to_leaves_with_its_starter(tmp_path: Path) -> None:
    """A supervisor starts its node's warm process early, then ends before it forks any
    training (a refusal, a doctor's probe): the warm process leaves with it, and the task
    ends instead of waiting out the warm process's wait for a first client (120 s)."""
    env = {**command_env(), LAUNCH_ID_ENV: uuid.uuid4().hex[:12], "HPC_DDP_WARM": "light"}
    code = ("import os\nfrom hpc_ddp.rank.warm import client\n"
            "assert client.start_early(os.environ) is None\n"
            "print(client._STARTED.args[-3], flush=True)\nclient.release()\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, text=True,
                          capture_output=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert not Path(done.stdout.strip()).exists()  # it left and took its socket with it


def test_another_launchs_sweep_does_not_end_a_warm_process_before_its_ranks_come() -> None:
    """A starter sweeps the folder's stale sockets (tidy.sweep): it connects to every
    other launch's warm process and leaves; a kept one's starter asks each to leave if idle
    and kept (tidy.evict_idle). A warm process whose ranks have not come yet (a
    supervisor still joining its job) stays for them: the test cluster's nodes, or one user's
    two jobs on one node, share the folder."""
    env = {**command_env(), LAUNCH_ID_ENV: uuid.uuid4().hex[:12], "HPC_DDP_WARM": "light"}
    code = ("import os, time\nfrom pathlib import Path\n"
            "from hpc_ddp.rank.warm import client, tidy\n"
            "assert client.start_early(os.environ) is None\n"
            "started = client._STARTED\npath = Path(started.args[-3])\n"
            "while tidy.locked(path.with_suffix('.lock')):  # importing\n"
            "    time.sleep(0.05)\n"
            "tidy.sweep(path.parent, path.with_name('another-launch.sock'))\n"
            "assert path not in tidy.evict_idle(path.parent, path.with_name('a-kept.sock'))\n"
            "time.sleep(1.5)  # three times its linger with no client\n"
            "assert started.poll() is None, 'the warm process left before its ranks came'\n"
            "link = client.this_process(os.environ)\n"
            "assert isinstance(link, client.Warm), link\n"
            "assert client._STARTED is started  # the same one, not a second start\n"
            "client.release()\nprint('ok', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_warm_process_leaving_takes_only_its_own_socket_with_it() -> None:
    """A warm process that leaves removes its socket only if the name is still its own: a
    later one of the same launch (started once the first had no client left) keeps its own."""
    path = client.folder(os.environ)
    assert path is not None
    path = path / f"test-{uuid.uuid4().hex[:12]}.sock"
    server = [sys.executable, "-m", "hpc_ddp.rank.warm.server", str(path)]
    env = command_env()

    def listening(proc: subprocess.Popen[bytes]) -> socket.socket:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.returncode
            with contextlib.suppress(OSError):
                return client._hold(path)
            time.sleep(0.05)
        raise AssertionError("the warm process did not listen")

    first = subprocess.Popen(server, env=env, cwd=REPO)
    second: subprocess.Popen[bytes] | None = None
    try:
        first_link = listening(first)
        path.unlink()  # as the second would: it binds the name afresh
        second = subprocess.Popen(server, env=env, cwd=REPO)
        second_link = listening(second)
        first_link.close()  # the first has no client left: it leaves
        assert first.wait(timeout=60) == 0
        assert path.exists()  # the second's, kept
        wire.connect(path).close()
        second_link.close()
        assert second.wait(timeout=60) == 0
        assert not path.exists()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
        path.unlink(missing_ok=True)


def test_the_warm_start_benchmark_runs_small(tmp_path: Path) -> None:
    """``python -m hpc_ddp.bench warm`` as docs/performance.md shows it, one round of 2 ranks:
    both legs run, and the figures it prints are the ones it writes."""
    out = tmp_path / "warm.json"
    done = subprocess.run([sys.executable, "-m", "hpc_ddp.bench", "warm", "--ranks", "2",
                           "--rounds", "1", "--json", str(out), "data.train_size=256",
                           "data.eval_size=64"], cwd=tmp_path, env=command_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    row = json.loads(out.read_text())["2"]
    for mode in ("cold", "warm", "kept"):  # the figures are the benchmark's, not asserted
        assert row[mode]["wall_s"] > 0 and row[mode]["cpu_s"] > 0
    shown = done.stdout.splitlines()[-1].split()
    assert shown[0] == "2" and float(shown[1]) == round(row["cold"]["wall_s"], 1)
