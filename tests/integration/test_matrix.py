"""The combination matrix: every built-in model x strategy x optimizer x precision, the
schedulers, the options and the three entries, each trained a few steps on 2 CPU ranks,
stopped (the ranks agree, checkpoint, stop: as on SIGTERM), resumed, and compared bitwise
with the same run uninterrupted.

The axes are read from the config groups and the schema's lists (conf/model, conf/optim,
conf/scheduler, sharding_rules.STRATEGIES, validate.PRECISIONS): a new model, optimizer,
scheduler or strategy is in the matrix the day it is added. Each row is a real run — planned
by api.plan as the submit command plans it, run by the rank path in warm rank processes
(tests/matrix_pool.py) — on tiny inputs (16x16 images, 4 per rank, 3 steps).

Precision: ``auto`` always, and each explicit value that ``auto`` does not already resolve to
on this machine (bf16 where the CPU has native bf16, else fp32): the same run otherwise.
``fp16`` is crossed with everything on a GPU; on a CPU its convolutions are emulated (a
ResNet-18 step takes ~40 s), so there it is its own rows on the tiny CNN.

On a GPU machine (``HPC_DDP_MATRIX_DEVICE=cuda``, scripts/gpu_check.sh) the same rows run on
one rank on the GPU with NCCL (one GPU cannot hold two NCCL ranks).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_ddp.config.folders import conf_dir
from hpc_ddp.config.sharding_rules import STRATEGIES
from hpc_ddp.config.validate import PRECISIONS
from hpc_ddp.rank.contract import EARLY_STOP_ENV
from hpc_ddp.rank.services import checkpoint, stopping
from hpc_ddp.rank.services.precision import resolve_precision
from tests.conftest import REPO
from tests.matrix_pool import RankPool

DEVICE = os.environ.get("HPC_DDP_MATRIX_DEVICE", "cpu")
WORLD = 1 if DEVICE == "cuda" else 2
STEPS = 3
# Tiny and quick, the subject being the combination: 16x16 images, 4 a rank, 16 an epoch (an
# epoch ends at step 2 on 2 ranks: the resumed part crosses it), an eval at each epoch's end;
# a checkpoint where the run stops and at its end only (each a model's size on disk).
SMALL = [f"trainer.max_steps={STEPS}", "trainer.batch_size=4",
         f"trainer.checkpoint_interval={STEPS}",
         "trainer.log_interval=2", "trainer.stop_check_interval=1", "data.image_size=16",
         "data.train_size=16", "data.eval_size=8", "trainer.collective_timeout_s=120"]


# Models with ImageNet's stem (a stride-2 7x7 convolution and a max-pool) at 32x32: at 16x16
# their last stage gets a 1x1 map, and torch's bf16 CPU convolution then returns garbage
# weight gradients (seen with torch 2.14: taps that only meet padding get values ~1e7 that
# change from one call to the next; https://github.com/pytorch/pytorch/issues/169688).
IMAGENET_STEM = {"torchvision", "timm"}


def sized(model: str) -> list[str]:
    return ["data.image_size=32"] if model in IMAGENET_STEM else []


def group(name: str) -> list[str]:
    """The options of a config group, as conf/ has them."""
    return sorted(p.stem for p in (conf_dir() / name).glob("*.yaml"))


def precisions() -> list[str]:
    """auto, and each explicit precision it does not resolve to here (see the docstring)."""
    auto = resolve_precision("auto", torch.device(DEVICE))
    fp16 = DEVICE == "cuda"
    return ["auto", *(p for p in PRECISIONS if p not in ("auto", auto)
                      and (fp16 or p != "fp16"))]


def _installed(module: str) -> bool:
    """Found, not imported: every test worker collects this module (importing timm: ~2 s)."""
    return importlib.util.find_spec(module) is not None


def row(model: str, *values: str) -> Any:
    """One row, skipped where its model's package is not installed (timm: an extra)."""
    marks = []
    if model == "timm" and not _installed("timm"):
        marks.append(pytest.mark.skip(reason="timm is not installed (pip install -e .[timm])"))
    return pytest.param(model, *values, marks=marks, id="-".join((model, *values)))


CROSS = [row(m, strategy, optim, precision)
         for m in group("model") for strategy in STRATEGIES
         for optim in group("optim") for precision in precisions()]


@pytest.fixture
def tmp_path(tmp_path: Path) -> Iterator[Path]:
    """Run dirs in memory where the machine has /dev/shm: a row writes its model's state
    several times (ResNet-50 with AdamW: 280 MB a checkpoint), and the subject here is the
    combination, not the disk (fsync on tmpfs returns at once)."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix="hpc_ddp_matrix_", dir=shm))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    ranks = RankPool(WORLD, {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES",
                                                                    "0")}
                     if DEVICE == "cuda" else {"CUDA_VISIBLE_DEVICES": ""})
    yield ranks
    ranks.close()


def _state(run_dir: Path) -> dict[str, Any]:
    state = checkpoint.load_latest(run_dir / "checkpoints")
    assert state is not None, f"no checkpoint in {run_dir}"
    return state


def _tensors(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _tensors(value, f"{path}.{key}" if path else str(key))
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from _tensors(value, f"{path}.{i}")


def assert_same_state(expected: dict[str, Any], got: dict[str, Any],
                      parts: tuple[str, ...]) -> None:
    """Every tensor of ``parts`` (model, optimizer, ...) bitwise equal."""
    for part in parts:
        want, have = dict(_tensors(expected[part])), dict(_tensors(got[part]))
        assert want.keys() == have.keys(), part
        for name, tensor in want.items():
            assert torch.equal(tensor, have[name]), f"{part}.{name} differs after the resume"


def stop_resume_compare(pool: RankPool, args: list[str], tmp_path: Path,
                        parts: tuple[str, ...] = ("model", "optimizer", "scheduler",
                                                  "counters"),
                        cwd: Path | None = None, steps: int = STEPS) -> dict[str, Any]:
    """Run ``args`` uninterrupted; run it again stopped at its first stop check (the ranks
    agree, checkpoint, stop) and resumed; the two final checkpoints must agree bitwise.
    ``steps``: the run's length. Returns the uninterrupted run's summary."""
    reference = pool.run(args, tmp_path / "reference", cwd=cwd)
    assert reference.ok, "\n".join(reference.errors)
    assert reference.summary is not None

    run_dir = tmp_path / "run"
    pool.environ[EARLY_STOP_ENV] = str(stopping.TERM)  # as if SIGTERM came at the start
    try:
        stopped = pool.run(args, run_dir, cwd=cwd)
    finally:
        del pool.environ[EARLY_STOP_ENV]
    assert not stopped.ok and all("stopped at step" in e or "SystemExit" in e
                                  for e in stopped.errors), "\n".join(stopped.errors)
    at = checkpoint.latest_step(run_dir / "checkpoints")
    assert at is not None and 0 < at < steps, at
    resumed = pool.run([*args, "resume=true"], run_dir, cwd=cwd)
    assert resumed.ok, "\n".join(resumed.errors)
    want, got = _state(tmp_path / "reference"), _state(run_dir)
    assert got["hpc_ddp"]["restarts"][-1]["from_step"] == at
    assert_same_state(want, got, parts)
    return reference.summary


@pytest.mark.parametrize(("model", "strategy", "optim", "precision"), CROSS)
def test_trains_stops_and_resumes_bitwise(pool: RankPool, tmp_path: Path, model: str,
                                          strategy: str, optim: str, precision: str) -> None:
    summary = stop_resume_compare(pool, [
        f"model={model}", f"trainer.strategy={strategy}", f"optim={optim}",
        f"trainer.precision={precision}", *SMALL, *sized(model)], tmp_path)
    assert summary["global_step"] == STEPS and summary["world_size"] == WORLD
    assert summary["settings"]["strategy"] == strategy
    expected = resolve_precision(precision, torch.device(DEVICE))
    assert summary["settings"]["precision"] == expected
    assert summary["final_train_loss"] == summary["final_train_loss"]  # not NaN


# The options the cross leaves at their defaults, each its own row on a model where it matters
# (BatchNorm's buffers, several blocks): {id: overrides}.
OPTIONS = {
    "fsdp-grad_accum": ["trainer.strategy=fsdp", "model=resnet18", "trainer.grad_accum=2"],
    "ddp-grad_accum": ["trainer.strategy=ddp", "model=resnet18", "trainer.grad_accum=2"],
    "fsdp-activation_checkpointing": ["trainer.strategy=fsdp", "model=resnet18",
                                      "trainer.activation_checkpointing=true"],
    "fsdp-no_reshard_after_forward": ["trainer.strategy=fsdp", "model=resnet18",
                                      "trainer.reshard_after_forward=false"],
    "fsdp-checkpoint_format_full": ["trainer.strategy=fsdp", "model=resnet18",
                                    "trainer.checkpoint_format=full"],
    "ddp-checkpoint_format_dcp": ["trainer.strategy=ddp", "model=resnet18",
                                  "trainer.checkpoint_format=dcp"],
    "ddp-compile": ["trainer.strategy=ddp", "trainer.compile=true"],
    "fsdp-compile": ["trainer.strategy=fsdp", "trainer.compile=true"],
    "ddp-torchvision_mobilenet": ["trainer.strategy=ddp", "model=torchvision",
                                  "model.arch=mobilenet_v3_small", "data.image_size=32"],
    "fsdp-torchvision_mobilenet": ["trainer.strategy=fsdp", "model=torchvision",
                                   "model.arch=mobilenet_v3_small", "data.image_size=32"],
    **{f"{strategy}-fp16": [f"trainer.strategy={strategy}", "trainer.precision=fp16"]
       for strategy in STRATEGIES if DEVICE != "cuda"},  # on a GPU fp16 is in the cross
    **{f"{strategy}-scheduler_{name}": [f"trainer.strategy={strategy}", f"scheduler={name}"]
       for strategy in STRATEGIES for name in group("scheduler")},
}


@pytest.mark.parametrize("overrides", [pytest.param(v, id=k) for k, v in OPTIONS.items()])
def test_option_trains_stops_and_resumes_bitwise(pool: RankPool, tmp_path: Path,
                                                 overrides: list[str]) -> None:
    summary = stop_resume_compare(pool, [*SMALL, *overrides], tmp_path)
    assert summary["global_step"] == STEPS
    settings = summary["settings"]
    for item in overrides:  # each option is in effect, not only accepted
        key, _, value = item.partition("=")
        name = key.removeprefix("trainer.")
        if key.startswith("trainer.") and name in settings and name != "precision":
            assert str(settings[name]).lower() == value, (name, settings[name])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cifar10_on_disk_trains_stops_and_resumes_bitwise(pool: RankPool, tmp_path: Path,
                                                          strategy: str) -> None:
    from tests.unit.test_cifar10 import write_cifar10

    write_cifar10(tmp_path / "data", per_batch=8)  # 40 training images, 8 to evaluate
    summary = stop_resume_compare(pool, [
        "data=cifar10", f"data.root={tmp_path / 'data'}", "data.verify_checksum=false",
        f"trainer.strategy={strategy}", *(a for a in SMALL if not a.startswith("data."))],
        tmp_path)
    assert summary["global_step"] == STEPS and summary["eval_metrics"]


ENTRY_MODELS = ("tiny_cnn", "resnet18")


@pytest.mark.parametrize("model", ENTRY_MODELS)
@pytest.mark.parametrize("shard", [False, True], ids=["ddp", "ctx.shard"])
def test_function_entry_trains_stops_and_resumes_bitwise(pool: RankPool, tmp_path: Path,
                                                         model: str, shard: bool) -> None:
    """A user's loop over the configured model, sharded with ctx.shard or in DDP, at the
    default precision (ctx.shard: bf16 where auto says so)."""
    summary = stop_resume_compare(pool, [
        "entry=tests.usercode.matrix_entry:main", f"model={model}", f"app.shard={shard}",
        f"app.steps={STEPS}", "trainer.stop_check_interval=1"], tmp_path,
        parts=("model", "optimizer"), cwd=REPO)
    assert summary["steps"] == STEPS


def test_script_entry_trains_under_the_rank_path(pool: RankPool, tmp_path: Path) -> None:
    """A torchrun-style script (the example project's), unchanged, on the same ranks."""
    project = REPO / "examples" / "seqproject"
    checkpoint_file = tmp_path / "script.pt"
    done = pool.run(["script=train_ddp.py", "script_args=[--epochs,1,--batch-size,64,"
                     f"--checkpoint,{checkpoint_file}]"], tmp_path / "run", cwd=project)
    assert done.ok, "\n".join(done.errors)
    assert checkpoint_file.is_file() and (tmp_path / "run" / "summary.json").is_file()
