"""bench search's figures (bench/search_figures.py) and each way's overrides: node-seconds
held, idle between trials, and node-seconds until the batched way's best was reached."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_ddp.bench import search_figures as sf
from hpc_ddp.bench.search import way_overrides
from hpc_ddp.bench.search_figures import Trial


def test_batched_workers_idle_while_the_slowest_trial_runs() -> None:
    # Two workers, one node each: trials 0 (10 s) and 1 (2 s) in the first batch; in the
    # batched way trial 2 waits for trial 0, its worker idle 8 s.
    batched = [Trial(0, 0, 10, 0.5, "COMPLETE"), Trial(1, 0, 2, 0.9, "COMPLETE"),
               Trial(2, 10, 12, 0.3, "COMPLETE")]
    got = sf.figures("batched", batched, [(0, 12), (0, 12)], nodes=1, minimize=True,
                     target=0.3)
    assert got.held_node_s == 24 and got.trial_node_s == 14 and got.wall_s == 12
    assert got.idle_share == pytest.approx(10 / 24) and got.best == 0.3
    assert got.to_target_node_s == 24  # reached at t=12: both workers held to then
    eager = [Trial(0, 0, 10, 0.5, "COMPLETE"), Trial(1, 0, 2, 0.9, "COMPLETE"),
             Trial(2, 2, 4, 0.3, "COMPLETE")]
    fast = sf.figures("async", eager, [(0, 10), (0, 4)], nodes=2, minimize=True, target=0.3)
    assert fast.held_node_s == 28 and fast.idle_share == pytest.approx(0.0)
    assert fast.to_target_node_s == 16  # at t=4: 4 s of each worker, two nodes each
    never = sf.figures("x", eager[:2], [(0, 10)], nodes=1, minimize=True, target=0.3)
    assert never.to_target_node_s is None and never.best == 0.5
    pruned = [Trial(0, 0, 1, None, "PRUNED"), Trial(1, 1, 3, 0.7, "COMPLETE")]
    high = sf.figures("max", pruned, [(0, 3)], nodes=1, minimize=False, target=0.7)
    assert high.pruned == 1 and high.best == 0.7 and high.to_target_node_s == 3
    text = sf.table([got, fast, never], 0.3)
    assert text.splitlines()[2].split()[-1] == "0.67" and "never" in text.splitlines()[3]


def test_each_way_runs_the_same_search(tmp_path: Path) -> None:
    given = ["cluster=slurm", "optim.lr=choice(0.1, 1000)", "hydra.sweeper.n_jobs=3",
             "hydra.sweeper.pruner=threshold", "hydra.sweeper.pruner.upper=50"]
    ways = [way_overrides(given, i, tmp_path) for i in range(3)]
    assert ways[0] == ways[1] == ["-m", "hydra/sweeper=optuna", "cluster=slurm",
                                  "optim.lr=choice(0.1, 1000)", "hydra.sweeper.n_jobs=3",
                                  f"sweep.dir={tmp_path}"]
    assert ways[2][-3:] == ["hydra.sweeper.pruner=threshold", "hydra.sweeper.pruner.upper=50",
                            f"sweep.dir={tmp_path}"]
    assert way_overrides(given[:3], 2, tmp_path)[-2] == "hydra.sweeper.pruner=median"
