"""The sharded checkpoint format (DCP) in one process: a state split into its tensors and the
rest (tensor_tree.py), written by the one LoopCheckpoints (atomic latest, pruning, a second
save of a step beside the first), read back as data only with every planted file refused
(dcp_read.py), killed mid-save; the keys of sharded training refused in one line; the export
command."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hpc_ddp import checkpoint as export_cli
from hpc_ddp.config.compose import compose
from hpc_ddp.errors import UserError
from hpc_ddp.owned import Untrusted
from hpc_ddp.rank.services import checkpoint, dcp_read, tensor_tree
from hpc_ddp.rank.services.loop_checkpoints import LoopCheckpoints
from hpc_ddp.rundir import RunDir
from tests.checkpoint_kills import resumed_each_time
from tests.conftest import REPO, compose_refusal
from tests.unit.test_checkpoint_sets import Planted
from tests.unit.test_loop_checkpoints import group  # noqa: F401  (a fixture)


def _saves(tmp_path: Path, *overrides: str) -> LoopCheckpoints:
    cfg = compose(["trainer.checkpoint_format=dcp", "trainer.keep_checkpoints=2", *overrides])
    return LoopCheckpoints(cfg.trainer, RunDir(tmp_path / "run"), 0, 1, 0, "entry t:main")


def _state(step: int) -> dict[str, Any]:
    return {"step": step, "model": {"w": torch.full((3, 4), float(step)), "b": torch.ones(2)},
            "history": [1.5, "x", (torch.arange(3), None)]}


def test_split_and_merge_give_the_state_back() -> None:
    state = _state(3)
    plain, tensors = tensor_tree.split(state)
    assert sorted(tensors) == ["history.2.0", "model.b", "model.w"]
    assert sorted(tensor_tree.names(plain)) == sorted(tensors)
    assert pickle.dumps(plain)  # nothing but plain values left
    back = tensor_tree.merge(plain, tensors)
    assert back["history"][:2] == [1.5, "x"] and torch.equal(back["model"]["w"],
                                                             state["model"]["w"])
    with pytest.raises(ValueError, match="'a.b'"):  # two paths, one name
        tensor_tree.split({"a.b": torch.zeros(1), "a": {"b": torch.zeros(1)}})


@pytest.mark.usefixtures("group")
def test_a_sharded_save_is_a_folder_latest_names_only_once_whole(tmp_path: Path) -> None:
    saves = _saves(tmp_path, "trainer.checkpoint_background=true")
    for step in (1, 2, 2, 3):  # step 2 twice: the second beside the first, never over it
        saves.save(_state(step), step)
    saves.flush()
    folder = tmp_path / "run" / "checkpoints"
    assert [p.name for p in checkpoint.entries(folder)] == ["step_000000002.1.dcp",
                                                           "step_000000003.dcp"]  # kept 2
    assert (folder / "latest").read_text() == "step_000000003.dcp"
    assert not list(folder.glob(".*.tmp"))
    again = _saves(tmp_path)
    into = _state(0)
    state = again.load("requeue", into=into)
    assert state is not None and state["step"] == 3 and again.resumed_from_step == 3
    assert state["model"]["w"] is into["model"]["w"]  # read into the given tensor, in place
    assert torch.equal(into["model"]["w"], torch.full((3, 4), 3.0))
    whole = checkpoint.load_latest(folder)  # and without a template, whole on the CPU
    assert whole is not None and torch.equal(whole["history"][2][0], torch.arange(3))
    assert whole["hpc_ddp"]["step"] == 3


@pytest.mark.usefixtures("group")
def test_full_format_stays_one_file(tmp_path: Path) -> None:
    saves = _saves(tmp_path, "trainer.checkpoint_format=full",
                   "trainer.checkpoint_background=false")
    saves.save(_state(1), 1)
    latest = checkpoint.latest_path(tmp_path / "run" / "checkpoints")
    assert latest is not None and latest.name == "step_000000001.pt" and latest.is_file()
    assert not saves.sharded(_state(1))  # auto: no DTensor, full
    # Any keys, as before the sharded format: a dotted one beside the keys it spells too.
    saves.save({"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}}, 2)
    assert not _saves(tmp_path, "trainer.checkpoint_format=auto").sharded(_state(1))


def _sharded_run(tmp_path: Path) -> Path:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store2"), 1), rank=0,
                            world_size=1)
    try:
        saves = _saves(tmp_path, "trainer.checkpoint_background=false")
        saves.save(_state(1), 1)
        saves.save(_state(2), 2)
    finally:
        dist.destroy_process_group()
    latest = checkpoint.latest_path(tmp_path / "run" / "checkpoints")
    assert latest is not None
    return latest


def test_a_planted_index_is_refused_and_its_payload_never_runs(tmp_path: Path) -> None:
    latest = _sharded_run(tmp_path)
    marker = tmp_path / "ran"
    (latest / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(Untrusted, match="posix.system|os.system"):
        dcp_read.read(latest, tmp_path / "run")
    # A resume refuses it (never skipped for an older one), before anything is submitted too.
    with pytest.raises(Untrusted):
        checkpoint.load_latest(tmp_path / "run" / "checkpoints")
    from hpc_ddp.inputs.resume_check import check_resumable

    cfg = compose(["entry=t:main", "resume=true", f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(UserError, match="run_dir=.*planted"):
        check_resumable(cfg, RunDir(tmp_path / "run"))
    assert not marker.exists()


def test_an_index_naming_another_file_is_refused(tmp_path: Path) -> None:
    latest = _sharded_run(tmp_path)
    metadata = dcp_read.read_metadata(latest / ".metadata", tmp_path / "run")
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere"
    (latest / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(Untrusted, match="elsewhere"):
        dcp_read.read(latest, tmp_path / "run")


def test_a_shard_others_could_write_or_a_link_is_refused(tmp_path: Path) -> None:
    latest = _sharded_run(tmp_path)
    shard = latest / "__0_0.distcp"
    shard.chmod(0o664)
    with pytest.raises(Untrusted, match="__0_0.distcp"):
        dcp_read.read(latest, tmp_path / "run")
    shard.chmod(0o640)
    (latest / "state.pt").unlink()
    (latest / "state.pt").symlink_to(tmp_path / "run" / "checkpoints" / "latest")
    with pytest.raises(Untrusted):
        dcp_read.check(latest, tmp_path / "run")


def test_a_damaged_sharded_latest_falls_back_to_the_one_before(tmp_path: Path) -> None:
    latest = _sharded_run(tmp_path)
    shard = latest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated: damage, not a plant
    state, skipped = checkpoint.load_usable(tmp_path / "run" / "checkpoints")
    assert state is not None and state["step"] == 1 and skipped[0][0] == latest


def test_sigkill_during_sharded_background_saves_never_breaks_latest(tmp_path: Path) -> None:
    # One rank saving in the sharded format in the background, staged (tests/checkpoint_kills),
    # killed 12 times at random moments.
    done = subprocess.run([sys.executable, "-m", "tests.checkpoint_kills",
                           str(tmp_path / "run" / "checkpoints"), "12", "29", "sharded"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["problems"] == [] and result["kills"] == 12
    assert resumed_each_time(result), result
    steps = [s for s in result["steps"] if s is not None]
    assert steps == sorted(steps) and len(set(steps)) >= 2, result


@pytest.mark.parametrize(("overrides", "key"), [
    (["trainer.strategy=zero3"], "trainer.strategy=zero3"),
    (["trainer.checkpoint_format=npz"], "trainer.checkpoint_format=npz"),
    (["trainer.strategy=fsdp", "trainer.channels_last=true"], "trainer.channels_last=true"),
])
def test_sharding_keys_refused_in_one_line(overrides: list[str], key: str) -> None:
    message = compose_refusal(overrides)
    assert message.startswith(key) and "\n" not in message


def test_a_loop_of_its_own_is_not_held_to_the_trainers_limits() -> None:
    cfg = compose(["entry=t:main", "trainer.strategy=fsdp", "trainer.channels_last=true"])
    assert cfg.trainer.strategy == "fsdp"


def test_fsdp_takes_fp16_and_compile() -> None:
    """Both train sharded (the matrix's fsdp-fp16 and fsdp-compile rows): fp16 with torch's
    ShardedGradScaler, compile per block before fully_shard."""
    cfg = compose(["trainer.strategy=fsdp", "trainer.precision=fp16", "trainer.compile=true"])
    assert (cfg.trainer.precision, cfg.trainer.compile) == ("fp16", True)


@pytest.mark.usefixtures("group")
def test_export_writes_one_plain_file_and_refuses_bad_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert export_cli.main(["export", str(run), str(tmp_path / "x.pt")]) == 2
    assert "has no checkpoints folder" in capsys.readouterr().err
    saves = _saves(tmp_path, "trainer.checkpoint_background=false")
    saves.save(_state(1), 1)
    saves.save(_state(2), 2)
    out = tmp_path / "out.pt"
    assert export_cli.main(["export", str(run), "--step", "1", str(out)]) == 0
    exported = torch.load(out, weights_only=True)
    assert exported["step"] == 1 and torch.equal(exported["model"]["w"], torch.ones(3, 4))
    assert export_cli.main(["export", str(run), "--step", "7", str(out)]) == 2
    assert "pick one of 1, 2" in capsys.readouterr().err
    # An existing file is kept unless asked: said in one line, exit 2.
    assert export_cli.main(["export", str(run), str(out)]) == 2
    assert capsys.readouterr().err.startswith(f"error: OUT={out}: exists already. Fix: pass "
                                              "--force")
    assert torch.load(out, weights_only=True)["step"] == 1
    assert export_cli.main(["export", str(run), str(out), "--force"]) == 0
    assert capsys.readouterr().out.startswith(f"replaced {out}")
    assert torch.load(out, weights_only=True)["step"] == 2
    try:
        import safetensors  # noqa: F401
    except ImportError:
        assert export_cli.main(["export", str(run), str(tmp_path / "m.safetensors")]) == 2
        assert "pip install safetensors" in capsys.readouterr().err


class Blocks(torch.nn.Module):
    """Two blocks in a ModuleList and a head: FSDP units for sharding.shard."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(2))
        self.head = torch.nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


@pytest.mark.usefixtures("group")
@pytest.mark.parametrize("fmt", ["full", "dcp"])
def test_a_sharded_model_round_trips_in_either_format(tmp_path: Path, fmt: str) -> None:
    from hpc_ddp.rank.services import sharding

    def trained(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        net = sharding.shard(Blocks(), torch.device("cpu"), "fp32")
        opt = torch.optim.AdamW(net.parameters(), lr=0.1)
        net(torch.randn(4, 6)).sum().backward()
        opt.step()
        return net, opt

    net, opt = trained(0)
    saves = _saves(tmp_path, f"trainer.checkpoint_format={fmt}",
                   "trainer.checkpoint_background=false")
    saves.save({"step": 1, **sharding.state_dict(net, opt)}, 1)
    latest = checkpoint.latest_path(tmp_path / "run" / "checkpoints")
    suffix = "pt" if fmt == "full" else "dcp"
    assert latest is not None and latest.name == f"step_000000001.{suffix}"
    other, other_opt = trained(1)
    into = {"step": 0, **sharding.state_dict(other, other_opt)} if fmt == "dcp" else None
    state = _saves(tmp_path).load("resume", into=into)
    assert state is not None
    sharding.load_state_dict(other, other_opt, state)  # whole tensors (full) are cut to shards
    mine, theirs = sharding.state_dict(net, opt), sharding.state_dict(other, other_opt)
    for name, tensor in mine["model"].items():
        assert torch.equal(tensor.full_tensor(), theirs["model"][name].full_tensor()), name
    for name, moments in mine["optimizer"]["state"].items():
        assert torch.equal(moments["exp_avg"].full_tensor(),
                           theirs["optimizer"]["state"][name]["exp_avg"].full_tensor()), name


@pytest.mark.usefixtures("group")
def test_activation_checkpointing_keeps_the_gradients_and_the_names() -> None:
    from hpc_ddp.rank.services import sharding

    calls: list[str] = []

    def gradients(recompute: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        net = sharding.shard(Blocks(), torch.device("cpu"), "fp32",
                             activation_checkpointing=recompute)
        block, forward = net.blocks[0], net.blocks[0].forward

        def counted(*args: Any) -> Any:
            calls.append(str(recompute))
            return forward(*args)

        block.forward = counted
        net(torch.ones(3, 6)).square().sum().backward()
        return {n: p.grad.full_tensor() for n, p in net.named_parameters()}

    plain, recomputed = gradients(False), gradients(True)
    assert calls == ["False", "True", "True"]  # recomputed in the backward
    assert plain.keys() == recomputed.keys()  # the checkpoint's names do not change
    for name, grad in plain.items():
        assert torch.equal(grad, recomputed[name]), name
