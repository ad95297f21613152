"""The scaling report's arithmetic, verdict, fixes and options, on synthetic windows (the
real run: tests/integration/test_bench_scaling.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.bench import scaling_report as report
from hpc_ddp.bench.__main__ import main
from hpc_ddp.bench.scaling_plan import (
    default_sizes,
    fixes_for,
    parse_sizes,
    said,
    say,
    window_steps,
)
from hpc_ddp.bench.scaling_rank import node_labels, sub_env
from hpc_ddp.config.schema import TrainerConfig
from hpc_ddp.errors import UserError
from hpc_ddp.rank.join.distenv import DistEnv


def rank(wall: float, data: float = 0.0, compute: float = 0.0, comm: float = 0.0,
         optimizer: float = 0.0, steps: int = 10) -> dict[str, Any]:
    """One rank's Window dict: per-step milliseconds in, seconds of ``steps`` steps out."""
    s = steps / 1e3
    other = max(0.0, wall - data - compute - comm - optimizer)
    return {"steps": steps, "wall_s": wall * s, "data_s": data * s, "compute_s": compute * s,
            "comm_s": comm * s, "optimizer_s": optimizer * s, "other_s": other * s}


def run(nodes: int, per_rank: list[dict[str, Any]], windows: int = 3, batch: int = 32,
        ranks_per_node: int = 1, loss: float = 2.0) -> dict[str, Any]:
    ranks = nodes * ranks_per_node
    assert len(per_rank) == ranks
    return {"nodes": nodes, "ranks": ranks, "samples_per_step": batch * ranks,
            "windows": [list(per_rank) for _ in range(windows)], "loss": loss,
            "node_of_rank": [f"n{i // ranks_per_node}" for i in range(ranks)]}


def plain(nodes: int, step: float, **phases: float) -> dict[str, Any]:
    return run(nodes, [rank(step, **phases) for _ in range(nodes)])


# -- figures ------------------------------------------------------------------------------------
def test_samples_per_s_speedup_and_efficiency() -> None:
    # 1 node: 32 samples in 10 ms = 3200/s; 4 nodes: 128 samples in 12.5 ms = 10240/s.
    rows = report.rows_of([plain(4, 12.5, compute=8), plain(1, 10.0, compute=8)])
    assert [r["nodes"] for r in rows] == [1, 4]
    assert rows[0]["samples_per_s"] == pytest.approx(3200)
    assert rows[1]["samples_per_s"] == pytest.approx(10240)
    assert rows[1]["speedup"] == pytest.approx(3.2)
    assert rows[1]["efficiency"] == pytest.approx(0.8)  # 10240 / (4 * 3200)
    assert rows[0]["efficiency"] == pytest.approx(1.0)


def test_efficiency_is_against_the_smallest_count_measured() -> None:
    assert report.efficiency(300.0, 4, 100.0, 1) == pytest.approx(0.75)
    # From 2 nodes: 4 nodes should give twice 2 nodes' rate.
    assert report.efficiency(300.0, 4, 200.0, 2) == pytest.approx(0.75)
    assert report.efficiency(1.0, 2, 0.0, 1) is None


def test_a_window_is_its_slowest_ranks_and_the_rate_a_median_over_windows() -> None:
    fast, slow = rank(10.0, compute=5), rank(20.0, compute=5)
    r = run(2, [fast, slow])
    r["windows"][0] = [fast, rank(100.0, compute=5)]  # one disturbed window
    row = report.run_row(r)
    assert row["samples_per_s"] == pytest.approx(64 / 0.020)  # the slow rank's 20 ms
    assert row["step_ms"]["step"] == pytest.approx(15.0)  # mean over ranks, median over windows


def test_split_and_shares() -> None:
    row = report.run_row(plain(2, 20.0, data=2, compute=10, comm=5, optimizer=1))
    assert row["step_ms"]["other"] == pytest.approx(2.0)
    assert row["data_share"] == pytest.approx(0.1)
    assert row["sync_share"] == pytest.approx(0.25)


def test_busy_time_is_the_union_of_the_buckets_intervals() -> None:
    assert report.busy_s([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7)]) == pytest.approx(4.0)
    assert report.busy_s([]) == 0.0
    # (step, bucket, start, end, bytes) on two ranks; rank 1 starts each bucket later and
    # finds rank 0's data sent: a bucket runs from the last start to the last end.
    rank0 = [(0, 0, 0.000, 0.003, 1_000_000), (0, 1, 0.001, 0.005, 1_000_000),
             (1, 0, 0.010, 0.012, 1_000_000), (1, 1, 0.013, 0.015, 1_000_000)]
    rank1 = [(0, 0, 0.002, 0.0031, 1_000_000), (0, 1, 0.004, 0.0049, 1_000_000),
             (1, 0, 0.010, 0.012, 1_000_000), (1, 1, 0.013, 0.015, 1_000_000)]
    got = report.achieved([rank0, rank1], 1.0)
    # Step 0: [2, 3.1] and [4, 5] ms: 2.1 ms; step 1: 4 ms. 2 MB per step.
    assert got["busy_ms"] == pytest.approx((2.1 + 4.0) / 2)
    assert got["achieved_busbw_gbps"] == pytest.approx((2e6 / 2.1e-3 + 2e6 / 4e-3) / 2 / 1e9)
    assert got["bytes_per_step"] == 2_000_000 and got["probe_steps"] == 2
    assert report.achieved([[]], 1.0)["achieved_busbw_gbps"] is None


# -- the verdict --------------------------------------------------------------------------------
def rows(*runs: dict[str, Any]) -> list[dict[str, Any]]:
    return report.rows_of(list(runs))


def test_scales_well() -> None:
    found = report.verdict(rows(plain(1, 10.0, compute=8), plain(4, 11.0, compute=8)))
    assert found.cause == report.SCALES and "scales well" in found.line
    assert "efficiency 91% at 4 nodes" in found.line


def test_a_straggler_is_named_with_its_factor() -> None:
    top = run(4, [rank(20.0, compute=8, comm=10), rank(20.0, compute=8, comm=10),
                  rank(20.0, compute=14, comm=4), rank(20.0, compute=8, comm=10)])
    found = report.verdict(rows(plain(1, 10.0, compute=8), top))
    # The straggler is checked before the sync share, which its wait inflates everywhere else.
    assert found.cause == report.STRAGGLER and found.node == "n2"
    assert found.factor == pytest.approx(14 / 8)
    assert "node n2 computes 1.75x as long" in found.line


def test_a_straggler_among_two_nodes_is_measured_against_the_other() -> None:
    assert report.straggler({"a": 10.0, "b": 12.5}) == ("b", pytest.approx(1.25))
    assert report.straggler({"a": 10.0}) is None


def test_the_loader() -> None:
    found = report.verdict(rows(plain(1, 10.0, compute=8),
                                plain(2, 20.0, data=6, compute=8, comm=3)))
    assert found.cause == report.LOADER and "30% of each step waits for the next batch" in \
        found.line
    # Named however well it scales: each node's loader sets the pace.
    scaling = report.verdict(rows(plain(1, 10.0, data=6, compute=3),
                                  plain(2, 10.0, data=6, compute=3)))
    assert scaling.cause == report.LOADER and "efficiency 100%" in scaling.line


def test_a_short_steps_noise_is_no_straggler_when_the_run_scales() -> None:
    top = run(2, [rank(10.0, compute=0.3), rank(10.0, compute=0.5)])
    assert report.verdict(rows(plain(1, 10.0, compute=0.3), top)).cause == report.SCALES


def test_a_slow_node_that_costs_the_step_little_is_no_straggler() -> None:
    # 1.4x the compute, but 2 ms of a 120 ms step that waits on the fabric.
    top = run(2, [rank(120.0, compute=5, comm=110), rank(120.0, compute=7, comm=108)])
    found = report.verdict(rows(plain(1, 10.0, compute=5), top))
    assert found.cause == report.FABRIC, found


def test_the_fabric() -> None:
    top = plain(2, 20.0, data=1, compute=8, comm=9)
    top["fabric"] = {"achieved_busbw_gbps": 0.5, "bare_busbw_gbps": 2.0, "bucket_bytes": 1}
    found = report.verdict(rows(plain(1, 10.0, compute=8), top))
    assert found.cause == report.FABRIC
    assert "45% of each step waits on the gradient all-reduce" in found.line
    assert "0.50 GB/s busbw, the fabric gives 2.00 GB/s" in found.line


def test_below_every_threshold_the_phase_that_grew_most_is_named() -> None:
    found = report.verdict(rows(plain(1, 10.0, compute=8),
                                plain(2, 16.0, data=1, compute=8, comm=2)))
    assert found.cause == report.PHASE and found.phase == "other"
    assert "other grew most from 1 node(s): +3.00 ms per step" in found.line


def test_thresholds_are_inclusive() -> None:
    assert report.verdict(rows(plain(1, 10.0, compute=8),
                               plain(2, 12.5, compute=8))).cause == report.SCALES  # E = 0.80
    top = plain(2, 20.0, compute=8, comm=4)  # exactly 20% sync
    assert report.verdict(rows(plain(1, 10.0, compute=8), top)).cause == report.FABRIC


# -- fixes --------------------------------------------------------------------------------------
def fix(name: str, step: float, loss: float, advice: str) -> dict[str, Any]:
    return {"name": name, "advice": [advice], **run(2, [rank(step, compute=8)] * 2, loss=loss)}


def test_the_fastest_fix_within_the_loss_tolerance_is_chosen() -> None:
    base = report.run_row(run(2, [rank(20.0, compute=8)] * 2, loss=2.0))
    fixes = report.fix_rows(base, [
        fix("powersgd", 10.0, 2.2, "trainer.ddp_comm_hook=powersgd"),  # fastest, loss +10%
        fix("bf16", 12.0, 2.05, "trainer.ddp_comm_hook=bf16"),  # +2.5%: within
        fix("fp16", 13.0, 1.99, "trainer.ddp_comm_hook=fp16"),
        {"name": "x", "advice": ["a=b"], "skipped": "refused"}])
    assert [f["within_tolerance"] for f in fixes[:3]] == [False, True, True]
    assert fixes[1]["vs_plain"] == pytest.approx(20 / 12)
    assert report.pick(base, fixes)["fix"] == "bf16"


def test_accumulation_is_chosen_only_when_nothing_that_keeps_the_batch_wins() -> None:
    base = report.run_row(run(2, [rank(20.0, compute=8)] * 2, loss=2.0))
    both = report.fix_rows(base, [fix("bf16", 12.0, 2.0, "trainer.ddp_comm_hook=bf16"),
                                  fix("grad_accum 2", 11.0, 1.9, "trainer.grad_accum=2")])
    assert report.pick(base, both)["fix"] == "bf16"  # slower, but the same run per sample
    alone = report.fix_rows(base, [fix("bf16", 30.0, 2.0, "trainer.ddp_comm_hook=bf16"),
                                   fix("grad_accum 2", 11.0, 1.9, "trainer.grad_accum=2")])
    assert report.pick(base, alone)["fix"] == "grad_accum 2"


def test_no_fix_is_chosen_when_none_beats_the_plain_run() -> None:
    base = report.run_row(run(2, [rank(10.0, compute=8)] * 2, loss=2.0))
    fixes = report.fix_rows(base, [fix("bf16", 12.0, 2.0, "trainer.ddp_comm_hook=bf16")])
    assert report.pick(base, fixes) is None
    raw = {"device": "cpu", "backend": "gloo", "batch_size": 32, "tasks_per_node": 1,
           "steps": 30, "warmup_steps": 5, "torch": "2.x", "model": "tiny_cnn",
           "sizes": [run(1, [rank(5.0, compute=4)], loss=2.0),
                     run(2, [rank(10.0, compute=8)] * 2, loss=2.0)],
           "fixes": [fix("bf16", 12.0, 2.0, "trainer.ddp_comm_hook=bf16")]}
    result = report.combine(raw, ["nodes=2"])
    assert result["chosen"] is None
    assert result["override_line"] == "python -m hpc_ddp.submit nodes=2"  # as it was
    assert "keep your settings: python -m hpc_ddp.submit nodes=2" in report.table(result)
    assert not report.within_tolerance(float("nan"), 2.0)
    assert report.within_tolerance(2.1, 2.0) and not report.within_tolerance(2.11, 2.0)


def test_the_override_line_replaces_what_the_advice_sets() -> None:
    line = report.override_line(["cluster=slurm", "nodes=4", "trainer.ddp_comm_hook=none",
                                 "data.root=/my data"], ["trainer.ddp_comm_hook=bf16"])
    assert line == ("python -m hpc_ddp.submit cluster=slurm nodes=4 'data.root=/my data' "
                    "trainer.ddp_comm_hook=bf16")


def test_fixes_follow_the_config() -> None:
    names = [f.name for f in fixes_for(TrainerConfig(), 5)]
    assert names == ["bf16", "fp16", "powersgd", "bucket 100 MB", "grad_accum 2"]
    own = fixes_for(TrainerConfig(ddp_comm_hook="bf16", ddp_bucket_cap_mb=50, grad_accum=2), 1)
    assert [f.name for f in own] == ["fp16", "powersgd", "bucket 200 MB", "grad_accum 4"]
    power = next(f for f in own if f.name == "powersgd")
    # Compressing from the first timed step (torch allows 2 at the least); the line keeps
    # the config's warm-up.
    assert "trainer.ddp_powersgd_warmup_steps=2" in power.overrides
    assert "trainer.ddp_powersgd_warmup_steps=5" in fixes_for(TrainerConfig(), 5)[2].overrides
    assert power.advice == ("trainer.ddp_comm_hook=powersgd",)


def test_the_whole_result_and_its_tables() -> None:
    top = plain(2, 20.0, data=1, compute=8, comm=9)
    top["fabric"] = {"achieved_busbw_gbps": 0.5, "bare_busbw_gbps": 2.0,
                     "bucket_bytes": 25 * 2**20}
    raw = {"device": "cpu", "backend": "gloo", "batch_size": 32, "tasks_per_node": 1,
           "steps": 30, "warmup_steps": 5, "torch": "2.x", "model": "tiny_cnn",
           "sizes": [plain(1, 10.0, compute=8), top],
           "fixes": [fix("bf16", 12.0, 2.0, "trainer.ddp_comm_hook=bf16")]}
    result = report.combine(raw, ["nodes=2", "cluster=slurm"])
    assert result["verdict"]["cause"] == report.FABRIC and result["chosen"] == "bf16"
    assert result["override_line"] == ("python -m hpc_ddp.submit nodes=2 cluster=slurm "
                                       "trainer.ddp_comm_hook=bf16")
    text = report.table(result)
    assert text.splitlines()[0].split()[:5] == ["nodes", "ranks", "samples/s", "speed-up",
                                                "efficiency"]
    assert "verdict: the fabric (gradient sync)" in text
    assert "use: python -m hpc_ddp.submit nodes=2 cluster=slurm trainer.ddp_comm_hook=bf16" \
        in text
    assert "bare: all-reduce of 25 MiB" in text


# -- plan ---------------------------------------------------------------------------------------
def test_node_counts() -> None:
    assert default_sizes(2) == (1, 2)
    assert default_sizes(6) == (1, 2, 4, 6)
    assert default_sizes(8) == (1, 2, 4, 8)
    assert parse_sizes("4, 1,2,2", 4) == (1, 2, 4)


@pytest.mark.parametrize("text, said_", [("1", "nothing to compare"), ("0,2", "between 1"),
                                         ("1,5", "nodes=4"), ("1,x", "not a comma list")])
def test_bad_node_lists(text: str, said_: str) -> None:
    with pytest.raises(UserError, match=said_):
        parse_sizes(text, 4)


def test_windows_split_the_steps() -> None:
    assert window_steps(30, 3) == [10, 10, 10]
    assert window_steps(7, 3) == [3, 2, 2]
    assert window_steps(2, 3) == [1, 1]


def test_progress_lines_round_trip(tmp_path: Path) -> None:
    assert said(tmp_path) == []
    say(tmp_path, "one")
    say(tmp_path, "two")
    assert said(tmp_path) == ["one", "two"]


# -- the sub-worlds -----------------------------------------------------------------------------
def env(rank: int, per_node: int, nodes: int, names: tuple[str, ...] = ()) -> DistEnv:
    return DistEnv(rank, rank % per_node, per_node * nodes, rank // per_node, nodes, per_node,
                   "slurm" if names else "local", "j", nodes=names,
                   tasks_on_nodes=(per_node,) * nodes if names else ())


def test_the_first_k_nodes_form_a_world_and_keep_their_rank_numbers() -> None:
    sub = sub_env(env(5, 4, 4, ("a", "b", "c", "d")), 2)
    assert sub is not None
    assert (sub.rank, sub.world_size, sub.num_nodes, sub.nodes, sub.tasks_on_nodes) == \
        (5, 8, 2, ("a", "b"), (4, 4))
    assert sub_env(env(8, 4, 4), 2) is None  # on the third node
    local = sub_env(env(1, 1, 2), 2)
    assert local is not None and local.world_size == 2
    assert node_labels(sub) == ["a"] * 4 + ["b"] * 4
    assert node_labels(env(0, 1, 2)) == ["0", "1"]


# -- options ------------------------------------------------------------------------------------
LOCAL = ["cluster=local", "nodes=2", "cluster.tasks_per_node=1"]


@pytest.mark.parametrize("args, said_", [
    ([], "nodes=1: is one node"),
    ([*LOCAL, "--steps", "0"], "--steps=0: must be 1 or more"),
    ([*LOCAL, "--fixes", "some"], "--fixes=some: is not a choice"),
    ([*LOCAL, "--nodes-list", "1,3"], "--nodes-list=1,3: must lie between 1"),
    ([*LOCAL, "--timeout-s", "0"], "--timeout-s=0.0"),
    ([*LOCAL, "trainer.strategy=fsdp"], "trainer.strategy=fsdp"),
    ([*LOCAL, "--steps", "x"], "invalid int value"),
    ([*LOCAL, "--no-such-option"], "unrecognized arguments"),
])
def test_bad_options_exit_2_in_one_line_before_any_job(
        args: list[str], said_: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["scaling", *args])
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said_ in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "outputs").exists()
