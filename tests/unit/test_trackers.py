"""The trackers' pure parts: logger= read and refused in one line, offline mode chosen, a
tracking URI's credentials kept out of trackers.json, and a tracker that fails to log left
with a warning (training goes on)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hpc_ddp.config.loggers import trackers_of
from hpc_ddp.errors import UserError
from hpc_ddp.rank.services import trackers


@pytest.mark.parametrize("logger, kinds", [
    ("tensorboard", []), ("wandb", ["wandb"]), (["wandb", "mlflow"], ["wandb", "mlflow"]),
    ("tensorboard,mlflow", ["mlflow"]), (["WandB", "wandb"], ["wandb"])])
def test_logger_values(logger: object, kinds: list[str]) -> None:
    assert trackers_of(logger) == kinds


def test_an_unknown_tracker_is_refused_with_the_fix() -> None:
    with pytest.raises(UserError, match="logger=comet: 'comet' is not a tracker") as caught:
        trackers_of("comet")
    assert "logger=[wandb,mlflow]" in caught.value.message


@pytest.mark.parametrize("setting, environ, expected", [
    (True, {"WANDB_API_KEY": "x"}, True), (False, {}, False), (None, {}, True),
    (None, {"WANDB_API_KEY": "x"}, False), (None, {"WANDB_MODE": "online"}, False),
    (None, {"WANDB_API_KEY": "x", "WANDB_MODE": "offline"}, True)])
def test_offline_unless_the_job_can_log_in(setting: bool | None, environ: dict[str, str],
                                           expected: bool) -> None:
    assert trackers.offline(setting, environ) is expected


def test_a_uri_loses_its_credentials() -> None:
    assert trackers._without_userinfo("https://me:s3cret@mlflow.example/x") == \
        "https://mlflow.example/x"
    assert trackers._without_userinfo("file:/runs/mlruns") == "file:/runs/mlruns"


def test_a_tracker_that_fails_is_left_with_a_warning(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    # a run the store does not hold (deleted meanwhile, say): logging to it fails
    record = {"mlflow": {"run_id": "0" * 32, "tracking_uri": f"file:{tmp_path}/mlruns",
                         "experiment": "x"}}
    environ: dict[str, str] = {}
    opened = trackers.Trackers(record, {}, "run", environ)
    with caplog.at_level(logging.WARNING):
        opened.log(10, {"train/loss": 1.0})
        opened.log(20, {"train/loss": 0.5})  # closed: nothing more is tried
    assert [r.getMessage() for r in caplog.records].count(
        next(r.getMessage() for r in caplog.records if "tracker failed" in r.getMessage())) == 1
    assert environ["MLFLOW_ALLOW_FILE_STORE"] == "true"
