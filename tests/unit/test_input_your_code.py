"""A user's code that cannot run is refused before anything starts: one line, exit 2, the key,
the value and the fix; no run dir is made."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_ddp.submit import main
from tests.conftest import REPO

PROJECT = REPO / "examples" / "seqproject"
PARTS = "tests.usercode.parts"


def refused(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
            cwd: Path = REPO) -> str:
    """stderr of ``python -m hpc_ddp.submit args`` run in this process; it must refuse."""
    import os

    run_dir = tmp_path / "run"
    here = Path.cwd()
    os.chdir(cwd)
    try:
        code = main(["cluster=local", f"run_dir={run_dir}", *args])
    finally:
        os.chdir(here)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert not run_dir.exists()
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Fix:" in lines[0], err
    return lines[0]


@pytest.mark.parametrize("args, words", [
    (["model._target_=nope_pkg.Net"], "model._target_=nope_pkg.Net: cannot be imported "
                                      "(No module named 'nope_pkg')"),
    (["model._target_=torch.nn.Linearr"], "did you mean torch.nn.Linear?"),
    (["model._target_=torch.nn.Linear", "model.in_featurs=3", "model.out_features=2"],
     "model.in_featurs=3: torch.nn.Linear takes no argument in_featurs. Fix: did you mean "
     "model.in_features?"),
    (["model._target_=torch.nn.Linear"], "missing a required argument: 'in_features'"),
    (["model._target_=builtins.dict"], "returned a dict, not a torch.nn.Module"),
    ([f"data._target_={PARTS}.empty_data"], "its train set is empty"),
    ([f"data._target_={PARTS}.not_datasets"], "returned a int, not the train and eval"),
    (["loss._target_=builtins.int"], "made a int, which cannot be called"),
    (["optim._target_=torch.optim.SGD", "optim.lrr=0.1"], "did you mean optim.lr?"),
    (["scheduler._target_=torch.optim.lr_scheduler.StepLR"],
     "scheduler._target_=torch.optim.lr_scheduler.StepLR: raised TypeError"),
    ([f"data._target_={PARTS}.classes_data", f"model._target_={PARTS}.Mlp",
      "model.num_classes=5"], "model.num_classes=5: the data "),
    (["entry=nope_pkg.train:main"], "entry=nope_pkg.train:main: cannot be imported"),
    (["entry=tests.usercode.entries:two_args"], "cannot be called with one argument"),
    (["entry=tests.usercode.entries:missing"], "has no attribute missing"),
    (["entry=tests.usercode.entries"], "is not module:function"),
    (["entry=a.b:c", "script=x.py"], "script=x.py: and entry=a.b:c are both set"),
    (["script=no_such_script.py"], "no_such_script.py: does not exist"),
    (["script=-m no_such_module_anywhere"], "module no_such_module_anywhere cannot be found"),
    (["--", "--epochs", "3"], "are arguments for a script, and no script is set"),
    (["script=x.py", "cluster.gpus_per_node=2", "cluster.gpu_binding=per_task"],
     "cluster.gpu_binding=per_task"),
    (["--config-dir", "/no/such/folder"], "config_dir=/no/such/folder: does not exist"),
    (["--config-dir"], "option=--config-dir: needs a folder"),
    (["model.num_clases=3"], "did you mean model.num_classes?"),
    (["optim.schedule=linear"], "optim.schedule=linear: has moved. Fix: use scheduler="),
])
def test_code_that_cannot_run_is_refused(args: list[str], words: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert words in refused(args, tmp_path, capsys)


def test_an_option_of_the_users_folder_is_listed_when_misspelt(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(["--config-dir", "conf", "model=seq_transformr"], tmp_path, capsys, PROJECT)
    assert "model=seq_transformr: no such model" in line
    assert "seq_transformer" in line and "tiny_cnn" in line  # both folders' options


def test_image_folder_without_its_eval_split(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "images" / "train" / "cat").mkdir(parents=True)
    line = refused(["data=image_folder", f"data.root={tmp_path / 'images'}"], tmp_path, capsys)
    assert "holds no val/ folder" in line and "data.eval_split" in line


@pytest.mark.parametrize("plus", ["+", "++"])
def test_a_target_with_hydras_plus_starts_the_part_afresh_too(plus: str) -> None:
    """+data._target_=... kept the default data's keys (then `takes no argument augment`);
    it means what data._target_=... means."""
    from hpc_ddp.config.compose import compose

    for given in ([f"{plus}data._target_=tests.usercode.parts:image_data"],
                  [f"{plus}data._target_=tests.usercode.parts:image_data", "data.size=8"]):
        cfg = compose(given)
        plain = compose([o.lstrip("+") for o in given])
        assert cfg.data == plain.data and cfg.data.target == "tests.usercode.parts:image_data"
        assert cfg.data.kwargs == ({"size": 8} if len(given) == 2 else {})
