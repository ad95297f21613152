"""A stop signal that came before a user's script existed is passed on once the script
handles it (rank/supervise/handover.py), read from the kernel's record of its handlers."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from hpc_ddp.rank.supervise import handover

# Sets its USR2 handler after a while, then waits for the signal and says it had it.
LATE_HANDLER = """
import signal, sys, time
time.sleep(float(sys.argv[1]))
got = []
signal.signal(signal.SIGUSR2, lambda s, f: got.append(s))
deadline = time.monotonic() + 20
while not got and time.monotonic() < deadline:
    time.sleep(0.01)
print("handled" if got else "never", flush=True)
"""


def script(delay: float) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", LATE_HANDLER, str(delay)],
                            stdout=subprocess.PIPE, text=True)


def test_the_kernels_record_of_handlers() -> None:
    proc = script(0.0)
    try:
        deadline = time.monotonic() + 20
        while signal.SIGUSR2 not in (handover.caught(proc.pid) or set()):
            assert time.monotonic() < deadline, "the child's handler never showed"
            time.sleep(0.02)
        # Not one it never set (its own process only: SIGINT is Python's).
        assert signal.SIGUSR1 not in (handover.caught(proc.pid) or set())
    finally:
        proc.kill()
        proc.wait()
    assert handover.caught(proc.pid) is None  # gone
    assert handover.grace_s(120) == 30.0 and handover.grace_s(40) == 10.0
    assert handover.grace_s(0) == 1.0


def test_a_script_that_sets_its_handler_late_gets_the_signal_then() -> None:
    proc = script(1.0)
    sent: list[float] = []

    def send(signum: int) -> None:
        sent.append(time.monotonic())
        proc.send_signal(signum)

    began = time.monotonic()
    how = handover.pass_on(proc.pid, signal.SIGUSR2, send, 30.0, lambda: proc.poll() is None)
    out, _ = proc.communicate(timeout=30)
    assert how == "caught" and out.strip() == "handled"
    assert sent[0] - began >= 0.9  # not before its handler: sent at once it would have died


def test_a_script_that_never_handles_it_gets_it_after_the_grace() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    began = time.monotonic()
    how = handover.pass_on(proc.pid, signal.SIGUSR2, proc.send_signal, 0.5,
                           lambda: proc.poll() is None)
    assert how == "grace" and proc.wait(timeout=10) == -signal.SIGUSR2
    assert time.monotonic() - began >= 0.5


def test_nothing_is_sent_to_a_script_that_ended() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    sent: list[int] = []
    assert handover.pass_on(proc.pid, signal.SIGUSR2, sent.append, 5.0,
                            lambda: proc.poll() is None) == "ended"
    assert sent == []
