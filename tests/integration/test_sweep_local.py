"""Multirun without Slurm: the same manifest, run dirs, status and hparams, points run here."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

Run = Callable[..., subprocess.CompletedProcess[str]]


def test_local_sweep_runs_every_point(hpc_ddp: Run, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    done = hpc_ddp("submit", ["-m", "cluster=local", "optim.lr=0.1,0.01", "trainer.max_steps=10",
                              "data.train_size=512", "data.eval_size=128", f"sweep.dir={sweep}",
                              "sweep.parallel=2"], timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    manifest = json.loads((sweep / "sweep.json").read_text())
    assert [p["params"] for p in manifest["points"]] == [{"optim.lr": "0.1"},
                                                         {"optim.lr": "0.01"}]
    for point in manifest["points"]:
        summary = json.loads((Path(point["run_dir"]) / "summary.json").read_text())
        assert summary["global_step"] == 10
        config = (Path(point["run_dir"]) / "config.yaml").read_text()
        assert f"lr: {point['params']['optim.lr']}" in config
        # TensorBoard's HPARAMS tab: the point's swept values were logged.
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(Path(point["run_dir"]) / "tb"))
        acc.Reload()
        assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")
    status = hpc_ddp("status", [str(sweep), "--plot", str(tmp_path / "curves.png")])
    assert status.returncode == 0, status.stderr
    assert status.stdout.count("COMPLETED") == 2 and "best point: optim.lr=" in status.stdout
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_sweep_input_errors_name_the_point(hpc_ddp: Run, tmp_path: Path) -> None:
    done = hpc_ddp("submit", ["-m", "cluster=local", "trainer.batch_size=8,-1",
                              f"sweep.dir={tmp_path / 's'}"], timeout=120)
    assert done.returncode == 2
    assert "trainer.batch_size=-1" in done.stderr and "sweep point 1" in done.stderr
    assert not (tmp_path / "s").exists()
    done = hpc_ddp("submit", ["-m", "optim.lr=0.1,0.2", f"run_dir={tmp_path / 'r'}"])
    assert done.returncode == 2 and "sweep.dir=" in done.stderr
