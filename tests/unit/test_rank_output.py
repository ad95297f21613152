"""A rank's stdout and stderr (and its children's) go into its log through the tee, each line
with time, rank and host; torch's meaningless c10d line is dropped everywhere, nothing else;
the tee outlives a stop signal (a stopping rank's last lines come through); secrets masked."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from hpc_ddp import ranklines
from hpc_ddp.rank.join.tee import NOISE

CHILD = textwrap.dedent("""
    import os, signal, subprocess, sys
    from pathlib import Path
    from hpc_ddp.rank.join.distenv import DistEnv
    from hpc_ddp.rank.join.output import capture
    from hpc_ddp.rank.join.tee import NOISE
    env = DistEnv(3, 1, 4, 1, 2, 2, "slurm", "42", restart=1)
    log = Path(sys.argv[1])
    assert capture(log, env, "node2", os.environ)
    assert not capture(log, env, "node2", os.environ)  # once per process
    os.write(2, f"[W socket.cpp:207] [c10d] {NOISE}. err=-3\\n".encode())
    print("epoch 1: accuracy 0.53 key=" + os.environ["MY_API_KEY"])
    print("kept: python", file=sys.stderr)
    subprocess.run([sys.executable, "-c", "print('from a child')"], check=True)
    print("progress 10%\\rprogress 100%")
    signal.signal(signal.SIGTERM, lambda *a: print("kept: after SIGTERM", file=sys.stderr))
    os.killpg(0, signal.SIGTERM)   # what a stop sends to every process of the step
    os.write(2, b"kept: C level\\n")
    os._exit(0)                    # no atexit: the tee still writes what it read
""")

SECRET = "hunter2-very-secret-value"


def test_output_goes_into_the_rank_log(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "rank3.log"
    done = subprocess.run([sys.executable, "-c", CHILD, str(log)], capture_output=True,
                          timeout=60, check=False, start_new_session=True,
                          env={**_env(), "MY_API_KEY": SECRET})
    stdout, stderr = done.stdout.decode(), done.stderr.decode()  # "\r" as it was
    assert done.returncode == 0, stderr
    # Passed on as it was (to submitit's files, Slurm's output, a terminal), masked.
    assert stdout.split("\n") == ["epoch 1: accuracy 0.53 key=****", "from a child",
                                        "progress 10%\rprogress 100%", ""]
    assert stderr.splitlines() == ["kept: python", "kept: after SIGTERM", "kept: C level"]
    for _ in range(100):  # the tee writes its last lines after the rank has gone
        text = log.read_text()
        if "C level" in text:
            break
        time.sleep(0.1)
    lines = [ranklines.parse(raw) for raw in text.splitlines()]
    assert all(lines), text
    assert [(ln.rank, ln.host) for ln in lines if ln] == [(3, "node2")] * len(lines)
    assert lines[0] and lines[0].kind == ranklines.ATTEMPT
    assert ranklines.attempt_of(lines[0].text) == {"job": "42", "restart": "1",
                                                   "generation": "0"}
    shown = {(ln.kind, ln.text) for ln in lines if ln}
    assert {("OUT", "epoch 1: accuracy 0.53 key=****"), ("OUT", "from a child"),
            ("OUT", "progress 100%"), ("ERR", "kept: python"), ("ERR", "kept: after SIGTERM"),
            ("ERR", "kept: C level")} <= shown
    assert NOISE not in text and SECRET not in text and NOISE not in stderr


def test_a_restart_in_place_marks_its_start(tmp_path: Path) -> None:
    """A supervised program's output goes through its supervisor's tee; a restarted one
    (generation 1) writes its own ATTEMPT line, the first start none."""
    from hpc_ddp.rank.contract import CAPTURED_ENV
    from hpc_ddp.rank.join import output
    from hpc_ddp.rank.join.distenv import DistEnv

    log = tmp_path / "rank0.log"
    environ = {CAPTURED_ENV: str(log)}
    first = DistEnv(0, 0, 1, 0, 1, 1, "slurm", "42")
    assert not output.capture(log, first, "n1", environ)
    assert not log.exists()
    again = DistEnv(0, 0, 1, 0, 1, 1, "slurm", "42", generation=1)
    assert not output.capture(log, again, "n1", environ)
    parsed = ranklines.parse(log.read_text())
    assert parsed and parsed.kind == ranklines.ATTEMPT and "generation=1" in parsed.text


def test_own_lines_pass_through_once(tmp_path: Path) -> None:
    """Rank 0 echoes hpc_ddp's log lines to stderr: they reach Slurm's output, and are not
    written into the log a second time."""
    from hpc_ddp.rank.join.tee import Tee

    log = tmp_path / "rank0.log"
    out = tmp_path / "passed"
    with open(log, "wb") as lf, open(out, "wb") as of:
        tee = Tee(lf.fileno(), 0, "n1", [], {"ERR": of.fileno()})
        own = ranklines.line(0, "n1", "INFO", "step 1/4 loss 2.3")
        other = ranklines.line(1, "n2", "INFO", "a line of another rank, as text")
        tee.feed("ERR", (own + other + "partial").encode())
        tee.flush_partial()
        tee.feed("ERR", b" end\n")
    assert out.read_text() == own + other + "partial end\n"
    logged = [ranklines.parse(x) for x in log.read_text().splitlines()]
    assert [(ln.kind, ln.text) for ln in logged if ln] == [
        ("ERR", other.rstrip("\n")), ("ERR", "partial end")]


def _env() -> dict[str, str]:
    import os
    return {k: v for k, v in os.environ.items() if k != "HPC_DDP_CAPTURED"}
