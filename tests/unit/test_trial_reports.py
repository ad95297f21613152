"""ctx.report outside and inside an adaptive sweep's trial (rank/context/trial.py); a real
study prunes a user's loop in tests/integration/test_adaptive_sweep.py (the bench)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hpc_ddp.rank.context.trial import TrialReports
from hpc_ddp.rank.contract import PRUNED_FILE, TRIAL_ENV
from hpc_ddp.rank.services import pruning


class Loop(TrialReports):
    def __init__(self, root: Path, master: bool = True) -> None:
        self.device = "cpu"
        self.env = SimpleNamespace(is_master=master)  # type: ignore[assignment]
        self.run = SimpleNamespace(root=root)  # type: ignore[assignment]


def test_outside_a_sweep_a_report_is_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    monkeypatch.delenv(TRIAL_ENV, raising=False)
    loop = Loop(tmp_path)
    assert loop.report({"eval/loss": float("nan")}, 10) is False
    assert isinstance(loop._trial, pruning.NoTrial)
    assert not (tmp_path / PRUNED_FILE).exists()
    with pytest.raises(TypeError, match=r"eval/loss='low' is not a number. Fix: report numbers"):
        loop.report({"eval/loss": "low"}, 20)  # type: ignore[dict-item]


class Pruner:
    """A study's running trial that prunes at the second report."""

    def __init__(self) -> None:
        self.reported: list[tuple[float, int]] = []

    def report(self, value: float, step: int) -> None:
        self.reported.append((value, step))

    def should_prune(self) -> bool:
        return len(self.reported) >= 2


def test_in_a_trial_the_objective_is_reported_until_pruned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trial = Pruner()
    monkeypatch.setattr(pruning, "_open", lambda given: trial)
    monkeypatch.setenv(TRIAL_ENV, json.dumps({"folder": str(tmp_path), "trial": 3,
                                              "objective": "eval/accuracy"}))
    loop = Loop(tmp_path)
    # Its objective named with or without "eval/"; the other values are not reported.
    assert loop.report({"eval/accuracy": 0.5, "eval/loss": 2.0}, 10) is False
    assert loop.report({"accuracy": 0.25}, 20) is True
    assert trial.reported == [(0.5, 10), (0.25, 20)]
    assert json.loads((tmp_path / PRUNED_FILE).read_text())["step"] == 20
    # Pruned stays pruned: no report after it (Optuna refuses one), no collective.
    assert loop.report({"accuracy": 0.9}, 30) is True and len(trial.reported) == 2


def test_a_rank_other_than_0_never_opens_the_study(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def never(given: Any) -> Any:
        raise AssertionError("only rank 0 talks to the study")

    monkeypatch.setattr(pruning, "_open", never)
    monkeypatch.setenv(TRIAL_ENV, json.dumps({"folder": str(tmp_path), "trial": 1}))
    assert Loop(tmp_path, master=False).report({"eval/loss": 1.0}, 10) is False
