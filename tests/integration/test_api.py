"""The Python API from a plain Python session, and the example notebook run headless."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import hpc_ddp
from tests.conftest import REPO


def test_compose_submit_wait_collect(tmp_path: Path) -> None:
    overrides = ["cluster=local", "trainer.max_steps=30", "trainer.log_interval=5",
                 f"run_dir={tmp_path / 'run'}"]
    assert hpc_ddp.compose(overrides).trainer.max_steps == 30
    run = hpc_ddp.submit(overrides)
    assert run.run_dir == tmp_path / "run" and run.job_ids == [run.job_id]
    summary = run.wait(progress=False)
    assert summary["global_step"] == 30 and summary["world_size"] == 2
    loss = run.scalars("train/loss")["train/loss"]
    assert [s for s, _ in loss] == [5, 10, 15, 20, 25, 30]
    assert run.state == "COMPLETED" and "[rank 0 " in run.log_tail(50)

    again = hpc_ddp.Run.from_dir(tmp_path / "run")  # as after a kernel restart
    assert (again.job_id, again.state, again.summary()) == (run.job_id, "COMPLETED", summary)
    assert again.scalars()["train/loss"] == loss
    assert again.config().trainer.max_steps == 30


def test_a_bad_override_raises_one_clear_exception() -> None:
    with pytest.raises(hpc_ddp.UserError) as info:
        hpc_ddp.compose(["optim.lrr=0.1"])
    assert info.value.key == "optim.lrr" and "did you mean optim.lr" in str(info.value)


def test_wait_timeout_and_cancel(tmp_path: Path) -> None:
    run = hpc_ddp.submit(["cluster=local", "trainer.max_steps=100000",
                          f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(TimeoutError):
        run.wait(timeout=3, progress=False)
    with pytest.raises(hpc_ddp.UserError, match="is still running"):  # no second job in it
        hpc_ddp.plan([f"run_dir={run.run_dir}", "resume=true"])
    deadline = time.monotonic() + 180  # training, however slowly its ranks started today
    while not (run.progress() or {}).get("step") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert run.cancel() is True  # the ranks agree on a step, checkpoint and stop
    with pytest.raises(hpc_ddp.RunFailed):
        run.wait(timeout=120, progress=False)
    assert run.state == "CANCELLED" and run.summary() is None
    assert run.cancel() is False  # nothing left to cancel
    stops = [e for e in run.events() if e["kind"] == "stop"]
    assert len(stops) == 1 and stops[0]["cause"].startswith("SIGTERM")
    from hpc_ddp.rank.services import checkpoint

    latest = checkpoint.latest_path(run.files.checkpoints)
    assert latest is not None and latest.name == f"step_{stops[0]['step']:09d}.pt"
    assert hpc_ddp.Run.from_dir(run.run_dir).state == "CANCELLED"


def test_check_data_reports_shards() -> None:
    report = hpc_ddp.check_data(["data.train_size=100", "trainer.batch_size=8"], world_size=3)
    assert report.ok and report.padded == 2 and len(report.indices) == 3
    assert report.batch_shapes["images"] == (8, 3, 32, 32)
    assert report.samples_per_s > 0


def test_example_notebook_runs_headless(tmp_path: Path) -> None:
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(REPO / "examples" / "quickstart.ipynb", as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    # Its runs are where every run goes (outputs/ of its folder), not in a /tmp folder.
    (runs,) = (tmp_path / "outputs").glob("notebook-*")
    assert {p.name for p in runs.iterdir()} == {"run", "mine", "loop", "loss.png"}
    assert any("shards disjoint" in o.get("text", "") for o in outputs)
    # The _target_ network and the notebook's own function ran (their cells assert it).
    assert any("sum_of_ranks" in str(o.get("data", {})) for o in outputs)
