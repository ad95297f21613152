"""Sweep planning without running anything: --cfg, dry runs, glob(), kinds per point."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from hpc_ddp.errors import UserError
from hpc_ddp.sweep.launch import launch, plan_points

NO_SLURM = {"PATH": "/nonexistent"}


def test_cfg_prints_every_point_and_starts_nothing(tmp_path: Path) -> None:
    out = io.StringIO()
    sweep = tmp_path / "sweep"
    assert launch(["optim.lr=0.1,0.2", f"sweep.dir={sweep}"], out, tmp_path, NO_SLURM,
                  show_cfg=True) == 0
    text = out.getvalue()
    assert "# point 0: optim.lr=0.1" in text and "# point 1: optim.lr=0.2" in text
    assert text.count("\noptim:\n") == 2 and "lr: 0.2" in text
    assert not sweep.exists()


def test_dry_run_lists_the_points_and_starts_nothing(tmp_path: Path) -> None:
    out = io.StringIO()
    sweep = tmp_path / "sweep"
    assert launch(["optim.lr=0.1,0.2", "dry_run=true", f"sweep.dir={sweep}"], out, tmp_path,
                  NO_SLURM) == 0
    assert "would run 2 points here" in out.getvalue() and "nothing was started" in out.getvalue()
    assert not sweep.exists()


def test_glob_picks_the_groups_options(tmp_path: Path) -> None:
    _, points, plans = plan_points(["model=glob(res*)", f"sweep.dir={tmp_path / 's'}"],
                                   tmp_path, NO_SLURM)
    assert [p.label() for p in points] == ["model=resnet18", "model=resnet50"]
    assert [p.cfg.model.name for p in plans] == ["resnet18", "resnet50"]


@pytest.mark.parametrize("override, message", [
    ("optim.lr=interval(0,1)", "continuous range"),
    ("optim.lr=glob(*)", "optim.lr is not one"),
    ("trainer.seed=range(0,0)", r"^trainer\.seed=range\(0,0\): sweeps over no value"),
])
def test_sweeps_a_grid_cannot_hold_are_refused(tmp_path: Path, override: str,
                                               message: str) -> None:
    with pytest.raises(UserError, match=message):
        plan_points([override, f"sweep.dir={tmp_path / 's'}"], tmp_path, NO_SLURM)


def test_each_point_keeps_the_cluster_it_asked_for(tmp_path: Path) -> None:
    # cluster=auto resolves once; an explicit kind is never overwritten by point 0's.
    with pytest.raises(UserError, match="cluster=local/slurm: differs between sweep points"):
        plan_points(["cluster=local,slurm", f"sweep.dir={tmp_path / 's'}"], tmp_path, NO_SLURM)
    _, _, plans = plan_points(["optim.lr=0.1,0.2", f"sweep.dir={tmp_path / 't'}"], tmp_path,
                              NO_SLURM)
    assert {p.cfg.cluster.kind for p in plans} == {"local"}


def test_local_sweep_lines_are_rounded_and_a_stop_says_so() -> None:
    from hpc_ddp.rank.supervise.outcome import summary_line
    from hpc_ddp.sweep.launch import progress_line

    assert progress_line({"step": 40, "total_steps": 64, "loss": 1.30861234,
                          "samples_per_s": 16320.7, "epoch": 1}) == \
        "step 40/64  loss 1.3086  16321 samples/s  epoch 1"
    # A stop's progress has no speed (not "0 samples/s") and says what happened.
    assert progress_line({"step": 520, "total_steps": 100000, "loss": 0.0003, "stopped": 1.0,
                          "epoch": 16}) == "stopped at step 520 of 100000, checkpoint saved"
    assert progress_line({"step": 7, "total_steps": None, "sum_of_ranks": 1.0}) == \
        "step 7  sum_of_ranks 1"  # a loop that gave no total
    assert summary_line({"global_step": 20, "eval_loss": 1.650234, "eval_accuracy": 0.404296875}
                        ) == "step 20, eval loss 1.6502, eval accuracy 0.4043"


def test_a_sweeps_cfg_shows_its_folder(tmp_path: Path) -> None:
    out = io.StringIO()
    assert launch(["optim.lr=0.1", f"sweep.dir={tmp_path / 'lr'}"], out, cwd=tmp_path,
                  environ={}, show_cfg=True) == 0
    assert f"\nsweep:\n  dir: {tmp_path / 'lr'}\n" in out.getvalue()
    dry = io.StringIO()
    launch(["optim.lr=0.1", "cluster=local", "dry_run=true"], dry, cwd=tmp_path, environ={})
    assert dry.getvalue().startswith("would run 1 point here,")


def test_a_stop_while_arrays_go_out_says_what_went_out(tmp_path: Path) -> None:
    """SIGTERM between two arrays (launch/interrupts.py holds it while one goes out): the
    arrays already out are said, with how to see and cancel them; none: nothing is left."""
    import json
    import signal

    from hpc_ddp.launch.interrupts import Stopped
    from hpc_ddp.sweep.arrays import MANIFEST, stopped_submitting

    folder = tmp_path / "sweep"
    folder.mkdir()
    points = [{"index": i, "job_id": f"7_{i}" if i < 2 else None} for i in range(3)]
    out = io.StringIO()
    code = stopped_submitting({"points": points, "arrays": ["7"]}, folder, True,
                              Stopped(signal.SIGTERM), out)
    assert code == 128 + signal.SIGTERM
    assert out.getvalue().startswith("stopped (SIGTERM): 2 of 3 points went out (job array(s) "
                                     f"7) and run; the others were not submitted. python -m "
                                     f"hpc_ddp.status {folder} shows them (--cancel")
    assert json.loads((folder / MANIFEST).read_text())["arrays"] == ["7"]
    out = io.StringIO()
    none = [{**p, "job_id": None} for p in points]
    assert stopped_submitting({"points": none, "arrays": []}, folder, True, KeyboardInterrupt(),
                              out) == 130
    assert "stopped (Ctrl-C) before any point was submitted" in out.getvalue()
    assert not folder.exists()
