"""data=shards (hpc_ddp/data/shards.py, shard_index.py, pack.py): an even split whatever the
shard counts, seeded shuffles, batches independent of loader workers, exact mid-epoch resume,
WebDataset's own reader agreeing with what pack wrote, and check_data's report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_ddp.data import fake_images, pack
from hpc_ddp.data.shard_index import per_rank, rank_order


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 classes x 17 + 5 JPEGs of 48x40 px, packed 10 to a shard (uneven: 6 shards, the
    last of 1 sample)."""
    root = tmp_path_factory.mktemp("shards")
    fake_images.write_folder(root / "src", 3, {"train": 17, "val": 5}, (48, 40))
    pack.pack_folder(str(root / "src"), str(root / "shards"), samples_per_shard=10,
                     out=open("/dev/null", "w"))  # noqa: SIM115
    return root / "shards"


@pytest.mark.parametrize("counts, world", [
    ((10, 10, 10, 10, 10, 1), 4),      # uneven shards, total 51 over 4 ranks
    ((7, 3, 9), 8),                    # more ranks than shards
    ((5,) * 8, 4),                     # divides evenly: no padding
    ((1000, 999, 1, 37), 3),
])
def test_every_rank_gets_the_same_samples_disjoint_and_covering(counts: tuple[int, ...],
                                                                world: int) -> None:
    total = sum(counts)
    orders = [rank_order(counts, r, world, 7, 0, 4).tolist() for r in range(world)]
    assert {len(o) for o in orders} == {per_rank(total, world)}  # equal: nobody hangs
    union = [i for o in orders for i in o]
    padding = len(union) - total
    assert 0 <= padding < world
    assert set(union) == set(range(total))  # every sample each epoch
    assert len(set(union)) == len(union) - padding  # repeats only for the padding


def test_a_rank_reads_few_shards_and_epochs_reshuffle() -> None:
    counts = (100,) * 16
    order = rank_order(counts, 1, 4, 0, 0, 32)
    assert len(set((order // 100).tolist())) <= 5  # 400 samples: 4 shards, 5 when straddling
    assert not torch.equal(order, rank_order(counts, 1, 4, 0, 1, 32))  # set_epoch
    assert torch.equal(order, rank_order(counts, 1, 4, 0, 0, 32))  # seeded: the same again
    assert not torch.equal(order, rank_order(counts, 1, 4, 1, 0, 32))  # another seed
    plain = rank_order(counts, 1, 4, 0, 0, 1)  # no buffer: the shards' own order
    window, unshuffled = order[:32].tolist(), plain[:32].tolist()
    assert sorted(window) == sorted(unshuffled) and window != unshuffled  # within the buffer


def test_eval_is_split_unpadded_and_unshuffled() -> None:
    parts = [rank_order((10, 3), r, 4, 0, 0, 8, train=False).tolist() for r in range(4)]
    assert [i for p in parts for i in p] == list(range(13))


def _loader(root: Path, workers: int, rank: int = 0, world: int = 2) -> tuple[Any, Any]:
    from torch.utils.data import DataLoader

    from hpc_ddp.data.shards import ShardSet

    shards = ShardSet(str(root), "train", rank, world, 3, 32, True, True, "auto", 8)
    return shards, DataLoader(shards.batches(4), batch_size=None, num_workers=workers,
                              persistent_workers=workers > 0)


def _pass(shards: Any, loader: Any, epoch: int, start: int) -> list[tuple[Any, Any]]:
    shards.set_position(epoch, start)
    return list(loader)


def test_batches_do_not_depend_on_workers_and_resume_exactly(packed: Path) -> None:
    one, plain = _loader(packed, 0)
    many, workers = _loader(packed, 2)
    for epoch in (0, 1):  # persistent workers see each new epoch (shared memory)
        a, b = _pass(one, plain, epoch, 0), _pass(many, workers, epoch, 0)
        assert len(a) == len(b) == -(-per_rank(51, 2) // 4) == 7
        assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
                   for x, y in zip(a, b, strict=True))
    first = _pass(one, plain, 1, 0)
    resumed = _pass(many, workers, 1, 3 * 4)  # a checkpoint after batch 3 of epoch 1
    assert len(resumed) == len(first) - 3
    assert all(torch.equal(x[0], y[0]) for x, y in zip(first[3:], resumed, strict=True))  # bitwise
    images, labels = first[0]
    assert images.dtype == torch.uint8 and images.shape == (4, 3, 32, 32)
    assert labels.dtype == torch.int64 and set(labels.tolist()) <= {0, 1, 2}


def _ids(batch: Any) -> list[bytes]:
    """The images of a batch as bytes (the packed images differ, so they identify samples)."""
    return [image.numpy().tobytes() for image in batch[0]]


def test_under_min_nodes_each_step_reads_the_same_samples_at_any_world_size(
        packed: Path) -> None:
    """The global order (cluster.min_nodes): 51 samples, a global micro-batch of 4 x 3
    planned ranks = 12, 4 whole micro-batches an epoch; on 3, 2 or 1 ranks, with or without
    loader workers, micro-batch k holds the same samples, each rank weighs its part, and a
    position saved on 3 ranks continues exactly on 2."""
    from hpc_ddp.config.compose import compose
    from hpc_ddp.data.loaders import build_loaders

    cfgs = {workers: compose(["data=shards", f"data.root={packed}", "data.image_size=32",
                              "data.shuffle_buffer=8", f"data.num_workers={workers}"]).data
            for workers in (0, 2)}
    cfg = cfgs[0]

    def steps(world: int, workers: int, epoch: int, start: int) -> list[list[bytes]]:
        ranks = []
        for rank in range(world):
            loaders = build_loaders(cfgs[workers], 4, rank, world, 3, planned=3)
            assert loaders.global_order and loaders.samples_per_epoch() == 4 * 4
            assert len(loaders.sets.train) == 16  # 4 micro-batches in the trainer's count
            loaders.set_position(epoch, start)
            ranks.append(list(loaders.train))
        assert {len(r) for r in ranks} == {4 - start // 4}  # every rank, every step
        return [sorted(i for r in ranks for i in _ids(r[k])) for k in range(len(ranks[0]))]

    three = steps(3, 0, 1, 0)
    assert all(len(step) == 12 for step in three)
    assert steps(2, 2, 1, 0) == three == steps(1, 0, 1, 0)  # parts of 6; one rank of 12
    assert steps(2, 0, 1, 2 * 4) == three[2:]  # saved after micro-batch 2 on 3 ranks
    assert steps(3, 0, 0, 0) != three  # another epoch, another order
    uneven = [build_loaders(cfg, 4, r, 5, 3, planned=3) for r in range(5)]
    assert [len(next(iter(p.train))[1]) for p in uneven] == [3, 3, 2, 2, 2]
    assert [p.loss_weight for p in uneven] == [1.25, 1.25, 5 / 6, 5 / 6, 5 / 6]


def test_webdataset_reads_what_pack_wrote(packed: Path) -> None:
    wds = pytest.importorskip("webdataset")
    import json

    index = json.loads((packed / "index.json").read_text())
    files = [str(packed / s["file"]) for s in index["splits"]["train"]]
    theirs = [(s["jpg"], int(s["cls"])) for s in wds.WebDataset(files, shardshuffle=False)]
    from hpc_ddp.data.shards import ShardSet

    ours = ShardSet(str(packed), "train", 0, 1, 0, 32, True, False, "auto", 1)
    assert theirs == [ours.read(i) for i in range(51)]


def test_check_data_reports_on_shards(packed: Path) -> None:
    import hpc_ddp

    report = hpc_ddp.check_data(["data=shards", f"data.root={packed}", "data.image_size=32",
                                 "trainer.batch_size=4", "data.shuffle_buffer=8"],
                                world_size=4, batches=2)
    assert report.ok, report.problems
    assert report.kind == "shards" and report.dataset_size == 51 and report.padded == 1
    assert report.batches_per_rank == [4, 4, 4, 4] and report.eval_size == 15
    assert report.batch_shapes == {"images": (4, 3, 32, 32), "labels": (4,)}
    assert "batches per rank" in str(report)


def test_a_folder_without_an_index_says_how_to_pack(tmp_path: Path) -> None:
    from hpc_ddp.data.shards import ShardSet
    from hpc_ddp.errors import UserError
    from tests.conftest import compose_refusal

    with pytest.raises(UserError) as info:
        ShardSet(str(tmp_path), "train", 0, 1, 0, 32, True, True, "auto", 8)
    assert "python -m hpc_ddp.data pack" in info.value.message
    assert compose_refusal(["data=shards"]).startswith("data.root=null")


@pytest.fixture
def group() -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_trainer_resumes_mid_epoch_bitwise(packed: Path, tmp_path: Path,
                                               group: None) -> None:
    from hpc_ddp.config.compose import compose
    from hpc_ddp.rank.join.distenv import DistEnv
    from hpc_ddp.rundir import RunDir
    from hpc_ddp.trainer.loop import Trainer

    env = DistEnv(rank=0, local_rank=0, world_size=1, node_rank=0, num_nodes=1,
                  local_world_size=1, source="single", job_id="t")
    cfg = compose(["data=shards", f"data.root={packed}", "data.image_size=32",
                   "model=tiny_cnn", "trainer.batch_size=4", "trainer.max_steps=18",
                   "data.num_workers=2", "data.shuffle_buffer=16", "trainer.precision=fp32",
                   "trainer.checkpoint_interval=1000", "trainer.log_interval=5"])

    def trainer(folder: Path) -> Any:
        return Trainer(cfg, env, RunDir(folder), torch.device("cpu"))

    whole = trainer(tmp_path / "whole")
    whole.train()
    first = trainer(tmp_path / "parts")
    first.begin()
    first.train_steps(9)  # epoch 0 has 13 batches: stop in its middle
    first.save_checkpoint()
    first.close()
    second = trainer(tmp_path / "parts")
    second.resume_if_possible("resume")
    assert second.micro_in_epoch == 9 and second.loaders.seekable
    second.train()
    a, b = whole.model.module.state_dict(), second.model.module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # bitwise, across the epoch boundary
    assert whole.global_step == second.global_step == 18 and whole.epoch == second.epoch == 1


def test_the_gpu_decoder_path_crops_what_the_cpu_path_crops(packed: Path) -> None:
    """data.decoder=cuda's batch path (raw bytes and boxes from the workers, one batched
    decode in the training process), run here on the CPU device: the same boxes and flips
    as the CPU path, pixels within rounding (tests/gpu runs it on CUDA)."""
    from torch.utils.data import DataLoader

    from hpc_ddp.data.gpu_decode import GpuDecoded
    from hpc_ddp.data.shards import ShardSet

    shards = ShardSet(str(packed), "train", 0, 2, 3, 32, True, True, "pil", 8)
    cpu = list(DataLoader(shards.batches(4), batch_size=None))
    raw = GpuDecoded(DataLoader(shards.batches(4, raw=True), batch_size=None), 32, "cpu")
    decoded = list(raw)
    assert len(decoded) == len(cpu) == len(raw)
    for (a, la), (b, lb) in zip(cpu, decoded, strict=True):
        assert torch.equal(la, lb) and a.shape == b.shape and b.dtype == torch.uint8
        assert (a.float() - b.float()).abs().mean() < 3  # float vs uint8 resize: rounding
