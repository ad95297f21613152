"""The gradient sync's share of a step: one split (loop_timing) for the benchmark, a run's
sampled steps (trainer/sync_probe.py) and its summary; the words status and the results
table print (watch/sync_lines.py). Milliseconds, on a plain loop in this process."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hpc_ddp.trainer import sync_probe
from hpc_ddp.trainer.loop_timing import Window, sync_share
from hpc_ddp.trainer.sync_probe import SyncProbe, figures, sampled
from hpc_ddp.trainer.throughput import RankClock
from hpc_ddp.watch import sync_lines
from hpc_ddp.watch.follow import results_table
from hpc_ddp.watch.status import render


@pytest.mark.parametrize("comm, step, share", [
    (0.25, 1.0, 0.25), (0.0, 1.0, 0.0), (1.2, 1.0, 1.0), (-0.1, 1.0, 0.0),
    (0.1, 0.0, None), (0.1, float("nan"), None)])
def test_the_share_is_comm_over_the_step(comm: float, step: float, share: float | None) -> None:
    assert sync_share(comm, step) == share


def _window(steps: int, wall: float, comm: float) -> Window:
    return Window(steps, wall, 0.0, wall - comm, comm, 0.0, None, "none", None)


def test_figures_are_a_ratio_of_sums() -> None:
    got = figures([_window(1, 0.010, 0.005), _window(1, 0.030, 0.005)])
    assert got.share == pytest.approx(0.25)  # 10 of 40 ms, not the mean of 50 % and 17 %
    assert got.sync_ms == pytest.approx(5.0) and got.step_ms == pytest.approx(20.0)
    assert got.summary() == {"sync_share": got.share, "sync_ms": got.sync_ms,
                             "sync_step_ms": got.step_ms, "sync_sampled_steps": 2}
    assert _window(1, 0.02, 0.005).sync_share == pytest.approx(0.25)
    none = figures([])
    assert none.summary() == {"sync_share": None, "sync_ms": None, "sync_step_ms": None,
                              "sync_sampled_steps": 0}
    assert sync_probe.summary_of(None) == none.summary() and sync_probe.values_of(None) == {}


def test_the_benchmark_splits_a_step_the_same_way() -> None:
    from hpc_ddp.bench.train_report import combine, rows_of, table

    window = _window(10, 0.2, 0.05).as_dict()  # 20 ms steps, 5 ms of them waiting on sync
    model = {"model": "tiny_cnn", "steps_per_window": 10, "order": ["baseline"],
             "settings": {"baseline": {}}, "windows": {"baseline": [[window, window]]}}
    job = {"world_size": 2, "batch_size": 8, "device": "cpu", "backend": "gloo",
           "threads_per_rank": 1, "image_size": 32, "torch": "x", "time": 0.0,
           "models": [model]}
    (row,) = rows_of(job)
    assert row["sync_share"] == pytest.approx(0.25) == _window(10, 0.2, 0.05).sync_share
    head, line = table(combine([job], {})).splitlines()[:2]
    assert head.split()[-3:] == ["sync", "peak", "MB"] and line.split()[-2:] == ["25%", "-"]


def test_sampled_steps_skip_the_warmup() -> None:
    assert [s for s in range(30) if sampled(s, 10)] == [2, 12, 22]
    assert [s for s in range(6) if sampled(s, 1)] == [2, 3, 4, 5]


def _loop(clock: RankClock, model: Any, optimizer: Any, steps: int, accum: int = 1,
          wait_s: float = 0.0, skip: set[int] | None = None) -> None:
    """A plain loop through the trainer's batch clock; ``wait_s`` after each backward
    stands for an all-reduce the backward did not hide; steps in ``skip`` take no
    optimizer step (a step the loss scaler skips)."""
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(steps * accum)]
    for i, (x, y) in enumerate(clock.batches(data)):
        F.cross_entropy(model(x), y).backward()
        if (i + 1) % accum == 0:
            time.sleep(wait_s)
            if i // accum not in (skip or set()):
                optimizer.step()
            optimizer.zero_grad()


def _parts() -> tuple[Any, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _hooked(model: Any) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def test_a_sampled_step_splits_like_the_benchmark() -> None:
    model, optimizer = _parts()
    probe = SyncProbe(torch.device("cpu"), model.parameters(), optimizer, every=3)
    _loop(RankClock(torch.device("cpu"), probe), model, optimizer, steps=9, wait_s=0.02)
    total = probe.total()
    assert total.steps == 3 and probe.steps == 9  # steps 2, 5 and 8 of 0..8
    assert total.sync_ms is not None and total.step_ms is not None
    assert 20.0 <= total.sync_ms <= total.step_ms  # the wait after the last gradient
    assert total.share == pytest.approx(total.sync_ms / total.step_ms)
    assert all(w.compute_s > 0 and w.optimizer_s > 0 for w in probe.recent)
    assert probe.values() == {"train/sync_share": pytest.approx(total.share)}
    assert _hooked(model) == 0  # the parameter hooks are gone after the sampled step's batch
    probe.close()


def test_accumulation_times_a_whole_step_and_a_skipped_step_is_dropped() -> None:
    model, optimizer = _parts()
    probe = SyncProbe(torch.device("cpu"), model.parameters(), optimizer, every=2, accum=3)
    _loop(RankClock(torch.device("cpu"), probe), model, optimizer, steps=5, accum=3,
          wait_s=0.01)
    assert probe.total().steps == 2  # steps 2 and 4
    window = probe.recent[-1]
    assert window.compute_s > 0 and window.comm_s >= 0.01
    model, optimizer = _parts()
    probe = SyncProbe(torch.device("cpu"), model.parameters(), optimizer, every=1)
    # Step 2 (sampled) is skipped: no optimizer step closes its window; it is dropped, and
    # the next step is sampled once a real step has ended.
    _loop(RankClock(torch.device("cpu"), probe), model, optimizer, steps=5, skip={2})
    assert probe.total().steps == 1 and probe.steps == 4
    probe.close()
    assert _hooked(model) == 0 and not optimizer._optimizer_step_post_hooks


def test_a_loop_of_your_own_is_followed_through_torchs_global_optimizer_hooks() -> None:
    # No batch clock and no hook of ours on the optimizer: entry= and script= loops.
    model, optimizer = _parts()
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # not followed
    probe = sync_probe.LoopProbe(every=3)
    for _ in range(9):
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        F.cross_entropy(model(x), y).backward()
        time.sleep(0.02)  # an all-reduce the backward did not hide
        optimizer.step()
        optimizer.zero_grad()
        other.step()
    total = probe.total()
    # Steps 3, 6 and 9 of 1..9: after the 2 warm-up steps, one in 3.
    assert probe.steps == 9 and total.steps == 3, total
    assert total.sync_ms is not None and total.step_ms is not None
    assert 20.0 <= total.sync_ms <= total.step_ms
    probe.close()
    assert _hooked(model) == 0
    optimizer.step()
    assert probe.steps == 9  # closed: torch's global hooks are gone
    assert sync_probe.summary_of(probe)["sync_sampled_steps"] == 3
    assert sync_probe.for_loop(1, "ddp") is None and sync_probe.for_loop(2, "fsdp") is None
    loop = sync_probe.for_loop(2, "ddp")
    assert isinstance(loop, sync_probe.LoopProbe)
    loop.close()


def test_only_a_multi_rank_ddp_run_is_probed() -> None:
    from hpc_ddp.config.compose import compose

    model, optimizer = _parts()
    t = compose([]).trainer
    assert sync_probe.for_trainer(model, optimizer, t, 1, torch.device("cpu")) is None
    probe = sync_probe.for_trainer(model, optimizer, t, 2, torch.device("cpu"))
    assert probe is not None and probe.every == max(t.log_interval, sync_probe.MIN_EVERY)
    probe.close()
    fsdp = compose(["trainer.strategy=fsdp", "trainer.channels_last=false"]).trainer
    assert sync_probe.for_trainer(model, optimizer, fsdp, 2, torch.device("cpu")) is None


@pytest.mark.parametrize("share, line", [
    (0.41, "gradient sync 41% of each step: see python -m hpc_ddp.bench scaling "
           "(docs/performance.md#scaling)"),
    (0.25, None), (0.1, None), (None, None), (True, None)])
def test_a_large_share_points_at_the_report(share: Any, line: str | None) -> None:
    assert sync_lines.pointer(share) == line


def test_the_results_table_says_the_share() -> None:
    base = {"world_size": 2, "nodes": ["a"], "global_step": 20, "samples_per_s": 100.0}
    table = results_table({**base, "sync_share": 0.41, "sync_ms": 12.34, "sync_step_ms": 30.1,
                           "sync_sampled_steps": 2})
    assert ("  gradient sync  41% of each step (12.3 of 30.1 ms, 2 steps sampled): see "
            "python -m hpc_ddp.bench scaling (docs/performance.md#scaling)") in table
    quiet = results_table({**base, "sync_share": 0.05, "sync_sampled_steps": 1})
    assert "5% of each step (1 step sampled)" in quiet and "scaling" not in quiet
    assert "gradient sync" not in results_table({**base, "sync_share": None})


def _row(label: str, share: float | None) -> dict[str, Any]:
    return {"label": label, "run_dir": f"/{label}", "job_id": "1", "state": "COMPLETED",
            "reason": None, "restarts": 0, "step": 20, "total_steps": 20, "loss": 1.0,
            "eval_accuracy": 0.5, "samples_per_s": 100.0, "sync_share": share}


def test_status_shows_the_share_and_points_at_the_report() -> None:
    text = render([_row("r1", 0.08)], is_sweep=False)
    header, line = text.splitlines()[:2]
    column = header.index(" sync ") + 1
    assert line[column:].split()[0] == "8%"
    assert "scaling" not in text
    text = render([_row("r1", 0.41)], is_sweep=False)
    assert ("run: gradient sync 41% of each step: see python -m hpc_ddp.bench scaling "
            "(docs/performance.md#scaling)") in text.splitlines()
    assert render([_row("r1", None)], is_sweep=False).splitlines()[1][column:][0] == "-"
    sweep = render([_row("a", 0.3), _row("b", 0.1), _row("c", 0.5)], is_sweep=True)
    assert ("a, c: gradient sync 30%-50% of each step: see python -m hpc_ddp.bench scaling "
            "(docs/performance.md#scaling)") in sweep.splitlines()
