"""torch's meaningless c10d line is filtered from a rank's stderr, nothing else, and the
filter outlives a stop signal (a stopping rank's last lines come through)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import os, signal, sys
    from hpc_ddp.rank.join.quiet_stderr import NOISE, filter_stderr
    assert filter_stderr() and filter_stderr()  # once per process
    os.write(2, f"[W socket.cpp:207] [c10d] {NOISE}. err=-3\\n".encode())
    print("kept: python", file=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *a: print("kept: after SIGTERM", file=sys.stderr))
    os.killpg(0, signal.SIGTERM)   # what a stop sends to every process of the step
    os.write(2, b"kept: C level\\n")
""")


def test_only_the_known_line_is_filtered() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=60, check=False, start_new_session=True)
    assert done.returncode == 0, done.stderr
    assert "client socket cannot be retrieved" not in done.stderr
    assert done.stderr.splitlines() == ["kept: python", "kept: after SIGTERM", "kept: C level"]
