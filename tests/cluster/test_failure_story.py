"""One story of a failure on the real cluster (docs/observability.md): the first failing rank
is the same in the submit command's report, ``status``, ``events.jsonl`` and the rank's error
file; the user's own frames are in the report and the error file, for a function entry, a
``_target_`` part and a script alike; no prefix twice; the job ends FAILED in Slurm."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from hpc_ddp.rank.join.tracebacks import LOCAL_MARK
from hpc_ddp.testcluster.cluster import TestCluster
from tests.cluster.slurm_final import assert_ended

pytestmark = pytest.mark.cluster
Run = Callable[..., subprocess.CompletedProcess[str]]

SCRIPT = """\
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
if dist.get_rank() == 1:
    time.sleep(0.5)
    raise ValueError("rank 1's own bad value")
dist.all_reduce(t)  # rank 0 waits here: its failure is the lost peer, a symptom
"""

CASES = {
    "entry": (["entry=tests.usercode.entries:fails_in_own_code"],
              "KeyError: 'missing'", "_helper_that_fails"),
    "target": (["model._target_=tests.usercode.parts.NanOnRank1", "trainer.max_steps=6",
                "data.train_size=512", "data.eval_size=128"],
               "FloatingPointError: the loss went nan", "NanOnRank1.forward"),
    "script": (["script=bad.py"], "ValueError: rank 1's own bad value", "bad.py\", line 10"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_first_failing_rank_and_its_frames_are_one_story(
        hpc_ddp: Run, slurm_cluster: TestCluster, slurm_env: dict[str, str], tmp_path: Path,
        case: str) -> None:
    args, message, frame = CASES[case]
    node2 = slurm_cluster.node_names[1]
    (tmp_path / "bad.py").write_text(SCRIPT)
    run = tmp_path / "run"
    done = hpc_ddp("submit", ["cluster=slurm", "nodes=2", f"run_dir={run}", "wait=true",
                              *args], env=slurm_env, timeout=300,
                   cwd=tmp_path if case == "script" else None)  # else the repo: tests.usercode
    said = done.stdout
    assert done.returncode == 1, said + done.stderr
    job = json.loads((run / "job.json").read_text())["job_id"]
    assert_ended(str(job), slurm_env, "FAILED")

    # The submit's report: rank 1 first, its message once, the user's frame.
    report = said[said.index("failed (state FAILED)"):]
    first = next(ln for ln in report.splitlines() if ln.startswith(("first to fail", "rank ")))
    assert first.startswith((f"first to fail: rank 1 on {node2} (at ",
                             f"rank 1 on {node2}: ")), report
    assert message in report and frame in report, report
    assert f"rank 1 on {node2}: rank 1" not in report and LOCAL_MARK not in report, report
    assert report.count(message) == 1 or case == "script", report

    # events.jsonl and status name the same rank, the cause once.
    (failure,) = [e for e in (json.loads(ln) for ln in (run / "events.jsonl").read_text()
                              .splitlines()) if e["kind"] == "failure"]
    assert (failure["rank"], failure["host"]) == (1, node2), failure
    assert not failure["cause"].startswith("rank "), failure
    status = hpc_ddp("status", [str(run)], env=slurm_env, timeout=60)
    line = next(ln for ln in status.stdout.splitlines() if ln.startswith("failure:"))
    assert line.startswith(f"failure: rank 1 on {node2}: "), line
    assert f"rank 1 on {node2}: rank" not in line, line
    assert message.split(":")[0] in line or case == "script", line

    # The rank's error file: its message first, then the user's frames, then the whole chain
    # of the process that failed (the user's frame in it too), not the supervisor's.
    error = (run / "logs" / "rank1.error").read_text()
    head, _, rest = error.partition("\n\n")
    assert head.startswith(f"rank 1 on {node2}: ") and LOCAL_MARK not in head, head
    assert frame in rest, error
    if case != "script":  # a script's supervisor has its last lines, not its frames
        full = rest[rest.index("Full traceback ("):]
        assert frame in full and "outcome.py" not in full, full
