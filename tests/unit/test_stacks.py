"""A stuck process's stack on request: faulthandler's dump, and the line read back from it."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from hpc_ddp.rank.services import stacks


def test_a_stuck_process_is_found_on_its_line(tmp_path: Path) -> None:
    out = tmp_path / "rank1.stacks"
    ready = tmp_path / "ready"
    program = tmp_path / "loader.py"
    program.write_text(textwrap.dedent(f"""
        import pathlib, signal, threading, time
        from hpc_ddp.rank.services import stacks
        stacks.enable(pathlib.Path({str(out)!r}), signal.SIGUSR1)
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # another thread

        def read_sample():
            pathlib.Path({str(ready)!r}).touch()
            while True:
                time.sleep(0.2)  # stuck here

        read_sample()
    """))
    proc = subprocess.Popen([sys.executable, str(program)])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)  # not fatal: it goes on being stuck
        deadline = time.monotonic() + 10
        while "read_sample" not in (out.read_text() if out.exists() else ""):
            assert time.monotonic() < deadline, "no dump"
            time.sleep(0.05)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    line = program.read_text().splitlines().index("    while True:") + 2
    assert stacks.where(out) == f"read_sample ({'/'.join(program.parts[-3:])} line {line})"


def test_no_dump_says_nothing(tmp_path: Path) -> None:
    assert stacks.where(tmp_path / "missing.stacks") is None


def test_the_stack_signal_keeps_clear_of_the_requeue_signal() -> None:
    assert stacks.stack_signal("USR2") == signal.SIGUSR1
    assert stacks.stack_signal("SIGUSR1") == signal.SIGUSR2
