"""StepTimer splits a loop it is not part of; the bench's report turns windows into ratios."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hpc_ddp.bench import train as bench
from hpc_ddp.bench import train_plan
from hpc_ddp.bench.train_report import combine, overhead_of, rows_of, table
from hpc_ddp.errors import UserError
from hpc_ddp.trainer.loop_timing import StepTimer, Window


class SlowLoader:
    """Batches that each take ``delay`` seconds to arrive."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay, self.generator = n, delay, "mine"

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(self.n):
            time.sleep(self.delay)
            yield torch.randn(8, 4), torch.randint(0, 2, (8,))


def test_a_plain_loop_splits_into_its_phases() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    timer = StepTimer(torch.device("cpu")).attach(model.parameters(), optimizer)
    loader = timer.wrap(SlowLoader(6, 0.01))
    assert loader.generator == "mine" and len(list(timer.wrap([1, 2]))) == 2
    timer.start()
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    window = timer.stop(6)
    assert window.steps == 6 and window.data_s >= 0.06
    assert window.compute_s > 0 and window.optimizer_s > 0 and window.comm_s >= 0
    parts = window.data_s + window.compute_s + window.comm_s + window.optimizer_s
    assert parts <= window.wall_s and window.other_s == pytest.approx(window.wall_s - parts)
    ms = window.per_step_ms()
    assert ms["step"] == pytest.approx(window.wall_s * 1e3 / 6)
    assert window.mem_kind == "cpu_rss" and (window.peak_mem_mb or 0) > 0
    timer.detach()
    timer.start()  # detached: nothing is counted any more
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    assert timer.stop(1).optimizer_s == 0


def _window(wall: float, **phases: float) -> dict[str, Any]:
    w = Window(steps=10, wall_s=wall, data_s=phases.get("data", 0.0),
               compute_s=phases.get("compute", wall / 2), comm_s=0.0, optimizer_s=0.0,
               peak_mem_mb=100.0, mem_kind="cpu_rss", step_mem_mb=5.0)
    return w.as_dict()


def _job() -> dict[str, Any]:
    def model(name: str, base: list[float], exact: list[float],
              tuned: list[float]) -> dict[str, Any]:
        # Two ranks; the slower rank's wall time counts.
        return {"model": name, "steps_per_window": 10, "order": ["baseline", "exact", "tuned"],
                "settings": {"baseline": {}, "exact": {}, "tuned": {}},
                "windows": {k: [[_window(w), _window(w * 0.9)] for w in walls]
                            for k, walls in (("baseline", base), ("exact", exact),
                                             ("tuned", tuned))}}
    return {"world_size": 2, "batch_size": 8, "device": "cpu", "backend": "gloo",
            "threads_per_rank": 1, "image_size": 32, "torch": "x", "time": 0.0,
            "models": [model("null", [0.10, 0.20, 0.10], [0.101, 0.202, 0.101],
                             [0.09, 0.18, 0.09]),
                       model("tiny_cnn", [1.0, 2.0, 1.0], [0.9, 2.0, 1.0], [0.5, 1.0, 0.8])]}


def test_ratios_are_per_round_and_overhead_is_exact_minus_baseline() -> None:
    rows = {(r["model"], r["setting"]): r for r in rows_of(_job())}
    tuned = rows[("tiny_cnn", "tuned")]
    assert tuned["ratio"] == pytest.approx(2.0)  # rounds: 2.0, 2.0, 1.25
    assert tuned["ratios"] == pytest.approx([2.0, 2.0, 1.25])
    assert tuned["samples_per_s"] == pytest.approx(2 * 8 * 10 / 0.8)
    assert tuned["samples_per_s_per_rank"] == pytest.approx(tuned["samples_per_s"] / 2)
    assert rows[("tiny_cnn", "baseline")]["ratio"] == 1.0
    overhead = overhead_of(_job())
    assert overhead is not None
    assert overhead["overhead_ms"] == pytest.approx(0.1)  # 1 ms per 10 steps, median
    assert overhead["overhead_pct_of_tiny_cnn_step"] == pytest.approx(100 * 0.1 / 100)
    result = combine([_job()], {})
    text = table(result)
    for column in ("samples/s", "/rank", "x baseline", "data", "fwd+bwd", "comm", "optim",
                   "peak MB"):
        assert column in text
    assert "framework overhead" in text and "target tiny_cnn 2 ranks tuned: 2.000x" in text
    met = {t["what"]: t["met"] for t in result["targets"]}
    assert met == {"tiny_cnn 2 ranks exact": True, "tiny_cnn 2 ranks tuned": True,
                   "overhead per step, 2 ranks": True}


def test_variants_from_the_command_line() -> None:
    got = bench.variants_from("plain,exact,tuned", ["fp32:tuned trainer.precision=fp32"],
                              False)
    assert [v.name for v in got] == ["plain", "exact", "tuned", "fp32"]
    assert got[3].overrides == ("trainer.precision=fp32",) and got[1].overrides == bench.EXACT
    assert got[0].overrides == (*bench.EXACT, "data.batched=false")
    assert len(bench.variants_from("tuned", [], True)) == 1 + len(bench.ABLATIONS)
    for settings, extra in (("fast", []), ("tuned", ["x:nope a=b"]), ("tuned", ["tuned:tuned"]),
                            ("tuned", ["x:tuned novalue"])):
        with pytest.raises(UserError):
            bench.variants_from(settings, extra, False)


def test_variant_overrides_are_checked() -> None:
    from hpc_ddp.config.compose import compose

    cfg = compose([])
    assert train_plan.with_overrides(cfg, ["trainer.precision=fp32"]).trainer.precision == "fp32"
    with pytest.raises(UserError):
        train_plan.with_overrides(cfg, ["trainer.precision=fp8"])
    with pytest.raises(UserError):
        train_plan.with_overrides(cfg, ["trainer.nope=1"])
    assert train_plan.replace_model(cfg, "null").model.name == "null"


def test_the_checkpoint_stall_is_per_checkpoint_against_tuned() -> None:
    from hpc_ddp.bench.train import checkpoint_variants
    from hpc_ddp.bench.train_report import checkpoint_stalls

    names = [v.name for v in checkpoint_variants(5, ())]
    assert names == ["tuned", "ckpt-sync", "ckpt-background"]

    def windows(walls: list[float], other: float, checkpoints: int) -> list[Any]:
        made = []
        for wall in walls:
            w = {**_window(wall), "checkpoints": checkpoints}
            w["other_s"] = other
            made.append([w, w])
        return made

    model = {"model": "resnet18", "steps_per_window": 10, "checkpoint_mb": {"ckpt-sync": 85},
             "windows": {"tuned": windows([1.0, 1.0, 1.2], 0.01, 0),
                         "ckpt-sync": windows([1.4, 1.5, 1.6], 0.41, 2),
                         "ckpt-background": windows([1.05, 1.1, 1.2], 0.03, 2)}}
    (stall,) = checkpoint_stalls({"world_size": 2, "models": [model]})
    assert stall["sync_ms"] == pytest.approx(200.0)  # (0.4, 0.5, 0.4) s over 2 checkpoints
    assert stall["sync_in_step_ms"] == pytest.approx(200.0)
    assert stall["background_ms"] == pytest.approx(25.0)
    assert stall["background_in_step_ms"] == pytest.approx(10.0)
    assert stall["checkpoint_mb"] == 85
