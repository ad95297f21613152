"""DDP's communication hooks (trainer.ddp_comm_hook) on 2 CPU ranks with Gloo, through the
real rank path in warm rank processes (tests/matrix_pool.py): each hook's run stopped (the
ranks agree, checkpoint, stop) and resumed equals the uninterrupted run bitwise, PowerSGD's
per-rank state included, for the built-in trainer and for a loop that takes its model from
ctx.ddp; accumulation's no_sync micro-batches reduce nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_ddp.rank.services import checkpoint
from tests.conftest import REPO
from tests.integration.test_matrix import SMALL, STEPS, assert_same_state, stop_resume_compare
from tests.matrix_pool import RankPool

WORLD = 2
# PowerSGD: 2 steps of plain all-reduce, then compressed; the stop check at step 3 stops the
# run at step 4, after two compressed steps, so the resumed steps 5 and 6 need the restored
# error feedback, warm-start P and Q and warm-up counter to take the uninterrupted steps.
POWERSGD_STEPS = 6
POWERSGD = ["trainer.ddp_comm_hook=powersgd", "trainer.ddp_powersgd_warmup_steps=2",
            "trainer.stop_check_interval=3"]


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    ranks = RankPool(WORLD, {"CUDA_VISIBLE_DEVICES": ""})
    yield ranks
    ranks.close()


def _own_states(run_dir: Path, step: int) -> list[dict[str, Any]]:
    """Every rank's own states (the hook's) in its file beside the checkpoint of ``step``."""
    folder = run_dir / "checkpoints"
    return [torch.load(checkpoint.streams_path(folder, rank, step), weights_only=True)["own"]
            for rank in range(WORLD)]


def _same_own_states(reference: Path, resumed: Path, step: int) -> list[dict[str, Any]]:
    want, got = _own_states(reference, step), _own_states(resumed, step)
    for rank, (a, b) in enumerate(zip(want, got, strict=True)):
        assert_same_state({"own": a}, {"own": b}, ("own",))
        assert a["comm_hook"]["iter"] == b["comm_hook"]["iter"], rank
    return want


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_compression_hook_stops_and_resumes_bitwise(pool: RankPool, tmp_path: Path,
                                                    hook: str) -> None:
    summary = stop_resume_compare(pool, [*SMALL, f"trainer.ddp_comm_hook={hook}"], tmp_path)
    assert summary["global_step"] == STEPS and summary["settings"]["ddp_comm_hook"] == hook
    assert summary["final_train_loss"] == summary["final_train_loss"]  # not NaN


def test_powersgd_trainer_stops_and_resumes_bitwise_with_its_state(pool: RankPool,
                                                                   tmp_path: Path) -> None:
    args = [*SMALL, f"trainer.max_steps={POWERSGD_STEPS}",
            f"trainer.checkpoint_interval={POWERSGD_STEPS}", *POWERSGD]
    summary = stop_resume_compare(pool, args, tmp_path, steps=POWERSGD_STEPS)
    assert summary["settings"]["ddp_comm_hook"] == "powersgd"
    states = _same_own_states(tmp_path / "reference", tmp_path / "run", POWERSGD_STEPS)
    # Four compressed steps' error feedback, this rank's own: the ranks' differ.
    assert states[0]["comm_hook"]["iter"] == POWERSGD_STEPS
    assert not torch.equal(states[0]["comm_hook"]["error"][0], states[1]["comm_hook"]["error"][0])


def test_ctx_ddp_entry_with_powersgd_and_accumulation(pool: RankPool, tmp_path: Path) -> None:
    """A loop with ctx.ddp: the hook applies, its state resumes bitwise, and of its
    micro-batches only each step's last reduces (no_sync: the hook is not called)."""
    accum = 3
    summary = stop_resume_compare(pool, [
        "entry=tests.usercode.comm_hook_entry:main", f"app.steps={POWERSGD_STEPS}",
        f"app.accum={accum}", *POWERSGD], tmp_path, parts=("model", "optimizer"), cwd=REPO,
        steps=POWERSGD_STEPS)
    assert summary["hook"] == "powersgd" and summary["steps"] == POWERSGD_STEPS
    assert summary["micro_batches"] == accum * POWERSGD_STEPS
    assert summary["syncs"] == POWERSGD_STEPS  # one per step, the settling step not counted
    assert summary["calls"] == POWERSGD_STEPS + 1  # one bucket; the settling step's call
    _same_own_states(tmp_path / "reference", tmp_path / "run", POWERSGD_STEPS)


def test_hook_refused_for_ctx_shard(pool: RankPool, tmp_path: Path) -> None:
    """An entry's ctx.shard under a hook: refused on the ranks, naming the key and the fix."""
    done = pool.run(["entry=tests.usercode.matrix_entry:main", "app.shard=true",
                     "app.steps=1", "trainer.ddp_comm_hook=bf16"], tmp_path / "run", cwd=REPO)
    assert not done.ok
    assert all("trainer.ddp_comm_hook" in e and "ctx.ddp(model)" in e for e in done.errors), (
        done.errors)


# ~4 MB of gradients: DDP's default buckets (the first 1 MiB) make several.
WIDE = ["model._target_=tests.usercode.scaling_parts.WideMlp", "model.width=1024",
        "data._target_=tests.usercode.scaling_parts.vectors", "data.size=64",
        f"trainer.max_steps={POWERSGD_STEPS}", "trainer.batch_size=8", *POWERSGD]


def test_powersgd_over_gloo_with_several_buckets_is_refused_and_one_bucket_trains(
        pool: RankPool, tmp_path: Path) -> None:
    """torch's PowerSGD hook waits inside Gloo's callbacks: with two buckets in flight every
    rank hung at its first compressed step (seen before the check). Refused on the ranks with
    the bucket size that makes one; with it, the same model trains to its end."""
    refused = pool.run(WIDE, tmp_path / "refused")
    assert not refused.ok and len(refused.errors) == WORLD
    for error in refused.errors:
        assert "trainer.ddp_comm_hook=powersgd: hangs over Gloo" in error, error
        assert "Fix: one bucket: trainer.ddp_bucket_cap_mb=6" in error, error
    done = pool.run([*WIDE, "trainer.ddp_bucket_cap_mb=6"], tmp_path / "one_bucket")
    assert done.ok, "\n".join(done.errors)
    assert done.summary is not None and done.summary["global_step"] == POWERSGD_STEPS
