"""The pieces behind a user's own code, one by one: part shapes, overrides, targets, the
context's services, the script runner."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpc_ddp.config import parts
from hpc_ddp.config.compose import compose, from_yaml, to_yaml
from hpc_ddp.errors import UserError
from hpc_ddp.targets import TargetError, accepts, build, locate
from tests.conftest import REPO

PROJECT_CONF = REPO / "examples" / "seqproject" / "conf"


@pytest.mark.parametrize("given, widened", [
    (["model.width=3"], ["++model.width=3"]),
    (["model._target_=a.B", "model.w=1"], ["~model", "++model._target_=a.B", "++model.w=1"]),
    (["model=mine", "model._target_=a.B"], ["model=mine", "++model._target_=a.B"]),
    (["app.steps=5", "trainer.seed=1"], ["++app.steps=5", "trainer.seed=1"]),
    (["+model.x=1", "~model.y", "cluster.partition=gpu"],
     ["+model.x=1", "~model.y", "cluster.partition=gpu"]),
])
def test_part_keys_are_widened_for_hydra(given: list[str], widened: list[str]) -> None:
    assert parts.widen_overrides(given) == widened


def test_a_target_part_keeps_the_loader_keys_ours() -> None:
    typed = parts.to_typed_dict("data", {"_target_": "pkg.make", "num_workers": 2, "size": 8,
                                         "_partial_": False})
    assert typed == {"num_workers": 2, "name": None, "target": "pkg.make",
                     "kwargs": {"size": 8, "_partial_": False}}
    cfg = compose(["data._target_=pkg.make", "data.size=8", "data.num_workers=2"])
    assert cfg.data.target == "pkg.make" and cfg.data.kwargs == {"size": 8}
    assert cfg.data.num_workers == 2
    plain = parts.to_plain("data", cfg.data)
    assert plain["_target_"] == "pkg.make" and plain["size"] == 8 and "name" not in plain


def test_config_round_trips_with_targets_and_app() -> None:
    cfg = compose(["model=torchvision", "model.arch=resnet18", "model.width_per_group=32",
                   "loss._target_=torch.nn.MSELoss", "app.steps=3", "app.nested={a: 1}",
                   "scheduler=linear"])
    assert from_yaml(to_yaml(cfg)) == cfg
    assert cfg.app == {"steps": 3, "nested": {"a": 1}}
    assert cfg.model.kwargs == {"arch": "resnet18", "num_classes": None, "width_per_group": 32}


def test_users_config_folder_comes_first_and_its_config_yaml_builds_on_ours() -> None:
    cfg = compose([], config_dir=PROJECT_CONF)
    assert cfg.model.target == "seqproj.model.TinyTransformer"
    assert cfg.model.kwargs["length"] == 16  # ${data.length} resolved
    assert cfg.optim.name == "adamw" and cfg.trainer.max_steps == 200
    assert cfg.cluster.kind == "auto"  # hpc_ddp's defaults underneath
    assert cfg.config_dir == str(PROJECT_CONF)


def test_users_option_shadows_ours(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tiny_cnn.yaml").write_text("name: resnet18\n")
    assert compose(["model=tiny_cnn"], config_dir=tmp_path).model.name == "resnet18"
    assert compose(["model=tiny_cnn"]).model.name == "tiny_cnn"


def test_locate_names_what_is_missing() -> None:
    assert locate("torch.nn.Linear", "k") is torch.nn.Linear
    assert locate("torch.nn:Linear", "k") is torch.nn.Linear
    with pytest.raises(TargetError, match="did you mean torch.nn.Linear"):
        locate("torch.nn.Linea", "model._target_")
    with pytest.raises(TargetError, match="is not a dotted import path"):
        locate("not a path", "model._target_")


@pytest.mark.parametrize("typed, meant", [
    ("tests.usercode.entries:repor", "tests.usercode.entries:report"),  # as typed: a colon
    ("tests.usercode.entries.repor", "tests.usercode.entries.report"),
    ("torch.nn:Linear.forwrd", "torch.nn:Linear.forward"),
])
def test_a_suggested_name_is_in_the_form_typed(typed: str, meant: str) -> None:
    with pytest.raises(TargetError) as info:
        locate(typed, "entry")
    assert f"did you mean {meant}? " in info.value.message, info.value.message


def test_auto_arguments_go_only_where_taken() -> None:
    def takes(num_classes: int = 1) -> int:
        return num_classes

    def takes_not(width: int = 1) -> int:
        return width

    assert accepts(takes, "num_classes") and not accepts(takes_not, "num_classes")
    made = build("model", "torch.nn.Linear", {"in_features": 2, "out_features": 3},
                 auto={"num_classes": 7})  # Linear takes no num_classes: not passed
    assert made.out_features == 3
    partial = build("optim", "torch.optim.SGD", {"lr": 0.5}, partial=True)
    optimizer = partial([torch.nn.Parameter(torch.zeros(1))])
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_built_parts_check_what_they_return() -> None:
    from hpc_ddp.data.sets import build_datasets, num_classes_of
    from hpc_ddp.trainer.objectives import build_loss, build_metrics

    cfg = compose(["data._target_=tests.usercode.parts.classes_data", "data.classes=4"])
    sets = build_datasets(cfg.data, 0)
    assert sets.num_classes == 4 and num_classes_of(sets.train) == 4 and not sets.iterable
    loss = build_loss(compose(["loss._target_=torch.nn.functional.l1_loss"]).loss)
    assert float(loss(torch.ones(2), torch.zeros(2))) == 1.0
    assert build_metrics(compose(["metrics=none"]).metrics) is None
    auto = build_metrics(compose([]).metrics)
    assert auto is not None and auto(torch.zeros(4, 1), torch.zeros(4, 1)) == {}
    assert float(auto(torch.eye(2), torch.tensor([0, 0]))["accuracy"]) == 0.5


def test_model_classes_come_from_the_data_or_are_refused() -> None:
    from hpc_ddp.trainer.models import build_model, check_classes, describe_model

    cfg = compose(["model._target_=tests.usercode.parts.Mlp"])
    assert check_classes(cfg, 3) == 3
    assert build_model(cfg.model, 32, 3).net[2].out_features == 3
    fixed = compose(["model._target_=tests.usercode.parts.Mlp", "model.num_classes=4"])
    with pytest.raises(UserError, match="the data .* has 3 classes"):
        check_classes(fixed, 3)
    vision = compose(["model=torchvision", "model.arch=mobilenet_v3_small"])
    assert describe_model(vision.model) == "torchvision mobilenet_v3_small"
    with pytest.raises(UserError, match="did you mean mobilenet_v3_small"):
        build_model(compose(["model=torchvision", "model.arch=mobilenet_v3_smal"]).model, 32)


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _context(tmp_path: Path, *overrides: str) -> object:
    from hpc_ddp.rank.context.context import Context
    from hpc_ddp.rank.join.distenv import DistEnv
    from hpc_ddp.rank.services.stopping import StopRequest
    from hpc_ddp.rundir import RunDir

    cfg = compose(["trainer.stop_check_interval=3", *overrides])
    env = DistEnv(0, 0, 1, 0, 1, 1, "single", "test")
    return Context(cfg, RunDir(tmp_path / "run"), env, torch.device("cpu"), "host",
                   StopRequest(), "resume")


def test_context_agrees_on_a_stop_only_every_interval(group: None, tmp_path: Path) -> None:
    from hpc_ddp.rank.services import stopping

    ctx = _context(tmp_path)
    ctx._stop.code = stopping.REQUEUE  # type: ignore[attr-defined]
    # Launched at the 3rd call, read at the 4th: the same call on every rank.
    assert [ctx.should_stop() for _ in range(5)] == [False] * 3 + [True] * 2  # type: ignore[attr-defined]
    assert ctx.stop_code == stopping.REQUEUE  # type: ignore[attr-defined]


def test_context_saves_and_loads_with_the_random_streams(group: None, tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    assert ctx.load() is None  # type: ignore[attr-defined]
    torch.manual_seed(3)
    path = ctx.save({"step": 7, "w": torch.ones(2)})  # type: ignore[attr-defined]
    assert path is not None and path.name == "step_000000007.pt"
    ctx.flush()  # type: ignore[attr-defined]  # (a process that ends does it: ctx.close)
    expected = torch.rand(3)
    torch.manual_seed(99)
    again = _context(tmp_path)
    state = again.load()  # type: ignore[attr-defined]
    assert state is not None and state["step"] == 7 and torch.equal(state["w"], torch.ones(2))
    assert torch.equal(torch.rand(3), expected)  # the stream continues where it was saved
    assert again.resumed_from_step == 7 and again.restarts[-1]["cause"] == "resume"  # type: ignore[attr-defined]


def test_context_resumes_past_a_truncated_latest_as_the_trainer_does(group: None,
                                                                     tmp_path: Path) -> None:
    from hpc_ddp import events

    ctx = _context(tmp_path, "trainer.keep_checkpoints=3")
    for step in (5, 10):
        ctx.save({"step": step, "w": torch.full((2,), float(step))})  # type: ignore[attr-defined]
        ctx.flush()  # type: ignore[attr-defined]
    latest = tmp_path / "run" / "checkpoints" / "step_000000010.pt"
    latest.write_bytes(latest.read_bytes()[:100])  # a write the node died in
    again = _context(tmp_path)
    state = again.load()  # type: ignore[attr-defined]
    assert state is not None and state["step"] == 5
    assert torch.equal(state["w"], torch.full((2,), 5.0))
    fallback = [e for e in events.read(tmp_path / "run") if e["kind"] == "checkpoint_fallback"]
    assert len(fallback) == 1 and latest.name in fallback[0]["cause"]
    assert fallback[0]["used_step"] == 5


def test_context_logs_scalars_and_progress(group: None, tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    ctx.total_steps = 20  # type: ignore[attr-defined]
    ctx.log({"loss": 0.5, "acc": 1}, 10)  # type: ignore[attr-defined]
    ctx.close()  # type: ignore[attr-defined]
    progress = json.loads((tmp_path / "run" / "progress.json").read_text())
    assert progress["step"] == 10 and progress["total_steps"] == 20 and progress["loss"] == 0.5
    from hpc_ddp.watch.follow import progress_text

    assert progress_text(progress) == "loss 0.5000  acc 1"


def test_settled_buckets_leave_nothing_behind(group: None) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hpc_ddp.rank.services.ddp_warmup import settle_buckets

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model = DDP(net)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    sample = torch.randn(8, 4)
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    settle_buckets(model, sample)
    assert torch.equal(torch.rand(2), expected)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert all(p.grad is None for p in net.parameters())


def test_entry_results_become_json() -> None:
    from hpc_ddp.rank.main.entry import jsonable

    assert jsonable({"a": torch.tensor(1.5), "b": [torch.ones(2)], 3: object}) == {
        "a": 1.5, "b": [[1.0, 1.0]], "3": "<class 'object'>"}


def _script_main(tmp_path: Path, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "s.py"
    script.write_text(code)
    return subprocess.run([sys.executable, "-m", "hpc_ddp.rank.main.script_runner", str(script),
                           *args], capture_output=True, text=True, cwd=REPO, check=False)


def test_script_runner_is_python_running_the_script(tmp_path: Path) -> None:
    done = _script_main(tmp_path, "import sys, os\nprint(__name__, sys.argv, sys.path[0])\n"
                        "open(os.path.join(os.path.dirname(__file__), 'out'), 'w')"
                        ".write('kept')\n", "a b", "--x")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(None, 1)[0] == "__main__"
    assert f"['{tmp_path / 's.py'}', 'a b', '--x']" in done.stdout
    assert done.stdout.strip().endswith(str(tmp_path))  # sys.path[0]: the script's folder
    assert (tmp_path / "out").read_text() == "kept"  # an unclosed file is flushed


@pytest.mark.parametrize("code, exit_code, err", [
    ("raise SystemExit(75)", 75, ""),
    ("import sys; sys.exit('bad')", 1, "bad"),
    ("raise ValueError('boom')", 1, "ValueError: boom"),
    ("import atexit; atexit.register(lambda: print('at exit'))", 0, ""),
])
def test_script_runner_exit_codes(tmp_path: Path, code: str, exit_code: int, err: str) -> None:
    done = _script_main(tmp_path, code)
    assert done.returncode == exit_code and err in done.stderr
    if "atexit" in code:
        assert done.stdout.strip() == "at exit"


def test_script_command_and_environment(tmp_path: Path) -> None:
    from hpc_ddp.rank.join.distenv import DistEnv
    from hpc_ddp.rank.join.joined import Rank
    from hpc_ddp.rank.join.rendezvous import Endpoint
    from hpc_ddp.rank.supervise.script import command, script_environment
    from hpc_ddp.rank.supervise.supervisor import child_environment
    from hpc_ddp.rundir import RunDir

    cfg = compose(["script=-m pkg.train", "cluster.signal=SIGUSR1"])
    cfg = type(cfg)(**{**cfg.__dict__, "script_args": ["--lr", "0.1"]})
    assert command(cfg)[1:] == ["-m", "hpc_ddp.rank.main.script_runner", "-m", "pkg.train",
                                "--lr", "0.1"]
    env = DistEnv(5, 1, 8, 2, 4, 2, "slurm", "12.0", restart=1)
    rank = Rank(env, "node3", torch.device("cpu"), [], endpoint=Endpoint("node1", 4321))
    child = child_environment(rank, {"KEEP": "1"},
                              script_environment(cfg, rank, RunDir(tmp_path), "requeue", None))
    assert {k: child[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                  "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                                  "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT",
                                  "HPC_DDP_REQUEUE_SIGNAL", "KEEP")} == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "4321",
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "1",
        "HPC_DDP_REQUEUE_SIGNAL": "USR1", "KEEP": "1"}
    assert child["HPC_DDP_STOP_FILE"].endswith("12.0-r1.stopped")


def test_results_table_for_an_entry() -> None:
    from hpc_ddp.rank.supervise.outcome import summary_line
    from hpc_ddp.watch.follow import results_table

    table = results_table({"world_size": 2, "nodes": ["a"], "program": "entry p:m",
                           "global_step": 5, "eval_accuracy": None,
                           "result": {"final_loss": 0.25, "note": "ok", "big": [1, 2]},
                           "restarts": 0})
    assert "program     entry p:m" in table and "final_loss  0.2500" in table
    assert "eval accuracy" not in table and "big" not in table
    assert summary_line({"global_step": 5, "eval_loss": 0.5}) == "step 5, eval loss 0.5000"


def test_what_main_returns_is_in_the_table_booleans_and_dicts_too() -> None:
    """docs/your-code.md: what main(ctx) returns goes into the results table; booleans and
    dicts were left out."""
    from hpc_ddp.watch.follow import results_table

    table = results_table({"world_size": 1, "nodes": ["a"], "program": "entry p:m",
                           "result": {"converged": True, "early": False,
                                      "metrics": {"f1": 0.5, "per": {"a": 1}}, "big": [1]}})
    rows = [line.split() for line in table.splitlines()[1:]]
    assert ["converged", "true"] in rows and ["early", "false"] in rows
    assert ["metrics.f1", "0.5000"] in rows and ["metrics.per.a", "1"] in rows
    assert not any(r[0] == "big" for r in rows)  # a list: in summary.json only


def test_a_script_that_saved_no_step_ends_with_its_name_not_step_none() -> None:
    from hpc_ddp.rank.supervise.outcome import summary_line

    said = summary_line({"program": "script train_ddp.py --epochs 3", "global_step": None})
    assert said == "script train_ddp.py --epochs 3" and "None" not in said


def test_timm_is_optional_and_says_so() -> None:
    import importlib.util

    from hpc_ddp.trainer.models import build_model

    cfg = compose(["model=timm", "model.arch=resnet18"])
    if importlib.util.find_spec("timm") is not None:
        assert build_model(cfg.model, 32, 10) is not None
        return
    with pytest.raises(UserError, match=r"model=timm: needs the timm package.*pip install"):
        build_model(cfg.model, 32, 10)
    # The submit side says it in the same one line, not wrapped in "raised UserError: ...".
    import hpc_ddp

    with pytest.raises(UserError) as refused:
        hpc_ddp.plan(["model=timm", "model.arch=resnet18", "cluster=local"], environ={})
    assert refused.value.message.startswith("model=timm: needs the timm package")
    assert "raised" not in refused.value.message
