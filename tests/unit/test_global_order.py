"""The global order (data/global_order.py): each step's samples and the optimizer's global
batch are the same at any world size, and a checkpoint's position means the same samples."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from hpc_ddp.data.global_order import GlobalBatches, part


def _steps(world: int, length: int = 1000, batch: int = 16, planned: int = 4, epoch: int = 0,
           start: int = 0) -> list[Counter[int]]:
    """Each micro-batch's samples over all ranks of ``world``, as a multiset."""
    ranks = []
    for rank in range(world):
        sampler = GlobalBatches(length, batch, planned, world, rank, seed=3)
        sampler.set_position(epoch, start * batch)
        ranks.append(list(sampler))
    return [Counter(i for r in ranks for i in r[k]) for k in range(len(ranks[0]))]


def test_every_step_trains_on_the_same_samples_at_any_world_size() -> None:
    four, three, one = _steps(4), _steps(3), _steps(1)
    assert len(four) == 1000 // 64 and four == three == one
    assert all(sum(step.values()) == 64 for step in four)  # the same global batch
    seen = sum(four, Counter())
    assert max(seen.values()) == 1 and len(seen) == 15 * 64  # an epoch: no sample twice
    assert _steps(4, epoch=1) != four  # each epoch its own permutation


def test_a_position_saved_at_one_world_size_continues_exactly_at_another() -> None:
    uninterrupted = _steps(4, epoch=2)
    before = _steps(4, epoch=2)[:6]
    after = _steps(3, epoch=2, start=6)  # the checkpoint: six micro-batches of epoch 2
    assert before + after == uninterrupted


def test_an_uneven_split_differs_by_one_sample_and_weighs_the_gradient_exactly() -> None:
    assert [part(64, 3, r) for r in range(3)] == [(0, 22), (22, 21), (43, 21)]
    weights = [GlobalBatches(640, 16, 4, 3, r).weight for r in range(3)]
    assert weights == [22 * 3 / 64, 21 * 3 / 64, 21 * 3 / 64]
    assert [GlobalBatches(640, 16, 4, 4, r).weight for r in range(4)] == [1.0] * 4
    # DDP averages the ranks' gradients: with each rank's mean loss weighed, the average is
    # the gradient of the mean loss over all 64 samples.
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 2)
    x, y = torch.randn(64, 5), torch.randint(0, 2, (64,))

    def grad(xs: torch.Tensor, ys: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        model.zero_grad()
        (torch.nn.functional.cross_entropy(model(xs), ys) * weight).backward()
        assert model.weight.grad is not None
        return model.weight.grad.clone()

    whole = grad(x, y)
    ranks = [grad(x[s:s + n], y[s:s + n], weights[r])
             for r, (s, n) in enumerate(part(64, 3, r) for r in range(3))]
    assert torch.allclose(sum(ranks) / 3, whole, atol=1e-6)  # type: ignore[arg-type]


def test_impossible_sizes_are_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GlobalBatches(50, 16, 4, 4, 0)
    with pytest.raises(ValueError, match="cannot feed 5 ranks"):
        GlobalBatches(100, 1, 4, 5, 0)


def test_the_built_in_loaders_take_the_global_order_when_planned() -> None:
    from hpc_ddp.config.compose import compose
    from hpc_ddp.data.loaders import build_loaders

    cfg = compose(["data.train_size=640", "data.eval_size=64"]).data
    parts = [build_loaders(cfg, 16, r, 3, 0, planned=4) for r in range(3)]
    assert all(p.global_order for p in parts)
    first = [next(iter(p.train)) for p in parts]
    assert [len(labels) for _, labels in first] == [22, 21, 21]
    plain = build_loaders(cfg, 16, 0, 3, 0)
    assert not plain.global_order and plain.loss_weight == 1.0
