"""``python -m hpc_ddp.testcluster``: bad usage is exit 2, found before anything starts.

Nothing here starts the cluster: every argument list is invalid, and starting is stubbed to
fail the test if it were reached."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_ddp.testcluster import __main__ as cli


@pytest.fixture(autouse=True)
def never_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the test cluster must not be checked or started here")

    monkeypatch.setattr(cli, "requirements_missing", refuse)
    monkeypatch.setattr(cli.TestCluster, "up", refuse)
    monkeypatch.setattr(cli.TestCluster, "down", refuse)
    monkeypatch.setattr(cli.TestCluster, "status", refuse)


@pytest.mark.parametrize("args, said", [
    (["up", "--nodes", "0"], "--nodes=0: must be at least 1"),
    (["up", "--cpus", "0"], "--cpus=0: must be at least 1"),
    (["up", "--gpus", "-1"], "--gpus=-1: must be at least 0"),
    (["up", "--timeout", "-5"], "--timeout=-5.0"),
    (["up", "--timeout", "0"], "--timeout=0.0"),
    (["up", "--nodes", "500"], "500 nodes do not fit"),
    (["status", "--nodes", "0"], "--nodes=0"),
])
def test_bad_usage_is_exit_2_before_anything_starts(args: list[str], said: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert said in err and "Fix:" in err and "Traceback" not in err


def test_a_state_dir_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "state"
    afile.write_text("")
    assert cli.main(["status", "--state-dir", str(afile)]) == 2
    assert "is a file" in capsys.readouterr().err
