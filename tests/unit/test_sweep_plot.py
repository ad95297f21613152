"""status --plot: readable when one point diverges, and the metric by hyperparameter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_ddp.sweep.plot import figure, final_metric, spans_decades, sweep_axis


@pytest.mark.parametrize("values, log", [
    ([2.3, 1.1, 0.4], False),
    ([2.3, 0.01], True),              # two decades
    ([1e6, 2.0, 0.5], True),          # one point diverged
    ([1.0, -1.0, 1e6], False),        # not positive: no log scale
    ([float("nan"), 2.0, 300.0], True),
    ([], False),
])
def test_log_scale_when_values_span_decades(values: list[float], log: bool) -> None:
    assert spans_decades(values) is log


def test_the_swept_number_is_the_axis_and_the_rest_make_the_lines() -> None:
    params = [{"model": m, "optim.lr": lr} for m in ("tiny_cnn", "resnet18")
              for lr in (0.1, 0.01)]
    assert sweep_axis(params) == ("optim.lr", ["model"])
    assert sweep_axis([{}, {}]) is None
    assert final_metric([{"eval_accuracy": 0.5}, {}]) == ("eval accuracy", [0.5, None])
    assert final_metric([{"eval_loss": 0.2}]) == ("eval loss", [0.2])


def _run(folder: Path, lr: float, losses: list[float], accuracy: float) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder / "tb"))
    for step, loss in enumerate(losses, 1):
        writer.add_scalar("train/loss", loss, step * 10)
    writer.add_scalar("eval/accuracy", accuracy, len(losses) * 10)
    writer.close()
    (folder / "hparams.json").write_text(json.dumps({"optim.lr": lr}))
    (folder / "summary.json").write_text(json.dumps({"eval_accuracy": accuracy}))
    return folder


def test_a_diverging_point_gets_a_log_axis_and_the_sweep_a_metric_panel(tmp_path: Path) -> None:
    runs = [(f"{i:03d}", _run(tmp_path / f"{i:03d}", lr, losses, acc)) for i, (lr, losses, acc)
            in enumerate([(0.001, [2.3, 2.0, 1.8], 0.3), (0.01, [2.3, 1.2, 0.6], 0.7),
                          (1.0, [2.3, 900.0, 4e5], 0.1)])]
    fig = figure(runs)
    loss, acc, metric = fig.axes
    assert loss.get_yscale() == "log" and "log scale" in loss.get_title()
    assert acc.get_yscale() == "linear" and acc.get_title() == "eval/accuracy"
    assert metric.get_title() == "final eval accuracy by optim.lr"
    assert metric.get_xscale() == "log"  # 0.001 .. 1.0
    (line,) = metric.get_lines()
    assert list(line.get_xdata()) == [0.001, 0.01, 1.0]
    assert list(line.get_ydata()) == [0.3, 0.7, 0.1]
    one = figure(runs[:1])  # a single run: its curves, no sweep panel
    assert len(one.axes) == 2 and one.axes[0].get_yscale() == "linear"
