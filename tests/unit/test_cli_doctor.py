"""``python -m hpc_ddp.doctor``: options checked before any job is submitted."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_ddp.doctor.__main__ import main


@pytest.mark.parametrize("args, said", [(["--timeout-s", "0"], "--timeout-s=0.0"),
                                        (["--timeout-s", "-3"], "--timeout-s=-3.0"),
                                        (["--size-mib", "nan"], "--size-mib/--iters=nan/5")])
def test_non_positive_values_are_refused(args: list[str], said: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "outputs").exists()  # no job was prepared
