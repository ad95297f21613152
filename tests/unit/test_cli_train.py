"""``python -m hpc_ddp.train`` checks run_dir as submit does, as far as it holds per rank."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from hpc_ddp.config.compose import compose
from hpc_ddp.errors import UserError
from hpc_ddp.train import check_run_dir, main


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(key)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)


def test_a_file_as_run_dir_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main([f"run_dir={afile}", "trainer.max_steps=4"]) == 2
    err = capsys.readouterr().err
    assert "is a file, not a folder" in err and "Traceback" not in err
    assert afile.read_text() == "x"


def test_resume_of_a_missing_run_is_refused(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    typo = tmp_path / "typo"
    assert main([f"run_dir={typo}", "resume=true", "trainer.max_steps=4"]) == 2
    assert "holds no run to resume" in capsys.readouterr().err
    assert not typo.exists()  # nothing was started there


def test_a_run_dir_that_cannot_be_written_is_refused(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    def read_only(*args: object, **kwargs: object) -> str:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)  # root ignores mode bits
    assert main([f"run_dir={tmp_path / 'r'}", "trainer.max_steps=4"]) == 2
    assert "is not writable (Permission denied)" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_what_every_rank_accepts(tmp_path: Path) -> None:
    cfg = compose([f"run_dir={tmp_path / 'r'}"])
    check_run_dir(cfg, tmp_path / "r", restart=0)  # new
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.yaml").write_text("{}\n")
    check_run_dir(cfg, tmp_path / "r", restart=0)  # rank 0 wrote its config.yaml already
    check_run_dir(compose([f"run_dir={tmp_path / 'r'}", "resume=true"]), tmp_path / "r", 0)
    # A requeued start of a resume=true job: the run is its own, whatever the folder holds.
    check_run_dir(compose([f"run_dir={tmp_path / 'q'}", "resume=true"]), tmp_path / "q", 1)


def test_the_default_run_dir_is_named_when_it_is_a_file(tmp_path: Path) -> None:
    afile = tmp_path / "job-7"
    afile.write_text("")
    with pytest.raises(UserError, match="job-7: is a file"):
        check_run_dir(compose([]), afile, restart=0)
