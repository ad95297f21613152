"""``python -m hpc_ddp.bench``: subcommand typos, option checks, progress while jobs run."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from hpc_ddp.bench import comm
from hpc_ddp.bench import train as bench_train
from hpc_ddp.bench.__main__ import main, subcommand
from hpc_ddp.bench.baseline import main as baseline_main
from hpc_ddp.doctor.job import check_timeout
from hpc_ddp.errors import UserError


@pytest.mark.parametrize("typo, hint", [("comms", "did you mean comm?"), ("trian", "train"),
                                        ("foo", "comm, train, scaling, sweep")])
def test_a_mistyped_subcommand_lists_the_benchmarks(typo: str, hint: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main([typo]) == 2
    err = capsys.readouterr().err
    assert f"subcommand={typo}" in err and hint in err and "cannot be parsed" not in err


def test_alone_it_lists_the_benchmarks_and_starts_none(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in ("comm", "train", "sweep", "entries", "data"))
    assert not list(tmp_path.iterdir())  # no job, no run folder


@pytest.mark.parametrize("args", [["cluster=slurm"], ["--max-size", "4K"], ["+x=1"],
                                  ["~cluster"]])
def test_options_without_a_benchmark_are_refused_naming_one(
        args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"python -m hpc_ddp.bench comm {args[0]}" in err and "subcommand=(none)" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args, name", [(["train"], "train"), (["sweep", "--points", "3"],
                                                                 "sweep")])
def test_the_first_word_names_the_benchmark(args: list[str], name: str) -> None:
    assert subcommand(args) == name


@pytest.mark.parametrize("module", ["comm", "train"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_timeout_must_be_positive(module: str, value: str, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([module, "--timeout-s", value]) == 2
    assert "--timeout-s=" in capsys.readouterr().err
    assert not (tmp_path / "outputs").exists()  # refused before any job


def test_comm_budget_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["comm", "--budget-s", "0"]) == 2
    assert "--budget-s=0.0" in capsys.readouterr().err


def row(op: str, nbytes: int) -> dict:  # type: ignore[type-arg]
    return {"op": op, "bytes": nbytes, "count": nbytes // 4, "iters": 20, "time_us": 12.5,
            "algbw_gbps": 1.0, "busbw_gbps": 1.5, "correct": True}


def test_rows_print_as_rank_0_appends_them(tmp_path: Path) -> None:
    path = tmp_path / "bench" / "comm.rows.jsonl"
    out = io.StringIO()
    printer = comm.RowPrinter(path, out)
    printer()  # nothing written yet
    assert out.getvalue() == ""
    path.parent.mkdir()
    path.write_text(json.dumps(row("all_reduce", 1024)) + "\n" + '{"op": "all_re')
    printer()
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:2] == ["op", "size"] and len(lines) == 2  # not the partial one
    path.write_text(json.dumps(row("all_reduce", 1024)) + "\n" +
                    json.dumps(row("all_gather", 2048)) + "\n")
    printer()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[2].startswith("all_gather") and printer.printed == 2


def test_streamed_rows_line_up_with_the_table() -> None:
    result = {"rows": [row("all_reduce", 1024), row("reduce_scatter", 256 * 2**20)],
              "world_size": 2, "hosts": ["a", "a"], "backend": "gloo", "device": "cpu"}
    lines = comm.table(result).splitlines()
    assert lines[1] == comm.row_line(result["rows"][0])
    assert len({len(line) for line in lines[:3]}) == 1  # fixed widths


def test_the_wait_for_a_job_polls_while_it_runs_and_once_after(tmp_path: Path) -> None:
    from hpc_ddp.doctor.job import wait
    from hpc_ddp.rundir import RunDir

    class ThreeChecks:  # a job that ends at its third check
        job_id, checks = "1", 0

        def done(self) -> bool:
            self.checks += 1
            return self.checks >= 3

    calls: list[int] = []
    assert wait(ThreeChecks(), RunDir(tmp_path), io.StringIO(), None, 0.01,
                on_poll=lambda: calls.append(1))
    assert len(calls) == 3  # two polls while it ran, one after


def test_train_progress_names_each_model_as_it_starts(tmp_path: Path) -> None:
    out = io.StringIO()
    progress = bench_train.ModelProgress(tmp_path / "variants", ["null", "tiny_cnn", "resnet18"],
                                         "2 ranks: ", out)
    progress()
    assert out.getvalue() == ""
    (tmp_path / "variants" / "null-plain").mkdir(parents=True)
    (tmp_path / "variants" / "null-tuned").mkdir()
    progress()
    progress()
    assert out.getvalue().count("measuring null (1 of 3)") == 1
    (tmp_path / "variants" / "resnet18-tuned").mkdir()  # tiny_cnn had no trainer folder
    progress()
    text = out.getvalue()
    assert "2 ranks: measuring tiny_cnn (2 of 3)" in text and "resnet18 (3 of 3)" in text


@pytest.mark.parametrize("args, flag", [(["--model", "foo"], "--model=foo"),
                                        (["--batch-size", "0"], "--batch-size=0"),
                                        (["--world-size", "0"], "--world-size=0"),
                                        (["--steps", "0"], "--steps=0"),
                                        (["--device", "gpu"], "--device=gpu")])
def test_baseline_refuses_bad_options(args: list[str], flag: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert baseline_main(args) == 2
    err = capsys.readouterr().err
    assert flag in err and "Fix:" in err and "Traceback" not in err


def test_sweep_refuses_zero_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "--rounds", "0"]) == 2
    assert "--rounds=0" in capsys.readouterr().err


def test_check_timeout() -> None:
    check_timeout(None)
    check_timeout(1.0)
    with pytest.raises(UserError):
        check_timeout(0.0)


def test_bench_data_runs_every_contender_side_by_side(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["data", "--workers", "0", "--images", "16", "--sizes", "24x20", "--crop",
                 "16", "--batch", "4", "--rounds", "1", "--decode-s", "0.02",
                 "--out", str(out)]) == 0
    result = json.loads((out / "data.json").read_text())
    rows = {r["contender"]: r for r in result["rows"]}
    assert list(rows) == ["textbook", "folder", "folder (pil)", "shards"]
    assert rows["textbook"]["ratio"] == 1.0 and all(r["images_per_s"] > 0 for r in rows.values())
    assert [s["source"] for s in result["stage"]] == ["folder", "folder.tar", "shards"]
    assert {d["decoder"] for d in result["decoders"]} >= {"pil", "torchvision"}
    printed = capsys.readouterr().out
    assert "target shards >= 2.0x textbook" in printed and "staging to local disk" in printed


@pytest.mark.parametrize("args, said", [(["--sizes", "64"], "--sizes"),
                                        (["--images", "3"], "--images=3")])
def test_bench_data_options_are_checked(args: list[str], said: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", *args]) == 2
    assert said in capsys.readouterr().err


def test_script_rounds_are_compared_pair_by_pair() -> None:
    from hpc_ddp.bench.entries import paired

    # A machine whose load drifts: each round's two legs move together.
    ours, bare = [990.0, 1485.0, 1188.0, 1386.0, 1089.0, 1584.0], [1000.0, 1500.0, 1200.0,
                                                                  1400.0, 1100.0, 1600.0]
    figures = paired(ours, bare)
    assert figures["ratio"] == pytest.approx(0.99) and figures["ratio_min"] == pytest.approx(0.99)
    assert figures["srun_samples_per_s"] == 1300.0  # the median of the bare legs
    assert figures["srun_spread"] == pytest.approx(600 / 1300)
    # The medians' ratio would say 1287/1300 = 0.99 here too, but not when one leg drifts.
    drift = paired([1000.0, 1000.0, 1000.0], [900.0, 1000.0, 1100.0])
    assert drift["ratio"] == 1.0 and drift["ratio_min"] == pytest.approx(1000 / 1100)


def test_the_command_list_names_every_benchmark_and_data_subcommand() -> None:
    """`python -m hpc_ddp` lists what README.md lists: every benchmark, every data
    subcommand and every command module."""
    from hpc_ddp.__main__ import COMMANDS
    from hpc_ddp.bench.__main__ import SUBCOMMANDS as BENCHMARKS
    from hpc_ddp.data.__main__ import SUBCOMMANDS as DATA

    bench_line = next(line for line in COMMANDS.splitlines() if "hpc_ddp.bench " in line)
    assert set(bench_line.split()[3].split("|")) == set(BENCHMARKS)
    for word in DATA:
        assert f"python -m hpc_ddp.data {word} " in COMMANDS, word
    for module in ("submit", "status", "train", "doctor", "env", "testcluster"):
        assert f"python -m hpc_ddp.{module} " in COMMANDS, module


def test_startup_figures_are_medians_and_ratios_of_the_rounds() -> None:
    from hpc_ddp.bench.first_step import lines, summary

    found = {"script=": [12.0, 11.0, 30.0], "trainer supervised": [15.0, 14.0, 16.0],
             "trainer": [13.0, 12.5, 12.0], "batch": [10.0, 10.0, 10.0],
             "bare": [10.0, 10.0, 8.0]}
    result = summary(found)
    assert result["script="]["median_s"] == 12.0
    assert result["script="]["ratio"] == 1.2  # rounds' ratios 1.2, 1.1, 3.75
    assert result["script="]["ratio_batch"] == 1.2  # 1.2, 1.1, 3.0
    assert result["bare"]["ratio"] == 1.0 and result["batch"]["ratio_batch"] == 1.0
    shown = lines(result, 2, 3)
    assert shown[0] == "time to the first step on 2 node(s), medians of 3 rounds:"
    assert shown[1].endswith("1.20x batch   1.20x bare (goal <= 1.15x batch: NOT met)")
    assert shown[2].endswith("1.50x batch   1.50x bare (goal <= 1.3x batch: NOT met)")
    assert shown[3].endswith("1.25x batch   1.30x bare (goal <= 1.3x batch: met)")
    assert shown[4].endswith("1.00x batch   1.00x bare")
    assert shown[5].endswith("1.00x batch   1.00x bare")  # 1.0, 1.0, 0.8: the median


def test_warm_start_figures_are_medians_ratios_and_savings_per_rank() -> None:
    from hpc_ddp.bench.warm_start import lines, summary

    found = {8: {"cold": [(20.0, 40.0), (22.0, 44.0), (30.0, 60.0)],
                 "warm": [(10.0, 12.0), (11.0, 12.0), (9.0, 8.0)]}}
    row = summary(found)["8"]
    assert (row["cold"]["wall_s"], row["cold"]["cpu_s"]) == (22.0, 44.0)
    assert (row["warm"]["wall_s"], row["warm"]["cpu_s"]) == (10.0, 12.0)
    assert row["wall_ratio"] == pytest.approx(10 / 22)
    assert row["cpu_ratio"] == pytest.approx(12 / 44)
    assert row["cpu_saved_per_rank_s"] == 4.0  # (44 - 12) / 8
    shown = lines(summary(found), 3)
    assert shown[0] == "command to the first step, one node, medians of 3 rounds:"
    assert shown[2].split() == ["8", "22.0", "s", "44.0", "CPU-s", "10.0", "s", "12.0", "CPU-s",
                                "0.45x", "0.27x", "CPU", "4.00"]
    # Locally a third mode: the warm process an earlier run left (cluster.warm_keep_s).
    found[8]["kept"] = [(2.0, 3.0), (4.0, 5.0), (3.0, 4.4)]
    row = summary(found)["8"]
    assert (row["kept"]["wall_s"], row["kept"]["cpu_s"]) == (3.0, 4.4)
    assert row["kept_wall_ratio"] == pytest.approx(3 / 22)
    assert row["kept_cpu_ratio"] == pytest.approx(0.1)
    shown = lines(summary(found), 3)
    assert shown[1].split()[-2:] == ["kept", "kept/cold"]
    assert shown[2].split()[13:] == ["3.0", "s", "4.4", "CPU-s", "0.14x", "0.10x", "CPU"]


@pytest.mark.parametrize("args", [["--ranks", "0"], ["--ranks", "x"], ["--rounds", "0"]])
def test_warm_start_bad_arguments_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    from hpc_ddp.bench.warm_start import main

    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --r") and err.count("\n") == 1
