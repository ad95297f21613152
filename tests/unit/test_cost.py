"""What a run cost: sacct's records of every start of a job (requeues) summed into wall time,
queue wait, running time, CPU-hours and GPU-hours; a sweep's total; a local run's from its
processes."""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path

import pytest

from hpc_ddp.rundir import RunDir
from hpc_ddp.slurm.cost import Cost, gpus_of
from hpc_ddp.slurm.state import parse_costs, parse_sacct
from hpc_ddp.watch import runcost


def _t(seconds: int) -> str:
    """sacct's local time text, ``seconds`` after a fixed moment."""
    return (dt.datetime(2026, 12, 3, 8, 0, 0) + dt.timedelta(seconds=seconds)).isoformat()


T0 = dt.datetime(2026, 12, 3, 8, 0, 0).timestamp()
# Job 7 requeued once: its first start (submitted at 0, started at 30, requeued at 130, 100 s
# on 4 CPUs and 2 GPUs), then the second (waited from 130 to 250, ran 60 s). Array 9: task 0
# done, tasks 1-2 still pending since 0.
SACCT = "\n".join([
    f"7|REQUEUED|0:0|None|{_t(0)}|{_t(30)}|{_t(130)}|100|4|billing=4,cpu=4,gres/gpu=2,"
    "gres/gpu:h100=2,mem=8G,node=2|2",
    f"7|COMPLETED|0:0|None|{_t(130)}|{_t(250)}|{_t(310)}|60|4|billing=4,cpu=4,gres/gpu=2,"
    "mem=8G,node=2|2",
    f"9_0|COMPLETED|0:0|None|{_t(0)}|{_t(5)}|{_t(65)}|60|2|cpu=2,mem=1G,node=1|1",
    f"9_[1-2]|PENDING|0:0|Priority|{_t(0)}|Unknown|Unknown|0|0||1",
])


def test_a_requeued_job_costs_the_sum_of_its_starts() -> None:
    costs = parse_costs(SACCT, now=T0 + 400)
    seven = costs["7"]
    assert seven.starts == 2
    assert seven.queue_s == pytest.approx(30 + 120)
    assert seven.running_s == 160
    assert seven.wall_s == pytest.approx(310)
    assert seven.cpu_hours == pytest.approx(160 * 4 / 3600)
    assert seven.gpu_hours == pytest.approx(160 * 2 / 3600)
    # the latest start's state, not the requeued one's
    assert parse_sacct(SACCT)["7"].state == "COMPLETED"


def test_pending_array_tasks_have_waited_since_submission() -> None:
    costs = parse_costs(SACCT, now=T0 + 400)
    assert costs["9_1"].queue_s == pytest.approx(400) and costs["9_1"].running_s == 0
    assert costs["9_1"].wall_s == pytest.approx(400)
    assert costs["9_0"].cpu_hours == pytest.approx(60 * 2 / 3600)


@pytest.mark.parametrize("tres, gpus", [
    ("cpu=4,gres/gpu=2,gres/gpu:h100=2,mem=8G", 2), ("cpu=4,gres/gpu:a100=3", 3),
    ("cpu=2,mem=1G,node=1", 0), ("", 0)])
def test_gpus_of_tres(tres: str, gpus: int) -> None:
    assert gpus_of(tres) == gpus


def test_a_resumed_runs_jobs_add_up_and_a_sweep_totals() -> None:
    costs = parse_costs(SACCT, now=T0 + 400)
    job = {"kind": "slurm", "job_id": "9_0", "history": [{"job_id": "7"}, {"job_id": "9_0"}]}
    both = runcost.slurm_cost(job, costs)
    assert both is not None and both.running_s == 160 + 60 and both.starts == 3
    rows = [{"cost": costs["7"].as_dict()}, {"cost": costs["9_0"].as_dict()}]
    said = runcost.sweep_cost(rows)
    assert "2 points" in said and "0.089 GPU-hours (0.044 a point)" in said


def test_a_resumed_slurm_runs_wall_time_spans_its_jobs_as_sacct_does() -> None:
    """Issue 46: a run submitted at 0 (job 11, ended at 10) and resumed at 16 (job 12, ended
    at 34): sacct's first Submit to last End is 34 s; the jobs' wall times added up, 28 s."""
    sacct = "\n".join([
        f"11|COMPLETED|0:0|None|{_t(0)}|{_t(1)}|{_t(10)}|9|2|cpu=2,node=1|1",
        f"12|COMPLETED|0:0|None|{_t(16)}|{_t(17)}|{_t(34)}|17|2|cpu=2,node=1|1"])
    job = {"kind": "slurm", "job_id": "12", "history": [{"job_id": "11"}, {"job_id": "12"}]}
    cost = runcost.slurm_cost(job, parse_costs(sacct, now=T0 + 100))
    assert cost is not None and cost.wall_s == pytest.approx(34)
    assert cost.queue_s == pytest.approx(2) and cost.running_s == 26
    assert runcost.line(cost).startswith("wall 34s (queued 2s, running 26s)")
    # The resume still running: up to now.
    running = "\n".join([sacct.splitlines()[0],
                          f"12|RUNNING|0:0|None|{_t(16)}|{_t(17)}|Unknown|23|2|cpu=2|1"])
    cost = runcost.slurm_cost(job, parse_costs(running, now=T0 + 40))
    assert cost is not None and cost.wall_s == pytest.approx(40)
    assert "submitted" not in cost.as_dict()  # summary.json's fields as before


def test_a_local_resume_killed_before_its_ranks_recorded_their_exit(tmp_path: Path) -> None:
    """The first attempt's ranks recorded their exit at 10; the resume (submitted at 100)
    was killed before its ranks could, and ended at 130: its wall time is 130 s, not 10."""
    run = RunDir(tmp_path)
    run.ranks.mkdir()
    t0 = 1_800_000_000.0
    run.rank_usage(0).write_text(json.dumps({"attempts": {"a.0": {"cpu_s": 5.0,
                                                                   "time": t0 + 10}}}))
    history = [{"job_id": "1", "submitted": t0}, {"job_id": "2", "submitted": t0 + 100}]
    cost = runcost.local_cost(run, {**history[-1], "history": history}, ended=t0 + 130)
    assert cost is not None and cost.wall_s == pytest.approx(130)
    assert cost.running_s == pytest.approx(10 + 30)


def test_a_local_run_counts_its_ranks_cpu_time(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.ranks.mkdir()
    for rank, cpu in ((0, 1800.0), (1, 1800.0)):
        run.rank_usage(rank).write_text(json.dumps({"cpu_s": cpu}))
    job = {"kind": "local", "job_id": "1", "submitted": time.time() - 100}
    cost = runcost.local_cost(run, job, ended=None)
    assert cost is not None and cost.cpu_hours == pytest.approx(1.0)
    assert cost.wall_s == pytest.approx(100, abs=5) and cost.queue_s == 0
    (tmp_path / "summary.json").write_text("{}")
    runcost.record(run, cost)
    assert Cost(**json.loads((tmp_path / "summary.json").read_text())["cost"]).cpu_hours == 1.0


def test_gpu_hours_where_accounting_tracks_no_gpus(tmp_path: Path) -> None:
    """A site whose accounting leaves gres/gpu out of AllocTRES: node-hours times the GPUs
    per node the run asked for (its config.yaml)."""
    costs = parse_costs(SACCT, now=T0 + 400)
    job = {"kind": "slurm", "job_id": "9_0"}
    assert costs["9_0"].gpu_hours == 0 and costs["9_0"].node_hours == pytest.approx(60 / 3600)
    (tmp_path / "config.yaml").write_text("cluster:\n  gpus_per_node: 8\n")
    row = runcost.run_cost(tmp_path, job, "COMPLETED", costs)
    assert row is not None and row["gpu_hours"] == pytest.approx(8 * 60 / 3600, abs=1e-4)
