"""``data=shards``: WebDataset tar shards, split evenly across ranks and loader workers, shuffled
by shard and within a buffer, resumable at any batch.

What ``python -m hpc_ddp.data pack`` writes (pack.py), readable by webdataset too::

    root/index.json                  classes, and per split its shards and their sample counts
    root/<split>/<split>-000000.tar  WebDataset samples: <key>.jpg (or .png) + <key>.cls
    root/<split>/<split>-000000.idx  per sample: byte offset and size of its image, its label

The .idx (int64 little-endian, 3 per sample; like DALI's and wids' tar indexes) lets a worker
read a sample with one ``pread`` instead of walking the tar. The order of an epoch is a pure
function of (seed, epoch, rank, world size), computed from the sample counts alone
(:func:`rank_order`):

1. the shards in a random order (seed, epoch), the same on every rank;
2. their samples concatenated, and rank r taking the r-th of world_size equal contiguous
   slices, so it reads few shards, each from start to end; a total that does not divide is
   **padded**: the slices run on past the end into the epoch's first samples (at most
   world_size - 1 repeats per epoch, like DistributedSampler), so every rank gets the same
   number of samples and batches and none waits in a collective for another;
3. within a rank's slice, windows of ``data.shuffle_buffer`` samples each shuffled (seed,
   epoch, rank, window).

Batches are consecutive ``batch_size`` samples of that order; loader worker w makes batches
w, w + W, ... (DataLoader returns them in order), and a resume at batch k starts there
(``set_position``), so an interrupted run continues exactly as an uninterrupted one. Each
sample's crop is drawn from its own seed (images.py), independent of workers and resumes.
Evaluation reads its split unshuffled and unpadded, contiguous slices per rank.

Under ``cluster.min_nodes`` (the global order, data/global_order.py) step 2 is taken over
all ranks at once instead: the windows shuffle the whole concatenation (shard_index.
global_order), global micro-batch k is its slice k of ``batch_size`` x the planned ranks, and
rank r of the ranks there are now reads its contiguous part of that slice (with the .idx, any
sample is one ``pread``): a step trains on the same samples at any world size.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from hpc_ddp.data import images
from hpc_ddp.data.global_order import GlobalBatches
from hpc_ddp.data.shard_index import global_order, per_rank, rank_order, read_index, split_of

# Open shard files a worker keeps (a rank's slice runs through its shards in order).
_OPEN_SHARDS = 8


class ShardSet(IterableDataset):  # type: ignore[type-arg]
    """One rank's part of a split (an IterableDataset: it splits itself across ranks)."""

    def __init__(self, root: str, split: str, rank: int, world_size: int, seed: int,
                 image_size: int, train: bool, augment: bool, decoder: str,
                 shuffle_buffer: int) -> None:

        self.root = str(Path(root).expanduser())
        index = read_index(root)
        self.split = split_of(index, root, split)
        self.classes: list[str] = list(index.get("classes", []))
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.image_size, self.train, self.augment = image_size, train, augment
        self.decoder, self.shuffle_buffer = images.resolve_decoder(decoder), shuffle_buffer
        # [epoch, first sample]: shared memory, so persistent loader workers see set_position.
        self._position = torch.zeros(2, dtype=torch.int64).share_memory_()
        self._files: dict[int, tuple[int, Any]] = {}
        self.glob: GlobalBatches | None = None  # the global order, once use_global_order

    def use_global_order(self, batch_size: int, planned: int) -> GlobalBatches:
        """Order the train split by the global micro-batch of ``batch_size`` x ``planned``
        ranks (module docstring); what the loaders keep as the sampler (its weight, its
        epoch's length)."""
        self.glob = GlobalBatches(self.split.total, batch_size, planned, self.world_size,
                                  self.rank, self.seed, order=self.global_sequence)
        return self.glob

    def global_sequence(self, epoch: int) -> list[int]:
        return global_order(self.split.counts, self.seed, epoch, self.shuffle_buffer)

    def glob_parts(self, worker: int = 0, workers: int = 1) -> Iterator[list[int]]:
        """Under the global order: this rank's part of each micro-batch from the position on
        (``set_position``'s start counts micro-batches x batch_size), every ``workers``-th."""
        assert self.glob is not None
        epoch, start = int(self._position[0]), int(self._position[1])
        return self.glob.parts(epoch, start // self.glob.batch_size + worker, workers)

    def __len__(self) -> int:
        if self.glob is not None and self.train:
            return self.glob.num_samples
        if self.train:
            return per_rank(self.split.total, self.world_size)
        total = self.split.total
        return total * (self.rank + 1) // self.world_size - total * self.rank // self.world_size

    def set_epoch(self, epoch: int) -> None:
        self.set_position(epoch, 0)

    def set_position(self, epoch: int, start: int) -> None:
        """The next pass: epoch ``epoch`` from this rank's ``start``-th sample."""
        self._position[0], self._position[1] = epoch, start

    def order(self, epoch: int) -> Any:
        return rank_order(self.split.counts, self.rank, self.world_size, self.seed, epoch,
                          self.shuffle_buffer, self.train)

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        epoch, start = int(self._position[0]), int(self._position[1])
        if self.glob is not None:
            for samples in self.glob_parts():
                yield from (self.load(sample, epoch) for sample in samples)
            return
        for sample in self.order(epoch)[start:].tolist():
            yield self.load(sample, epoch)

    def batches(self, batch_size: int, raw: bool = False) -> ShardBatches:
        return ShardBatches(self, batch_size, raw)

    # -- reading ---------------------------------------------------------------------------
    def locate(self, sample: int) -> tuple[int, int]:
        """(shard, position in it) of a sample number."""

        if not hasattr(self, "_starts"):
            self._starts = [0]
            for count in self.split.counts:
                self._starts.append(self._starts[-1] + count)
        shard = bisect.bisect_right(self._starts, sample) - 1
        return shard, sample - self._starts[shard]

    def read(self, sample: int) -> tuple[bytes, int]:
        """(encoded image, label) of a sample: one pread."""
        shard, at = self.locate(sample)
        fd, table = self._open(shard)
        offset, size, label = (int(v) for v in table[at])
        return os.pread(fd, size, offset), label

    def load(self, sample: int, epoch: int) -> tuple[Any, int]:
        data, label = self.read(sample)
        image = images.load(data, images.decoder(self.decoder), self.image_size,
                            self.train and self.augment, self.seed, epoch, sample)
        return image, label

    def _open(self, shard: int) -> tuple[int, Any]:
        if shard not in self._files:
            import numpy as np  # deferred: numpy

            if len(self._files) >= _OPEN_SHARDS:
                oldest = next(iter(self._files))
                os.close(self._files.pop(oldest)[0])
            path = Path(self.root) / self.split.files[shard]
            table = np.fromfile(path.with_suffix(".idx"), dtype="<i8").reshape(-1, 3)
            self._files[shard] = (os.open(path, os.O_RDONLY), table)
        return self._files[shard]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_files"] = {}  # file descriptors stay with their process
        return state


class ShardBatches(IterableDataset):  # type: ignore[type-arg]
    """Whole batches of a ShardSet, split across loader workers (an IterableDataset for a
    DataLoader with batch_size=None). ``raw``: (encoded images, labels, crop boxes) for a
    decoder on the GPU (gpu_decode.py) instead of decoded crops."""

    def __init__(self, shards: ShardSet, batch_size: int, raw: bool = False) -> None:
        self.shards, self.batch_size, self.raw = shards, batch_size, raw

    def __len__(self) -> int:
        return -(-(len(self.shards) - int(self.shards._position[1])) // self.batch_size)

    def __iter__(self) -> Iterator[Any]:

        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        s = self.shards
        epoch, start = int(s._position[0]), int(s._position[1])
        if s.glob is not None:  # the global order: this rank's part of each micro-batch
            batches: Iterator[list[int]] = s.glob_parts(worker, workers)
        else:
            order = s.order(epoch)[start:]
            batches = (order[first:first + self.batch_size].tolist() for first in range(
                worker * self.batch_size, len(order), workers * self.batch_size))
        for samples in batches:
            if self.raw:
                yield self._raw(samples, epoch)
                continue
            loaded = [s.load(sample, epoch) for sample in samples]
            yield (torch.stack([image for image, _ in loaded]),
                   torch.tensor([label for _, label in loaded], dtype=torch.int64))

    def _raw(self, samples: list[int], epoch: int) -> Any:

        s = self.shards
        datas, labels, boxes = [], [], []
        for sample in samples:
            data, label = s.read(sample)
            height, width = images.image_size_of(data)
            rnd = images.sample_random(s.seed, epoch, sample) if s.train and s.augment else None
            boxes.append(images.crop_box(height, width, s.image_size, s.train and s.augment,
                                         rnd))
            datas.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            labels.append(label)
        return datas, torch.tensor(labels, dtype=torch.int64), boxes
