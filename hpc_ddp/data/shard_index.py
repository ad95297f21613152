"""The shards' index (index.json, written by pack.py) and the order of an epoch: which
samples each rank reads, computed from the sample counts alone (no file is opened), so
check_data can draw every rank's order without reading a shard. shards.py has the layout and
the rules.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.errors import UserError

INDEX = "index.json"
FORMAT = "hpc_ddp-shards/1"


@dataclass(frozen=True)
class Split:
    files: tuple[str, ...]  # relative to the root
    counts: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.counts)


def read_index(root: str) -> dict[str, Any]:
    """The shards' index.json; UserError saying how to make one."""
    path = Path(root).expanduser() / INDEX
    if not path.parent.exists():
        raise UserError("data.root", root, "does not exist.", "check the path, or pack the "
                        f"data set there once: python -m hpc_ddp.data pack SRC {root}")
    try:
        index: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError("data.root", root, f"holds no {INDEX}: it is not a folder of shards "
                        "hpc_ddp packed.", "pack the data set once: python -m hpc_ddp.data "
                        f"pack SRC {root}") from None
    except (OSError, ValueError) as exc:
        raise UserError("data.root", root, f"{INDEX} cannot be read ({exc}).",
                        "pack the data set again (python -m hpc_ddp.data pack).") from None
    if index.get("format") != FORMAT:
        raise UserError("data.root", root, f"{INDEX} is of format {index.get('format')!r}, "
                        f"not {FORMAT}.", "pack the data set again with this hpc_ddp.")
    return index


def split_of(index: dict[str, Any], root: str, name: str) -> Split:
    shards = index.get("splits", {}).get(name)
    if not shards:
        have = ", ".join(sorted(index.get("splits", {}))) or "none"
        raise UserError("data.root", root, f"has no {name} split (it has: {have}).",
                        "set data.train_split / data.eval_split to its splits, or pack that "
                        "split.")
    return Split(tuple(s["file"] for s in shards), tuple(int(s["samples"]) for s in shards))


def mix(*values: int) -> int:
    """A 63-bit seed from integers (the same everywhere; no Python hash randomisation)."""
    digest = hashlib.blake2b(":".join(map(str, values)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def per_rank(total: int, world_size: int) -> int:
    """Samples of every rank per epoch: the total padded up to a multiple of the world size."""
    return -(-total // world_size)


def rank_order(counts: tuple[int, ...], rank: int, world_size: int, seed: int, epoch: int,
               shuffle_buffer: int, train: bool = True) -> Any:
    """This rank's samples of the epoch, in order, as numbers into the packed order (shard 0's
    samples first): an int64 tensor (the module docstring says how)."""
    import torch  # deferred: torch

    starts = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    total = int(starts[-1])
    if not train:  # evaluation: contiguous, unpadded, unshuffled
        return torch.arange(total * rank // world_size, total * (rank + 1) // world_size)
    gen = torch.Generator().manual_seed(mix(seed, epoch))
    order = torch.randperm(len(counts), generator=gen)
    sizes = torch.tensor(counts, dtype=torch.int64)[order]
    ends = sizes.cumsum(0)
    n = per_rank(total, world_size)
    first, last = rank * n, (rank + 1) * n  # positions in the concatenation (may wrap)
    pieces = []
    for lap in range(first // total, (last - 1) // total + 1):
        lo, hi = max(first - lap * total, 0), min(last - lap * total, total)
        i = int(torch.searchsorted(ends, lo, right=True))
        while lo < hi:  # shards overlapping [lo, hi) of this lap
            begin = int(ends[i] - sizes[i])
            upto = min(hi, int(ends[i]))
            shard_start = int(starts[order[i]])
            pieces.append(torch.arange(shard_start + lo - begin, shard_start + upto - begin))
            lo, i = upto, i + 1
    stream = torch.cat(pieces)
    if shuffle_buffer > 1:
        for w, start in enumerate(range(0, n, shuffle_buffer)):
            window = stream[start:start + shuffle_buffer]
            perm = torch.randperm(len(window), generator=torch.Generator().manual_seed(
                mix(seed, epoch, rank, w)))
            stream[start:start + shuffle_buffer] = window[perm]
    return stream


def global_order(counts: tuple[int, ...], seed: int, epoch: int,
                 shuffle_buffer: int) -> list[int]:
    """The epoch's samples over all ranks at once, for the global order (cluster.min_nodes,
    data/global_order.py): the shards in their random order, concatenated, windows of
    ``shuffle_buffer`` shuffled; the same sequence on any world size (it is the order of a
    single rank), which each global micro-batch then takes a slice of."""
    return rank_order(counts, 0, 1, seed, epoch, shuffle_buffer).tolist()  # type: ignore[no-any-return]
