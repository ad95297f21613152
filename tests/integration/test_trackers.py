"""W&B (offline) and MLflow (a file store), the real packages: rank 0 logs to both beside
TensorBoard; a resumed run continues the same tracker runs with all its steps; a sweep's
points are grouped with their swept values; no API key lands in any file of the run dir."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.wandb_records import history

Run = Callable[..., subprocess.CompletedProcess[str]]
KEY = "sk-wandb-0123456789abcdef0123456789abcdef"  # a key's shape: never to be written
ARGS = ["cluster=local", "cluster.tasks_per_node=2", "trainer.log_interval=10",
        "trainer.checkpoint_interval=10", "logger=[wandb,mlflow]", "tracker.offline=true",
        "data.train_size=512", "data.eval_size=64"]


def _mlflow_steps(store: Path, run_id: str, key: str = "train/loss") -> list[int]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{store}")
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _no_key_in(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path


def test_a_resumed_run_continues_its_tracker_runs(hpc_ddp: Run, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_dir = tmp_path / "run"
    env = {"WANDB_API_KEY": KEY}
    first = hpc_ddp("submit", [*ARGS, "trainer.max_steps=20", f"run_dir={run_dir}"], env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    record = json.loads((run_dir / "trackers.json").read_text())
    assert "wandb sync " in first.stdout and "mlflow ui --backend-store-uri" in first.stdout
    again = hpc_ddp("submit", [*ARGS, "trainer.max_steps=40", f"run_dir={run_dir}",
                               "resume=true"], env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads((run_dir / "trackers.json").read_text()) == record  # the same runs
    assert _mlflow_steps(run_dir / "mlruns", record["mlflow"]["run_id"]) == [10, 20, 30, 40]
    ids, steps, _ = history(run_dir / "wandb")
    assert ids == {record["wandb"]["id"]}
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 2  # two attempts, one run
    assert [s for s in sorted(steps) if "train/loss" in steps[s]] == [10, 20, 30, 40]
    _no_key_in(run_dir)


def test_a_sweeps_points_are_grouped_with_their_params(hpc_ddp: Run, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    sweep = tmp_path / "sweep"
    done = hpc_ddp("submit", ["-m", *ARGS, "trainer.max_steps=10", "optim.lr=0.1,0.05",
                              f"sweep.dir={sweep}"])
    assert done.returncode == 0, done.stdout + done.stderr
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{sweep / 'mlruns'}")
    experiment = client.get_experiment_by_name("hpc_ddp")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.data.params["optim.lr"] for r in runs) == ["0.05", "0.1"]
    assert {r.data.tags["hpc_ddp.sweep"] for r in runs} == {"sweep"}
    for point in sorted(p for p in sweep.iterdir() if (p / "trackers.json").exists()):
        _, steps, groups = history(point / "wandb")
        assert groups == {"sweep"} and 10 in steps
