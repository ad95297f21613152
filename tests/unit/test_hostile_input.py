"""Input built to hurt (numbers that overflow, ranges that never end or never stop growing, a
YAML alias bomb, more processes than a machine has): one line, exit 2, nothing written,
nothing started."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hpc_ddp.submit import main

# 9 anchors of 9 aliases each: 9^9 values from a few hundred bytes once every alias is copied.
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n"
    for p, c in zip("abcdefgh", "bcdefghi", strict=True))


@pytest.mark.parametrize("args, said", [
    (["cluster=slurm", "cluster.mem_gb=1e308", "dry_run=true"],
     "cluster.mem_gb=1e+308: is more than any node has (1048576)."),
    (["cluster=slurm", "cluster.time_min=100000000000000000000000", "dry_run=true"],
     "cluster.time_min=100000000000000000000000: is more than a year of minutes"),
    (["-m", "trainer.seed=range(0,10,0)", "dry_run=true"],
     "trainer.seed=range(0,10,0): is not a range with a step other than 0."),
    (["-m", "optim.lr=range(0,1,1e-12)", "dry_run=true"],  # counted, never built
     "optim.lr=range(0,1,1e-12): makes 1000000000000 values, more than the 100000 points"),
    (["nodes=100000", "cluster=local"],
     "nodes=100000: a local run would start 200000 processes on this machine"),
])
def test_refused_in_one_line_with_nothing_written(args: list[str], said: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    where = [f"sweep.dir={tmp_path / 'sweep'}"] if "-m" in args else [
        f"run_dir={tmp_path / 'run'}"]
    assert main([*args, *where]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {said}") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_a_yaml_alias_bomb_in_a_config_folder_is_refused_before_it_is_built(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = tmp_path / "conf" / "app"
    conf.mkdir(parents=True)
    (conf / "bomb.yaml").write_text(BOMB)
    assert len(BOMB) < 400
    started = time.monotonic()
    code = main(["--config-dir", str(tmp_path / "conf"), "app=bomb", "--cfg"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"{conf / 'bomb.yaml'}=YAML aliases: expand its " in err and "to 490329064" in err
    print(f"refused in {time.monotonic() - started:.2f} s")  # a figure, not a limit


def test_a_config_that_is_large_without_aliases_is_read() -> None:
    from hpc_ddp.config import yaml_guard

    big = "values: [" + ", ".join(str(i) for i in range(50_000)) + "]\n"
    assert len(yaml_guard.load(big, "big.yaml")["values"]) == 50_000
    with pytest.raises(Exception, match="alias"):
        yaml_guard.load("&a [1, *a]", "self.yaml")


@pytest.mark.parametrize("name, text, said", [
    # A directive the guard's C loader rejects, which Hydra's pure-Python loader would read
    # and expand: refused, not waved through as "not YAML".
    ("bomb13.yaml", "%YAML 1.3\n---\n" + BOMB, "=YAML: does not parse (line 1)"),
    ("flow.yaml", "x: " + "[" * 5000 + "]" * 5000 + "\n", "=YAML: does not parse"),
    ("deep.yaml", "x: " + "[" * 70 + "1" + "]" * 70 + "\n", "=72 levels: nests deeper than 50"),
])
def test_a_config_file_the_guard_cannot_read_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str,
        said: str) -> None:
    conf = tmp_path / "conf" / "app"
    conf.mkdir(parents=True)
    (conf / name).write_text(text)
    started = time.monotonic()
    code = main(["--config-dir", str(tmp_path / "conf"), f"app={name[:-5]}", "--cfg"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: {conf / name}{said}"), err
    assert time.monotonic() - started < 30  # not the minutes an expanded bomb takes


@pytest.mark.parametrize("depth", [60, 150, 5000])
def test_a_value_nested_too_deep_on_the_command_line_is_refused(
        depth: int, capsys: pytest.CaptureFixture[str]) -> None:
    value = "[" * depth + "1" + "]" * depth
    assert main([f"app.x={value}", "--cfg"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: app.x={depth} levels: nests deeper than 50 levels (the command "
                   "line), which no config needs. Fix: flatten the value.\n")


def test_a_value_nested_as_deep_as_a_config_goes_is_read(
        capsys: pytest.CaptureFixture[str]) -> None:
    value = "[" * 45 + "1" + "]" * 45
    assert main([f"app.x={value}", "--cfg"]) == 0


def test_an_overrides_file_nested_too_deep_is_refused_on_resume(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main([f"run_dir={run}", "trainer.max_steps=2"]) == 0
    capsys.readouterr()
    (run / "overrides.yaml").write_text(f"- app.x={'[' * 90}1{']' * 90}\n")
    assert main([f"run_dir={run}", "resume=true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: app.x=90 levels: nests deeper than 50 levels") and (
        "overrides.yaml" in err and err.count("\n") == 1), err
