"""The CUDA fast path: NCCL, device placement, pinned batches, bf16 autocast, channels_last,
fused optimizer, torch.compile, the CUDA-event step split — and the trainer's guarantees on a
GPU (stretches of steps are one run). Skipped without CUDA; scripts/gpu_check.sh runs them."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# cuBLAS is deterministic only with a fixed workspace; it must be set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
Run = Callable[..., subprocess.CompletedProcess[str]]
SMALL = ["trainer.max_steps=12", "trainer.batch_size=32", "data.train_size=256",
         "data.eval_size=64", "data.augment=true", "trainer.log_interval=4",
         "trainer.checkpoint_interval=1000"]


@pytest.fixture(scope="module")
def nccl_group() -> Iterator[torch.device]:
    import torch.distributed as dist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device)
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield device
    dist.destroy_process_group()


def _trainer(overrides: list[str], folder: Path, device: torch.device) -> Any:
    from hpc_ddp.config.compose import compose
    from hpc_ddp.rank.join.distenv import DistEnv
    from hpc_ddp.rundir import RunDir
    from hpc_ddp.trainer.loop import Trainer

    env = DistEnv(rank=0, local_rank=0, world_size=1, node_rank=0, num_nodes=1,
                  local_world_size=1, source="single", job_id="gpu-test")
    return Trainer(compose([*SMALL, *overrides]), env, RunDir(folder), device, cpus=4)


def test_defaults_resolve_to_the_fast_path(nccl_group: torch.device, tmp_path: Path) -> None:
    import torch.distributed as dist

    trainer = _trainer([], tmp_path / "t", nccl_group)
    tune = trainer.tuning
    assert dist.get_backend() == "nccl"
    assert (tune.precision, tune.channels_last, tune.fused_optimizer) == ("bf16", True, True)
    assert tune.pin_memory and tune.num_workers == 3 and tune.batched_loader
    assert trainer.optimizer.defaults["fused"] is True
    weight = trainer.model.module[0].weight
    assert weight.is_cuda and weight.is_contiguous(memory_format=torch.channels_last)
    images, _ = next(iter(trainer.loaders.train))
    assert images.is_pinned() and images.dtype == torch.uint8
    summary = trainer.train()
    assert summary["device"] == "cuda:0" and summary["global_step"] == 12
    assert summary["settings"]["precision"] == "bf16"
    assert summary["final_train_loss"] == summary["final_train_loss"]  # not NaN


def test_stretches_of_steps_are_one_run_on_the_gpu(nccl_group: torch.device,
                                                   tmp_path: Path) -> None:
    whole = _trainer(["data.num_workers=0"], tmp_path / "a", nccl_group)
    whole.train()
    parts = _trainer(["data.num_workers=0"], tmp_path / "b", nccl_group)
    parts.begin()
    for n in (5, 3, 100):
        parts.train_steps(n)
    parts.close()
    a, b = whole.model.module.state_dict(), parts.model.module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (whole.global_step, whole.samples_seen) == (parts.global_step, parts.samples_seen)
    assert whole.last_train_loss == parts.last_train_loss


def test_resume_from_a_checkpoint_on_the_gpu(nccl_group: torch.device, tmp_path: Path) -> None:
    """A requeue on a GPU: the checkpoint holds CUDA weights, CPU RNG states, fused AdamW."""
    adamw = ["optim=adamw", "optim.lr=0.003"]
    whole = _trainer(adamw, tmp_path / "whole", nccl_group)
    whole.train()
    first = _trainer(adamw, tmp_path / "parts", nccl_group)
    first.begin()
    first.train_steps(7)
    first.save_checkpoint()
    first.close()
    second = _trainer(adamw, tmp_path / "parts", nccl_group)
    second.resume_if_possible("test")
    assert second.global_step == 7
    state = second.optimizer.state[next(iter(second.model.parameters()))]
    assert state["exp_avg"].is_cuda
    second.train()
    a, b = whole.model.module.state_dict(), second.model.module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert whole.last_train_loss == second.last_train_loss


def test_fp16_with_the_grad_scaler_and_accumulation(nccl_group: torch.device,
                                                   tmp_path: Path) -> None:
    trainer = _trainer(["trainer.precision=fp16", "trainer.grad_accum=2",
                        "trainer.max_steps=8"], tmp_path / "fp16", nccl_group)
    assert trainer.scaler.is_enabled()
    summary = trainer.train()
    assert summary["global_step"] == 8 and summary["settings"]["precision"] == "fp16"
    assert summary["samples_seen"] == 8 * 2 * 32
    # The scaler skips the steps whose scaled gradients overflow (at least the first, at its
    # initial 65536) and no more than a few; what it lets through leaves every weight finite.
    # (The loss itself is no measure here: with augmentation this run's fp32 twin ends at
    # ~12.5 and fp16 at ~23.9 after 8 steps, the same on CPU and on an H200.)
    assert 2.0**16 / 2**4 <= trainer.scaler.get_scale() < 2.0**16
    assert torch.isfinite(torch.tensor(summary["final_train_loss"]))
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    # fp16 with SGD's momentum takes torch's foreach kernel (ddp_setup.fused_optimizer):
    # a fused step skipped first leaves its momentum buffers unwritten.
    assert trainer.tuning.fused_optimizer is False


def test_workers_and_pinning_train_the_same_weights(nccl_group: torch.device,
                                                    tmp_path: Path) -> None:
    plain = _trainer(["data.num_workers=0", "data.pin_memory=false", "data.batched=false"],
                     tmp_path / "a", nccl_group)
    plain.train()
    fast = _trainer([], tmp_path / "b", nccl_group)
    fast.train()
    a, b = plain.model.module.state_dict(), fast.model.module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_compile_trains(nccl_group: torch.device, tmp_path: Path) -> None:
    trainer = _trainer(["trainer.compile=true", "trainer.max_steps=6"], tmp_path / "c",
                       nccl_group)
    assert trainer.forward is not trainer.model
    summary = trainer.train()
    assert summary["global_step"] == 6 and summary["settings"]["compile"] is True


def test_step_timer_uses_cuda_events(nccl_group: torch.device) -> None:
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hpc_ddp.trainer.loop_timing import StepTimer

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3), torch.nn.ReLU(),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                              torch.nn.Linear(64, 10)).to(nccl_group)
    model = DDP(net, device_ids=[0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(64, 3, 64, 64), torch.randint(0, 10, (64,))) for _ in range(5)]
    timer = StepTimer(nccl_group).attach(model.parameters(), optimizer)
    timer.start()
    for x, y in timer.wrap(batches):
        loss = F.cross_entropy(model(x.to(nccl_group)), y.to(nccl_group))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    window = timer.stop(5)
    assert window.compute_s > 0 and window.optimizer_s > 0 and window.comm_s >= 0
    assert window.mem_kind == "cuda_allocated" and (window.peak_mem_mb or 0) > 0
    assert window.compute_s + window.comm_s + window.optimizer_s <= window.wall_s * 1.05


def test_sync_probe_waits_for_the_gpu_on_sampled_steps_only(nccl_group: torch.device,
                                                            monkeypatch: Any) -> None:
    """The gradient sync's share (trainer/sync_probe.py): CUDA events, and the two
    synchronisations of a sampled step the only host waits in the loop."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hpc_ddp.trainer.sync_probe import SyncProbe
    from hpc_ddp.trainer.throughput import RankClock

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3), torch.nn.ReLU(),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                              torch.nn.Linear(64, 10)).to(nccl_group)
    model = DDP(net, device_ids=[0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = SyncProbe(nccl_group, model.parameters(), optimizer, every=4)
    waits = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (waits.append(1), real(*a)))
    batches = [(torch.randn(64, 3, 64, 64), torch.randint(0, 10, (64,))) for _ in range(10)]
    for x, y in RankClock(nccl_group, probe).batches(batches):
        loss = F.cross_entropy(model(x.to(nccl_group)), y.to(nccl_group))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    total = probe.total()
    assert total.steps == 2 and len(waits) == 2 * total.steps  # steps 2 and 6 of 0..9
    assert total.share is not None and 0.0 <= total.share <= 1.0
    assert total.sync_ms is not None and total.step_ms is not None and total.step_ms > 0
    probe.close()


def test_one_gpu_rank_through_submit(hpc_ddp: Run, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", ["cluster=local", "cluster.tasks_per_node=1",
                              "cluster.gpus_per_node=1", "cluster.cpus_per_task=4",
                              "trainer.max_steps=30", f"run_dir={run_dir}"], timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["device"].startswith("cuda") and summary["settings"]["precision"] == "bf16"
    assert summary["eval_accuracy"] > 0.2
    rank0 = json.loads((run_dir / "ranks" / "rank0.json").read_text())
    assert rank0["device"]["compute"] == "cuda" and rank0["device"]["index"] == 0


def test_bench_train_on_the_gpu(hpc_ddp: Run, tmp_path: Path) -> None:
    done = hpc_ddp("bench.train", ["--models", "null,tiny_cnn", "--rounds", "2",
                                   "--window-s", "0.2", "cluster=local",
                                   "cluster.tasks_per_node=1", "cluster.gpus_per_node=1",
                                   "cluster.cpus_per_task=4", f"run_dir={tmp_path / 'b'}"],
                   timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "b" / "bench" / "train.json").read_text())
    assert result["device"].startswith("cuda") and result["backend"] == "nccl"
    assert all(r["mem_kind"] == "cuda_allocated" for r in result["rows"])
