"""The config pipeline (hpc_ddp/planning.py): one run's plan is the first of many, a bad run
among many is named by its index at the stage that refuses it, and the secrets of many runs
share one environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_ddp import api
from hpc_ddp.errors import PointError, UserError
from hpc_ddp.planning import composed, plan, plan_many
from hpc_ddp.sweep.launch import plan_points

NO_SLURM = {"PATH": "/nonexistent"}


def test_one_runs_plan_is_the_first_of_many(tmp_path: Path) -> None:
    one = plan(["optim.lr=0.2", f"run_dir={tmp_path / 'a'}"], tmp_path, NO_SLURM)
    (many,) = plan_many([["optim.lr=0.2", f"run_dir={tmp_path / 'a'}"]], tmp_path, NO_SLURM)
    assert one == many and one.cfg.optim.lr == 0.2 and one.cfg.cluster.kind == "local"
    assert api.plan is plan and api.plan_many is plan_many  # the API's names


@pytest.mark.parametrize("bad, stage", [
    ("optim.lr=[", "the override's grammar"),
    ("optim.no_such_key=1", "composition"),
    ("trainer.max_steps=-3", "the config's checks"),
    ("data._target_=tests.usercode.parts.no_such_factory", "your code's check"),
])
def test_a_bad_run_among_many_is_named_by_its_index(tmp_path: Path, bad: str,
                                                    stage: str) -> None:
    lists = [[f"run_dir={tmp_path / str(i)}"] for i in range(4)]
    lists[2].append(bad)
    with pytest.raises(PointError) as info:
        plan_many(lists, tmp_path, NO_SLURM)
    assert info.value.index == 2, stage
    # The same message as that run alone gets.
    with pytest.raises(UserError) as alone:
        plan(lists[2], tmp_path, NO_SLURM)
    assert info.value.message == alone.value.message
    assert not any((tmp_path / str(i)).exists() for i in range(4))  # nothing made


def test_the_first_half_checks_every_list_before_composing(tmp_path: Path) -> None:
    with pytest.raises(PointError) as info:
        composed([["optim.lr=0.1"], ["resume=2"]])
    assert info.value.index == 1 and "resume" in info.value.message
    merged, configs = composed([["optim.lr=0.1"], ["optim.lr=0.3"]])
    assert merged == [["optim.lr=0.1"], ["optim.lr=0.3"]]
    assert [c.optim.lr for c in configs] == [0.1, 0.3]


def test_runs_planned_together_share_one_environment_for_their_secrets(
        tmp_path: Path) -> None:
    data = "model._target_=tests.usercode.parts.image_data"
    plans = plan_many([[data, f"model.api_token={token}", f"run_dir={tmp_path / str(i)}"]
                       for i, token in enumerate(("tok-a-000001", "tok-b-000002"))],
                      tmp_path, NO_SLURM, check=False)
    assert plans[0].secrets == {"HPC_DDP_SECRET_MODEL_API_TOKEN": "tok-a-000001"}
    assert plans[1].secrets == {"HPC_DDP_SECRET_P1_MODEL_API_TOKEN": "tok-b-000002"}
    # The config and the overrides a run keeps name the same variable.
    assert plans[1].cfg.model.kwargs["api_token"] == \
        "${oc.env:HPC_DDP_SECRET_P1_MODEL_API_TOKEN}"
    assert "model.api_token='${oc.env:HPC_DDP_SECRET_P1_MODEL_API_TOKEN}'" in \
        plans[1].overrides
    # Planned alone, each keeps its own name.
    alone = plan([data, "model.api_token=tok-b-000002", f"run_dir={tmp_path / 'x'}"],
                 tmp_path, NO_SLURM, check=False)
    assert alone.secrets == {"HPC_DDP_SECRET_MODEL_API_TOKEN": "tok-b-000002"}


def test_a_grid_writes_where_its_points_go_as_overrides(tmp_path: Path) -> None:
    folder, _, plans = plan_points(["optim.lr=0.1,0.2", f"sweep.dir={tmp_path / 's'}"],
                                   tmp_path, NO_SLURM)
    for index, p in enumerate(plans):
        assert p.cfg.sweep.dir == str(folder) and f"sweep.dir={folder}" in p.overrides
        assert p.run_dir.root == folder / f"{index:03d}"
    with pytest.raises(UserError, match=r"\(sweep point 1: optim.lr=-1\)"):
        plan_points(["optim.lr=0.1,-1", f"sweep.dir={tmp_path / 't'}"], tmp_path, NO_SLURM)
