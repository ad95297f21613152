"""The training benchmark as a user runs it, at toy sizes: the structure of what it prints and
writes (the speed is for docs/performance.md, not for tests)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

Run = Callable[..., subprocess.CompletedProcess[str]]
TINY = ["--rounds", "2", "--window-s", "0.01", "--min-steps", "1", "--warmup-steps", "1",
        "trainer.batch_size=8", "data.train_size=96", "data.eval_size=16"]


def test_bench_train_reports_ratios_split_and_plot(hpc_ddp: Run, tmp_path: Path) -> None:
    root = tmp_path / "bench"
    done = hpc_ddp("bench.train", ["--models", "null,tiny_cnn", *TINY,
                                   "--variant", "fp32:tuned trainer.precision=fp32",
                                   "cluster=local", "cluster.tasks_per_node=2",
                                   f"run_dir={root}"], timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((root / "bench" / "train.json").read_text())
    rows = {(r["model"], r["setting"]): r for r in result["rows"]}
    # plain (the same work as the baseline) runs with the null model, for the overhead.
    assert set(rows) == {(m, s) for m in ("null", "tiny_cnn")
                         for s in ("baseline", "exact", "tuned", "fp32")} | {("null", "plain")}
    for row in rows.values():
        assert row["world_size"] == 2 and row["rounds"] == 2
        assert row["samples_per_s"] > 0
        assert row["samples_per_s_per_rank"] * 2 == row["samples_per_s"]
        assert row["ratio_p25"] <= row["ratio"] <= row["ratio_p75"]
        assert set(row["step_ms"]) == {"data", "compute", "comm", "optimizer", "other", "step"}
        assert row["peak_mem_mb"] > 0
    assert rows[("tiny_cnn", "baseline")]["ratio"] == 1.0
    assert rows[("tiny_cnn", "exact")]["settings"]["precision"] == "fp32"
    assert rows[("tiny_cnn", "fp32")]["settings"]["batched_loader"] is True
    assert rows[("tiny_cnn", "exact")]["settings"]["batched_loader"] is True
    assert rows[("null", "plain")]["settings"]["batched_loader"] is False
    (overhead,) = result["overhead"]
    assert overhead["setting"] == "plain"
    assert {"overhead_ms", "overhead_pct_of_tiny_cnn_step", "tiny_cnn_step_ms"} <= set(overhead)
    assert {t["what"] for t in result["targets"]} == {
        "tiny_cnn 2 ranks exact", "tiny_cnn 2 ranks tuned", "overhead per step, 2 ranks"}
    out = done.stdout
    header = next(line for line in out.splitlines() if line.startswith("model "))
    for column in ("samples/s", "/rank", "x baseline", "data", "fwd+bwd", "comm", "optim",
                   "other", "peak MB"):
        assert column in header
    assert "framework overhead (2 ranks, null model, plain - baseline)" in out
    assert "target tiny_cnn 2 ranks tuned" in out
    assert (root / "bench" / "train.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_variant_exits_2_before_starting(hpc_ddp: Run, tmp_path: Path) -> None:
    done = hpc_ddp("bench.train", ["--variant", "x:tuned trainer.precision=fp8",
                                   f"run_dir={tmp_path / 'b'}"], timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: trainer.precision=fp8")
    assert not (tmp_path / "b").exists()


def test_the_baseline_runs_on_its_own(hpc_ddp: Run) -> None:
    done = hpc_ddp("bench.baseline", ["--model", "tiny_cnn", "--world-size", "2", "--steps",
                                      "3", "--warmup", "1", "--batch-size", "8",
                                      "--train-size", "64", "--json"], timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["world_size"] == 2 and result["steps"] == 3 and result["samples_per_s"] > 0
    assert set(result["step_ms"]) >= {"data", "compute", "comm", "optimizer", "other"}
