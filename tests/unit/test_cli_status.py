"""``python -m hpc_ddp.status``: bad paths and options end in one line and exit code 2."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from hpc_ddp.status import main


def run_status(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    out = io.StringIO()
    code = main(args, out=out)
    return code, out.getvalue(), capsys.readouterr().err


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.yaml").write_text("cluster:\n  job_name: hpc_ddp\n")
    return folder


def test_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "job.json"
    afile.write_text("{}")
    code, _, err = run_status([str(afile)], capsys)
    assert code == 2 and "is a file, not a folder" in err and str(tmp_path) in err
    assert len(err.strip().splitlines()) == 1


def test_a_missing_path_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_status([str(tmp_path / "nope")], capsys)
    assert code == 2 and "does not exist" in err


@pytest.mark.parametrize("interval", ["-1", "0", "nan", "inf"])
def test_interval_must_be_positive(run_dir: Path, interval: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_status([str(run_dir), "--watch", "--interval", interval], capsys)
    assert code == 2 and "--interval=" in err and "positive" in err and out == ""


def test_plot_into_a_missing_folder_is_refused_first(run_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_status([str(run_dir), "--plot", str(tmp_path / "no" / "x.png")],
                                capsys)
    assert code == 2 and "does not exist" in err and out == ""  # before the table


def test_plot_needs_an_image_type(run_dir: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_status([str(run_dir), "--plot", str(tmp_path / "x.foo")], capsys)
    assert code == 2 and ".png" in err


@pytest.mark.parametrize("marker, job_name, said", [
    ("doctor.json", "hpc_ddp", "a doctor run"),
    (None, "hpc_ddp_doctor", "a doctor run"),
    ("bench/comm.json", "hpc_ddp", "bench comm"),
    (None, "hpc_ddp_bench-comm", "bench comm"),
    ("bench/train.json", "x", "bench train"),
])
def test_doctor_and_bench_folders_say_what_they_are(tmp_path: Path, marker: str | None,
                                                    job_name: str, said: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "config.yaml").write_text(f"cluster:\n  job_name: {job_name}\n")
    if marker:
        (folder / marker).parent.mkdir(parents=True, exist_ok=True)
        (folder / marker).write_text("{}")
    code, out, err = run_status([str(folder)], capsys)
    assert code == 2 and said in err and "NOT SUBMITTED" not in out


def test_a_run_made_by_train_still_shows(run_dir: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_status([str(run_dir)], capsys)
    assert code == 0 and "NOT SUBMITTED" in out


def test_best_point_without_accuracy_is_the_lowest_eval_loss() -> None:
    from hpc_ddp.status import best, render

    rows = [{"label": f"p{i}", "run_dir": f"/r{i}", "job_id": None, "state": "COMPLETED",
             "restarts": 0, "step": 5, "total_steps": 5, "loss": 0.1, "eval_accuracy": None,
             "eval_loss": loss} for i, loss in enumerate([0.3, 0.1, 0.2])]
    assert best(rows) == rows[1]
    assert "best point: p1 (eval loss 0.1000, /r1)" in render(rows, is_sweep=True)
    rows[2]["eval_accuracy"] = 0.5
    assert best(rows) == rows[2]
