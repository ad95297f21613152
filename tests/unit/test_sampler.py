"""Shards are disjoint and cover the data; a resumed epoch continues exactly where it stopped."""

from __future__ import annotations

import pytest

from hpc_ddp.data.sampler import ResumableDistributedSampler, eval_shard


@pytest.mark.parametrize("length, world", [(100, 4), (101, 3), (7, 2)])
def test_shards_cover_the_epoch_and_set_epoch_reshuffles(length: int, world: int) -> None:
    data = list(range(length))
    samplers = [ResumableDistributedSampler(data, world, r, seed=3) for r in range(world)]
    for s in samplers:
        s.set_position(epoch=0, start=0)
    shards = [list(s) for s in samplers]
    seen = [i for shard in shards for i in shard]
    assert set(seen) == set(data)  # covers
    assert len(seen) - len(set(seen)) == world * samplers[0].num_samples - length  # only padding
    samplers[0].set_position(epoch=1, start=0)
    assert list(samplers[0]) != shards[0]


def test_resume_mid_epoch_gives_the_rest_of_the_same_order() -> None:
    data = list(range(50))
    full = ResumableDistributedSampler(data, 2, 1, seed=0)
    full.set_position(epoch=4, start=0)
    order = list(full)
    resumed = ResumableDistributedSampler(data, 2, 1, seed=0)
    resumed.set_position(epoch=4, start=10)
    assert list(resumed) == order[10:] and len(resumed) == len(order) - 10


def test_eval_shards_count_every_sample_once() -> None:
    shards = [eval_shard(10, r, 3) for r in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(10))
