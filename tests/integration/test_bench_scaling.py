"""The scaling report as a user runs it, on 2 simulated nodes of this machine at toy sizes:
what it prints and writes, every fix run (the figures are this machine's: not checked)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

Run = Callable[..., subprocess.CompletedProcess[str]]
SMALL = ["cluster=local", "nodes=2", "cluster.tasks_per_node=1", "model=tiny_cnn",
         "trainer.batch_size=16", "data.train_size=512", "data.eval_size=16"]


def test_two_nodes_measured_a_verdict_and_every_fix(hpc_ddp: Run, tmp_path: Path) -> None:
    root = tmp_path / "scaling"
    done = hpc_ddp("bench", ["scaling", *SMALL, "--steps", "6", "--warmup-steps", "3",
                             "--probe-steps", "2", "--fixes", "all", f"run_dir={root}"],
                   timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    # A line as each node count starts, and as each fix does.
    assert "scaling: 1 node(s) (1 ranks): warm-up 3 steps, then 6 timed steps" in out
    assert "scaling: 2 node(s) (2 ranks): warm-up 3 steps" in out
    assert "scaling: fix bf16 at 2 nodes" in out
    header = next(line for line in out.splitlines() if line.startswith("nodes "))
    for column in ("ranks", "samples/s", "speed-up", "efficiency", "step ms", "data",
                   "compute", "sync", "optim", "other", "busbw GB/s", "bare GB/s"):
        assert column in header
    assert "\nverdict: " in out

    result = json.loads((root / "bench" / "scaling.json").read_text())
    rows = result["rows"]
    assert [(r["nodes"], r["ranks"]) for r in rows] == [(1, 1), (2, 2)]
    assert all(r["samples_per_s"] > 0 and r["steps"] == 6 for r in rows)
    assert rows[0]["efficiency"] == 1.0 and rows[1]["efficiency"] > 0
    assert rows[0]["bare_busbw_gbps"] is None  # one node: no fabric to measure
    assert rows[1]["bare_busbw_gbps"] > 0 and rows[1]["busbw_gbps"] > 0
    assert rows[1]["bucket_bytes"] == 25 * 2**20  # DDP's default bucket
    assert all(r["loss"] > 0 for r in rows)
    assert result["verdict"]["cause"] in ("scales well", "straggler", "loader", "fabric",
                                          "phase")
    # Every fix ran (or says why not), each with its loss after the same steps.
    fixes = {f["fix"]: f for f in result["fix_rows"]}
    assert set(fixes) == {"bf16", "fp16", "powersgd", "bucket 100 MB", "grad_accum 2"}
    for f in fixes.values():
        assert f["skipped"] or (f["samples_per_s"] > 0 and f["loss"] > 0), f
    assert "fixes at 2 nodes, 6 steps each" in out
    line = result["override_line"]
    assert line.startswith("python -m hpc_ddp.submit cluster=local nodes=2") and line in out
    assert (root / "bench" / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
