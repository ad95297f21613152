"""What a user reads when their code fails on one rank: the submit command's report shows
their traceback (their frames only) and the error once, no frames of hpc_ddp or submitit
and no internal marker; the rank's log holds it once too; status names the same rank."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from hpc_ddp.rank.supervise.diagnose import LOCAL_MARK

Run = Callable[..., subprocess.CompletedProcess[str]]


def test_a_failure_in_user_code_shows_the_users_traceback_once(hpc_ddp: Run,
                                                               tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", ["entry=tests.usercode.entries:fails_in_own_code",
                              "cluster=local", f"run_dir={run_dir}"])
    assert done.returncode == 1
    out = done.stdout + done.stderr
    report = out[out.index("failed (state FAILED)"):]
    lines = report.splitlines()
    assert lines[1] == "rank 1 on " + lines[1].split(" on ")[1].split(":")[0] + (
        ": KeyError: 'missing'")
    assert lines[2] == "Traceback (most recent call last):"
    frames = [ln for ln in lines if ln.lstrip().startswith("File ")]
    assert [f.split('"')[1].rsplit("/", 2)[-2:] for f in frames] == [
        ["usercode", "entries.py"], ["usercode", "entries.py"]]
    assert "_helper_that_fails" in frames[-1]
    assert report.count("KeyError: 'missing'") == 1  # the error once
    assert LOCAL_MARK not in out and "hpc_ddp/rank" not in report and "submitit" not in report
    log = (run_dir / "logs" / "rank1.log").read_text()
    assert log.count("KeyError: 'missing'") == 2  # "failed: ..." and the traceback's end
    assert "Traceback" in log and "submitit/core" not in log and LOCAL_MARK not in log
    # The error file keeps the whole chain for a bug of ours, below the program's traceback.
    error = (run_dir / "logs" / "rank1.error").read_text()
    assert "Full traceback (hpc_ddp's frames too):" in error and "task.py" in error
    status = hpc_ddp("status", [str(run_dir), "--json"])
    failures = json.loads(status.stdout)["runs"][0]["recovery"]["failures"]
    assert [(f["rank"], f["cause"].startswith("KeyError")) for f in failures] == [(1, True)]


def test_the_failure_report_defuses_terminal_escapes(hpc_ddp: Run, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", ["entry=tests.usercode.entries:fails_with_escapes",
                              "cluster=local", "cluster.tasks_per_node=1", f"run_dir={run_dir}"])
    assert done.returncode == 1
    said = done.stdout + done.stderr
    report = said[said.index("failed (state FAILED)"):]
    assert "\x1b" not in report and "\u009b" not in report, repr(report)
    assert "RuntimeError: bad \\x1b[2J\\x9b2J end" in report
    shown = hpc_ddp("logs", [str(run_dir)]).stdout
    assert "\x1b" not in shown and "\\x1b]52;c;" in shown
