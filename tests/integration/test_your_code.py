"""A user's own code, locally end to end (real processes, gloo): the example project through
`_target_` and --config-dir, a torchvision model on a folder of JPEGs, function entries
(by name and pickled from a notebook), scripts with hpc_ddp.context(), a stop and a resume."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import hpc_ddp as api
from hpc_ddp.rank.services import checkpoint
from tests.conftest import REPO
from tests.integration.test_local_run import tb_scalars

Run = Callable[..., subprocess.CompletedProcess[str]]
PROJECT = REPO / "examples" / "seqproject"


def summary_of(run_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return data


def test_example_project_through_targets_and_its_config_folder(hpc_ddp: Run,
                                                                tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", ["--config-dir", "conf", "cluster=local", "trainer.max_steps=40",
                              f"run_dir={run_dir}"], cwd=PROJECT)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = summary_of(run_dir)
    assert summary["global_step"] == 40 and set(summary["eval_metrics"]) == {
        "loss", "mae", "within_tenth"}
    assert "eval mae" in done.stdout and summary["eval_accuracy"] is None
    assert tb_scalars(run_dir / "tb", "eval/mae")
    config = (run_dir / "config.yaml").read_text()
    assert "_target_: seqproj.data.make_splits" in config and "length: 16" in config
    # A resume from anywhere finds the config folder and the project's options again.
    again = hpc_ddp("submit", [f"run_dir={run_dir}", "resume=true", "trainer.max_steps=50"],
                    cwd=PROJECT)
    assert again.returncode == 0, again.stdout + again.stderr
    assert summary_of(run_dir)["global_step"] == 50


def test_example_projects_readme_commands_do_what_they_say(hpc_ddp: Run,
                                                            tmp_path: Path) -> None:
    """Issue 46, the README's lines as written (locally, small): its loop follows
    trainer.max_steps when app.steps is not given, and its script checkpoints into the run
    dir, so a second run starts afresh and leaves the project folder as it was."""
    before = sorted(p.name for p in PROJECT.iterdir())
    entry = hpc_ddp("submit", ["--config-dir", "conf", "entry=seqproj.loop:main",
                               "trainer.max_steps=20", f"run_dir={tmp_path / 'entry'}"],
                    cwd=PROJECT)
    assert entry.returncode == 0, entry.stdout + entry.stderr
    assert summary_of(tmp_path / "entry")["global_step"] == 20  # not app.steps' old 200
    _assert_sync_measured(summary_of(tmp_path / "entry"))
    for attempt in ("first", "second"):
        run_dir = tmp_path / attempt
        done = hpc_ddp("submit", ["script=train_ddp.py", f"run_dir={run_dir}", "--",
                                  "--epochs", "1"], cwd=PROJECT)
        assert done.returncode == 0, done.stdout + done.stderr
        assert torch.load(run_dir / "ckpt.pt")["epoch"] == 1
        out = "".join(p.read_text() for p in (run_dir / "submitit").glob("*_0_log.out"))
        assert "epoch 0 loss" in out and "resumed at epoch" not in out, out
        _assert_sync_measured(summary_of(run_dir))
    assert sorted(p.name for p in PROJECT.iterdir()) == before  # no ckpt.pt written there


def _assert_sync_measured(summary: dict[str, Any]) -> None:
    """A 2-rank loop of the user's own says how much of a step waits on gradient sync, as
    the built-in trainer's runs do (trainer/sync_probe.LoopProbe)."""
    assert summary["world_size"] == 2 and summary["sync_sampled_steps"] >= 1, summary
    assert 0.0 <= summary["sync_share"] <= 1.0, summary
    assert 0.0 <= summary["sync_ms"] <= summary["sync_step_ms"], summary


def test_check_data_on_the_projects_data_and_an_iterable_one() -> None:
    import sys

    sys.path.insert(0, str(PROJECT))  # as `python` started in the project folder has it
    try:
        report = api.check_data(["config_dir=" + str(PROJECT / "conf")], world_size=4)
    finally:
        sys.path.remove(str(PROJECT))
    assert report.ok and report.kind == "map-style" and report.dataset_size == 2048
    assert report.batch_shapes == {"input": (64, 16, 1), "target": (64, 1)}
    assert report.eval_size == 256 and report.num_classes is None
    shards = api.check_data(["data._target_=tests.usercode.parts.shards",
                                 "trainer.batch_size=4"], world_size=4)
    assert shards.kind == "iterable" and shards.ok, shards.problems
    assert shards.indices == {r: [16] for r in range(4)}
    assert shards.batch_shapes == {"input": (4, 8), "target": (4,)}
    assert "iterable" in str(shards)


def write_jpegs(root: Path, classes: int, per_class: dict[str, int]) -> None:
    """An ImageNet-style folder of real JPEG files of varied sizes."""
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for split, count in per_class.items():
        for c in range(classes):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                h, w = 40 + 7 * i, 56 - 3 * i
                image = (torch.rand(h, w, 3, generator=gen) * 80 + 60 * c).to(torch.uint8)
                Image.fromarray(image.numpy()).save(folder / f"{i}.jpg", format="JPEG")


def test_torchvision_model_on_a_folder_of_jpegs(hpc_ddp: Run, tmp_path: Path) -> None:
    root = tmp_path / "images"
    write_jpegs(root, classes=3, per_class={"train": 8, "val": 3})
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", ["cluster=local", "model=torchvision",
                              "model.arch=mobilenet_v3_small", "data=image_folder",
                              f"data.root={root}", "data.image_size=32",
                              "trainer.batch_size=4", "trainer.max_steps=6",
                              f"run_dir={run_dir}"])
    assert done.returncode == 0, done.stdout + done.stderr
    summary = summary_of(run_dir)
    assert summary["global_step"] == 6 and summary["world_size"] == 2
    # 9 eval images split over the ranks, each counted once (unpadded shards): k of 9.
    hits = summary["eval_accuracy"] * 9
    assert abs(hits - round(hits)) < 1e-6 and 0 <= round(hits) <= 9, summary["eval_accuracy"]
    state = checkpoint.load_latest(run_dir / "checkpoints")
    assert state is not None
    assert state["model"]["classifier.3.weight"].shape[0] == 3  # classes from the folders
    report = api.check_data(["data=image_folder", f"data.root={root}",
                                 "data.image_size=32", "trainer.batch_size=4"], world_size=2)
    assert report.ok and report.num_classes == 3 and report.dataset_size == 24
    assert report.batch_shapes == {"images": (4, 3, 32, 32), "labels": (4,)}
    assert report.batch_dtypes["images"] == "torch.uint8"


def test_function_entry_by_name_gets_the_job(hpc_ddp: Run, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", ["cluster=local", "cluster.tasks_per_node=3",
                              "entry=tests.usercode.entries:report", "app.lr=0.5",
                              f"run_dir={run_dir}"])
    assert done.returncode == 0, done.stdout + done.stderr
    summary = summary_of(run_dir)
    result = summary["result"]
    assert result == {"total": 3.0, "env_rank": "0", "env_world": "3", "ctx_world": 3,
                      "master": "127.0.0.1", "app": {"lr": 0.5}, "backend": "gloo"}
    assert summary["program"] == "entry tests.usercode.entries:report"
    assert summary["hosts"] == [summary["nodes"][0]] * 3


def test_a_notebook_function_is_pickled_and_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    def in_a_notebook(ctx: Any) -> dict[str, Any]:  # not importable by name: pickled
        (marker / f"rank{ctx.rank}").write_text(str(ctx.world_size))
        return {"world": ctx.world_size}

    marker.mkdir()
    run = api.submit(["cluster=local", f"run_dir={tmp_path / 'run'}"], entry=in_a_notebook)
    summary = run.wait(progress=False)
    assert summary["world"] == 2 and sorted(p.name for p in marker.iterdir()) == ["rank0",
                                                                                  "rank1"]
    assert "entry: hpc_ddp.rank.main.entry:from_pickle" in (tmp_path / "run" / "config.yaml"
                                                       ).read_text()
    # Shown as the function it is (summary, results table, log), not as the loader.
    assert summary["program"] == (f"entry {__name__}:{in_a_notebook.__qualname__} (pickled "
                                  "into entry.pkl)"), summary["program"]
    assert "running " + summary["program"][len("entry "):] in run.log_tail(40)


def test_function_entry_stops_checkpoints_and_resumes_exactly(tmp_path: Path) -> None:
    args = ["cluster=local", "entry=tests.usercode.entries:counts", "app.steps=60",
            "app.sleep=0.05", "trainer.stop_check_interval=2"]
    reference = api.submit([*args, f"run_dir={tmp_path / 'reference'}"])
    expected = reference.wait(progress=False)
    assert expected["steps"] == 60
    run_dir = tmp_path / "run"
    # Its steps slower than the reference's (the draws are the same: the sleep is after them),
    # so the stop lands before the end however slowly the cancel goes through today.
    slow = [a.replace("app.sleep=0.05", "app.sleep=0.3") for a in args]
    run = api.submit([*slow, f"run_dir={run_dir}"])
    deadline = time.monotonic() + 120
    while (run.progress() or {}).get("step", 0) < 15:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert run.cancel(grace_s=60)  # SIGTERM: should_stop() agrees, the loop saves, returns
    stopped = checkpoint.load_latest(run_dir / "checkpoints")
    assert stopped is not None and 15 <= stopped["step"] < 60
    again = api.submit([*args, f"run_dir={run_dir}", "resume=true"])
    summary = again.wait(progress=False)
    # The same RNG draws as the uninterrupted loop: the value is bitwise the same.
    assert summary["value"] == expected["value"] and summary["steps"] == 60
    assert summary["resumed_from_step"] == stopped["step"]
    assert summary["restarts"] == 1


SCRIPT = '''\
import sys, torch, torch.distributed as dist
import hpc_ddp
dist.init_process_group("gloo")  # as the script always did
ctx = hpc_ddp.context()          # and what hpc_ddp adds to it
state = ctx.load() or {"step": 0}
for step in range(state["step"], 12):
    ctx.log({"loss": 1.0 / (step + 1)}, step)
ctx.save({"step": 12})
ctx.summary["args"] = sys.argv[1:]
dist.destroy_process_group()
'''


def test_script_with_hpc_ddp_context(hpc_ddp: Run, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", ["cluster=local", f"script={script}", f"run_dir={run_dir}",
                              "--", "--lr", "0.1", "two words"])
    assert done.returncode == 0, done.stdout + done.stderr
    summary = summary_of(run_dir)
    assert summary["result"] == {"args": ["--lr", "0.1", "two words"]}
    assert summary["exit_codes"] == {"0": 0, "1": 0} and summary["global_step"] == 12
    assert [s for s, _ in tb_scalars(run_dir / "tb", "loss")] == list(range(12))
    assert checkpoint.latest_path(run_dir / "checkpoints") is not None


def test_a_script_error_is_reported_with_its_lines(hpc_ddp: Run, tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("import os\nraise ValueError('bad learning rate ' + os.environ['RANK'])\n")
    done = hpc_ddp("submit", ["cluster=local", f"script={script}",
                              f"run_dir={tmp_path / 'run'}"])
    assert done.returncode == 1
    assert "the script exited with code 1" in done.stdout
    assert "ValueError: bad learning rate" in done.stdout


def test_a_target_that_fails_on_the_ranks_names_rank_and_host(hpc_ddp: Run,
                                                             tmp_path: Path) -> None:
    # check_targets=false: the submit host does not build it; the ranks report it.
    done = hpc_ddp("submit", ["cluster=local", "check_targets=false",
                              "model._target_=nope_pkg.Net", f"run_dir={tmp_path / 'run'}"])
    assert done.returncode == 1
    assert "ranks 0-1 of 2 on " in done.stdout  # both ranks, said once
    assert "model._target_=nope_pkg.Net: cannot be imported" in done.stdout


@pytest.mark.parametrize("overrides", [["data._target_=tests.usercode.parts.shards",
                                        "model._target_=tests.usercode.parts.Mlp",
                                        "trainer.batch_size=4", "trainer.max_steps=12"]])
def test_iterable_data_trains_with_the_builtin_trainer(hpc_ddp: Run, tmp_path: Path,
                                                       overrides: list[str]) -> None:
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", ["cluster=local", *overrides, f"run_dir={run_dir}"])
    assert done.returncode == 0, done.stdout + done.stderr
    summary = summary_of(run_dir)
    assert summary["global_step"] == 12 and summary["epochs_completed"] == 1
    state = checkpoint.load_latest(run_dir / "checkpoints")
    assert state is not None and state["model"]["net.2.weight"].shape[0] == 10


def test_a_module_runs_as_python_m(hpc_ddp: Run, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "data" / "a").mkdir(parents=True)  # and data.stage for a script
    (tmp_path / "data" / "a" / "x.bin").write_bytes(b"x")
    done = hpc_ddp("submit", ["cluster=local", "script=-m tests.usercode.script_mod",
                              f"data.root={tmp_path / 'data'}", "data.stage=true",
                              f"data.stage_dir={tmp_path / 'stage'}",
                              f"run_dir={tmp_path / 'run'}", "--", str(out), "x y"])
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    copy = Path(records[0]["data_root"])  # $HPC_DDP_DATA_ROOT: the node's copy, one for both
    assert copy.is_relative_to(tmp_path / "stage") and records[1]["data_root"] == str(copy)
    assert (copy / "a" / "x.bin").read_bytes() == b"x"  # the folder itself, not its one folder
    assert summary_of(tmp_path / "run")["data_stage"]["files"] == 1
    assert [r["rank"] for r in records] == ["0", "1"] and records[0]["world"] == "2"
    assert records[0]["name"] == "__main__"
    assert records[0]["argv"][1:] == [str(out), "x y"]
    assert records[0]["argv"][0].endswith("tests/usercode/script_mod.py")
    for rank in range(2):  # the script forked from the warm process, as a fresh `python -m`
        log = (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text()
        assert "generation 0: process " in log and "warm: forked from this node's" in log
