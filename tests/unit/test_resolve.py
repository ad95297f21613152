"""Planning a submission: target, derived values, resume overrides, run-dir checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_ddp.config.compose import compose
from hpc_ddp.errors import UserError
from hpc_ddp.inputs.run_dir import check_run_dir, write_run_config
from hpc_ddp.launch.resolve import check_local_gpus, merge_resume_overrides, resolve
from hpc_ddp.rundir import RunDir

NO_SLURM = {"PATH": "/nonexistent"}


def test_auto_without_a_controller_is_local_with_two_ranks(tmp_path: Path) -> None:
    cfg = resolve(compose([]), NO_SLURM, tmp_path)
    assert cfg.cluster.kind == "local" and cfg.cluster.tasks_per_node == 2 and cfg.wait is True
    assert cfg.run_dir is not None and cfg.run_dir.startswith(str(tmp_path / "outputs"))


def test_gpus_derive_tasks_and_slurm_does_not_wait(tmp_path: Path) -> None:
    cfg = resolve(compose(["cluster=slurm", "cluster.gpus_per_node=4"]), NO_SLURM, tmp_path)
    assert cfg.cluster.tasks_per_node == 4 and cfg.wait is False
    local = resolve(compose(["cluster=local", "cluster.gpus_per_node=1"]), NO_SLURM, tmp_path)
    assert local.cluster.tasks_per_node == 1


def test_each_resume_builds_on_the_last(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    first = ["cluster=local", f"run_dir={run.root}", "trainer.max_steps=10", "wait=false"]
    write_run_config(run, compose(first), first)
    second = merge_resume_overrides([f"run_dir={run.root}", "resume=on",
                                     "trainer.max_steps=100"])
    assert compose(second).trainer.max_steps == 100
    write_run_config(run, compose(second), second)
    third = merge_resume_overrides([f"run_dir={run.root}", "resume=true"])
    assert compose(third).trainer.max_steps == 100  # the earlier resume's change is kept
    assert "wait=false" not in third and compose(third).cluster.kind == "local"


def test_resumes_do_not_pile_up_overrides(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    first = ["cluster=local", f"run_dir={run.root}", "trainer.max_steps=10"]
    write_run_config(run, compose(first), first)
    for steps in (20, 30, 40):
        again = merge_resume_overrides([f"run_dir={run.root}", "resume=true",
                                        f"trainer.max_steps={steps}"])
        write_run_config(run, compose(again), again)
    saved = run.overrides.read_text().splitlines()
    assert saved == ["- cluster=local", f"- run_dir={run.root}", "- trainer.max_steps=40"]


def test_resume_needs_a_run(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="run_dir=<the run's folder>"):
        merge_resume_overrides(["resume=true"])
    with pytest.raises(UserError, match="holds no run to resume"):
        merge_resume_overrides([f"run_dir={tmp_path}", "resume=true"])


def test_run_dir_rules(tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")
    with pytest.raises(UserError, match="already holds files"):
        check_run_dir(compose([f"run_dir={taken}"]))
    assert check_run_dir(compose([f"run_dir={tmp_path / 'new'}"])).root == tmp_path / "new"
    with pytest.raises(UserError, match="is a file"):
        check_run_dir(compose([f"run_dir={taken / 'x' / 'sub'}"]))


def test_local_gpus_follow_what_this_shell_was_given(tmp_path: Path) -> None:
    from hpc_ddp.launch.local import executor_parameters

    cfg = resolve(compose(["cluster=local", "cluster.gpus_per_node=2"]), NO_SLURM, tmp_path)
    assert "visible_gpus" not in executor_parameters(cfg, {})  # all of the machine's
    params = executor_parameters(cfg, {"CUDA_VISIBLE_DEVICES": "4,6,7"})
    assert params["gpus_per_node"] == 2 and params["visible_gpus"] == (4, 6, 7)
    by_uuid = executor_parameters(cfg, {"CUDA_VISIBLE_DEVICES": "GPU-a1,GPU-b2,GPU-c3"})
    assert by_uuid["setup"] == ["export CUDA_VISIBLE_DEVICES=GPU-a1,GPU-b2"]
    check_local_gpus(cfg, {"CUDA_VISIBLE_DEVICES": "4,6"}, lambda: 2)
    with pytest.raises(UserError, match=r"given 1 GPU\(s\) \(CUDA_VISIBLE_DEVICES=4\)"):
        check_local_gpus(cfg, {"CUDA_VISIBLE_DEVICES": "4"}, lambda: 1)


def test_local_gpus_torch_cannot_use_are_refused_before_launch(tmp_path: Path) -> None:
    cfg = resolve(compose(["cluster=local", "cluster.gpus_per_node=1"]), NO_SLURM, tmp_path)
    with pytest.raises(UserError, match=r"needs 1 GPU\(s\) and torch finds 0 CUDA"):
        check_local_gpus(cfg, {}, lambda: 0)
    check_local_gpus(cfg, {}, lambda: 1)
    cpu = resolve(compose(["cluster=local", "cluster.gpus_per_node=1", "trainer.device=cpu"]),
                  NO_SLURM, tmp_path)
    check_local_gpus(cpu, {}, lambda: 0)  # CPU compute asked for: the GPUs are not used


def test_cuda_on_a_local_run_without_gpus_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="torch finds 0 CUDA device"):
        resolve(compose(["cluster=local", "trainer.device=cuda"]), NO_SLURM, tmp_path,
                lambda: 0)
    zero = compose(["cluster=local", "trainer.device=cuda", "cluster.gpus_per_node=0"])
    with pytest.raises(UserError, match="cluster.gpus_per_node=<GPUs to use>"):
        check_local_gpus(resolve(zero, NO_SLURM, tmp_path), {})
    slurm = resolve(compose(["cluster=slurm", "trainer.device=cuda"]), NO_SLURM, tmp_path)
    check_local_gpus(slurm, {})  # Slurm nodes may show their GPUs without GRES


def test_a_sweep_point_that_never_started_may_be_run_by_hand(tmp_path: Path) -> None:
    point = tmp_path / "sweep" / "001"
    point.mkdir(parents=True)
    (point / "hparams.json").write_text('{"optim.lr": "0.2"}')
    check_run_dir(compose(["cluster=local", f"run_dir={point}"]))
    (point / "config.yaml").write_text("nodes: 1\n")
    with pytest.raises(UserError, match="already holds files"):
        check_run_dir(compose(["cluster=local", f"run_dir={point}"]))


@pytest.mark.parametrize("tasks, gpus, device, nodes, seen, expected", [
    # Nothing said: one rank per GPU torch can use, else 2 CPU ranks.
    (None, None, "auto", 1, 0, (2, 0, "torch can use no GPU here")),
    (None, None, "auto", 1, 1, (1, 1, "one rank per GPU torch can use here (1)")),
    (None, None, "auto", 1, 8, (8, 8, "one rank per GPU torch can use here (8)")),
    (None, None, "auto", 2, 8, (4, 4, "one rank per GPU torch can use here (8)")),
    (None, None, "auto", 2, 1, (2, 0, "1 GPU(s) cannot be split over 2 simulated nodes")),
    (None, None, "cuda", 1, 2, (2, 2, "one rank per GPU torch can use here (2)")),
    # What the config says wins.
    (None, None, "cpu", 1, 8, (2, 0, "trainer.device=cpu")),
    (3, None, "cpu", 1, 8, (3, 0, "trainer.device=cpu")),
    (1, None, "auto", 1, 8, (1, 1, "cluster.tasks_per_node=1, a GPU for each")),
    (4, None, "auto", 1, 2, (4, 0, "cluster.tasks_per_node=4 and torch can use 2 GPU(s)")),
    (None, 0, "auto", 1, 8, (2, 0, "cluster.gpus_per_node=0")),
    (None, 2, "auto", 1, 8, (2, 2, "cluster.gpus_per_node=2")),
])
def test_local_ranks_follow_the_gpus(tasks: int | None, gpus: int | None, device: str,
                                     nodes: int, seen: int,
                                     expected: tuple[int, int, str]) -> None:
    from hpc_ddp.launch.resolve import local_layout

    layout = local_layout(tasks, gpus, device, nodes, seen)
    assert (layout.tasks_per_node, layout.gpus_per_node, layout.why) == expected


@pytest.mark.parametrize("tasks, seen", [(None, 0), (4, 2)])
def test_cuda_asked_without_enough_gpus_is_refused(tasks: int | None, seen: int) -> None:
    from hpc_ddp.launch.resolve import local_layout

    with pytest.raises(UserError, match=f"torch finds {seen} CUDA device"):
        local_layout(tasks, None, "cuda", 1, seen)


def test_resolve_asks_torch_only_for_a_local_run_left_to_derive(tmp_path: Path) -> None:
    asked = []

    def count() -> int:
        asked.append(1)
        return 1

    cfg = resolve(compose(["cluster=local"]), NO_SLURM, tmp_path, count)
    assert (cfg.cluster.tasks_per_node, cfg.cluster.gpus_per_node) == (1, 1) and asked
    asked.clear()
    resolve(compose(["cluster=local", "cluster.gpus_per_node=0"]), NO_SLURM, tmp_path, count)
    resolve(compose(["cluster=slurm"]), NO_SLURM, tmp_path, count)
    assert not asked
    slurm = resolve(compose(["cluster=slurm"]), NO_SLURM, tmp_path, count)
    assert (slurm.cluster.tasks_per_node, slurm.cluster.gpus_per_node) == (1, 0)


def test_local_ranks_start_without_slurms_job_description() -> None:
    from hpc_ddp.launch.local import outside_slurm

    shell = {"PATH": "/usr/bin", "SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
             "SLURM_NTASKS": "1", "SLURMD_NODENAME": "node2", "SLURM_CONF": "/etc/slurm.conf",
             "CUDA_VISIBLE_DEVICES": "2,3", "MASTER_PORT": "29600"}
    assert outside_slurm(shell) == {"PATH": "/usr/bin", "SLURM_CONF": "/etc/slurm.conf",
                                    "CUDA_VISIBLE_DEVICES": "2,3", "MASTER_PORT": "29600"}
