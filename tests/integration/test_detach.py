"""A detached local run (detach=true) outlives the terminal that started it: the shell gets
the SIGHUP of a closed SSH session and exits; the run goes on, is followed by
`logs --follow`, and stops with a checkpoint on `status --stop`."""

from __future__ import annotations

import fcntl
import os
import pty
import shlex
import signal
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hpc_ddp.rank.services import checkpoint
from tests.conftest import REPO, command_env
from tests.integration.test_warm_start import all_warm

Run = Callable[..., subprocess.CompletedProcess[str]]


def _terminal_shell(command: str) -> tuple[subprocess.Popen[bytes], int]:
    """``bash -i`` on a new pseudo-terminal of its own (its controlling terminal, as an SSH
    login's), running ``command``; returns the shell and the terminal's master end."""
    master, slave = pty.openpty()

    def controlling() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    shell = subprocess.Popen(["bash", "--norc", "-i"], stdin=slave, stdout=slave, stderr=slave,
                             preexec_fn=controlling, cwd=REPO, env=command_env())
    os.close(slave)
    os.write(master, (command + "\n").encode())
    return shell, master


def _read_until(master: int, text: str, timeout: float) -> str:
    seen = b""
    deadline = time.monotonic() + timeout
    while text.encode() not in seen:
        assert time.monotonic() < deadline, seen.decode(errors="replace")
        try:
            seen += os.read(master, 65536)
        except OSError:
            break
    return seen.decode(errors="replace")


def test_a_detached_run_survives_the_hangup_and_stops_with_a_checkpoint(
        hpc_ddp: Run, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    submit = " ".join(shlex.quote(a) for a in [
        sys.executable, "-m", "hpc_ddp.submit", "cluster=local", "cluster.tasks_per_node=2",
        "detach=true", "trainer.max_steps=100000", "trainer.log_interval=10",
        "trainer.checkpoint_interval=1000000", f"run_dir={run_dir}"])
    shell, master = _terminal_shell(submit)
    said = _read_until(master, "--stop", timeout=120)
    assert "detached:" in said and f"logs {run_dir} --follow" in said, said
    # The SSH session closes: the terminal hangs up, the shell and its jobs get SIGHUP.
    os.close(master)
    os.killpg(shell.pid, signal.SIGHUP)
    shell.wait(timeout=30)

    follower = subprocess.Popen([sys.executable, "-m", "hpc_ddp.logs", str(run_dir),
                                 "--follow"], cwd=REPO, env=command_env(),
                                stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(follower.stdout or []), daemon=True)
    reader.start()
    hung_up = time.time()
    deadline = time.monotonic() + 120
    while not any(" INFO step " in ln and _at(ln) > hung_up for ln in list(lines)):
        assert time.monotonic() < deadline, "no step logged after the hangup"
        assert follower.poll() is None, lines[-20:]
        time.sleep(0.3)

    stopped = hpc_ddp("status", [str(run_dir), "--stop"], timeout=300)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "with a checkpoint; nothing is lost" in stopped.stdout, stopped.stdout
    assert f"run_dir={run_dir}" in stopped.stdout and "resume=true" in stopped.stdout
    follower.wait(timeout=60)  # the run has ended: --follow ends too
    step = checkpoint.latest_step(run_dir / "checkpoints")
    assert step is not None and step > 0
    assert f"stopped at step {step} with a checkpoint" in stopped.stdout
    assert all_warm(run_dir, 2)  # ranks forked from the warm process, in the run's session


def _at(line: str) -> float:
    """The time of a followed line ("HH:MM:SS.mmm ..."), today."""
    import datetime as dt

    return dt.datetime.combine(dt.date.today(),
                               dt.time.fromisoformat(line.split(" ", 1)[0])).timestamp()
