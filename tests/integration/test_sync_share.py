"""A real 2-rank local run (gloo) says how much of each step waits on gradient sync: in
summary.json, the results table and ``status`` (trainer/sync_probe.py, watch/sync_lines.py)."""

from __future__ import annotations

import io
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from hpc_ddp.watch import status
from hpc_ddp.watch.sync_lines import percent

Run = Callable[..., subprocess.CompletedProcess[str]]


def test_a_two_rank_run_reports_its_sync_share(hpc_ddp: Run, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # 4 steps: the third (after the 2 warm-up steps) is the one sampled.
    done = hpc_ddp("submit", ["cluster=local", "nodes=1", "cluster.tasks_per_node=2",
                              "trainer.max_steps=4", "trainer.log_interval=2",
                              "data.train_size=256", "data.eval_size=64",
                              f"run_dir={run_dir}"])
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    share = summary["sync_share"]
    assert isinstance(share, float) and 0.0 <= share <= 1.0, summary
    assert summary["sync_sampled_steps"] == 1
    assert 0.0 <= summary["sync_ms"] <= summary["sync_step_ms"]
    assert f"gradient sync     {percent(share)} of each step" in done.stdout
    out = io.StringIO()
    assert status.main([str(run_dir)], out=out) == 0
    header, line = out.getvalue().splitlines()[:2]
    column = header.index(" sync ") + 1
    assert line[column:].split()[0] == percent(share), out.getvalue()
    said = "gradient sync" in out.getvalue()  # status's pointer, when the share is large
    assert said == (share > 0.25) == ("bench scaling" in done.stdout), out.getvalue()
