"""Pack a data set into WebDataset shards for ``data=shards`` (the layout: shards.py).

    python -m hpc_ddp.data pack /data/imagenet /data/imagenet-shards
    python -m hpc_ddp.data pack my_pkg.data:make /data/mine-shards size=64   # a factory

An image folder's files go in as they are (their bytes, not re-encoded); a factory's samples
(what ``data._target_`` returns: (train, eval), each giving (image, label)) are encoded:
uint8 tensors and arrays ([3, H, W] or [H, W, 3]) and PIL images as PNG (lossless), unless
``quality=N`` asks for JPEG. Samples are written in a seeded random order, so every shard
holds every class; each shard is written to a temporary name and renamed when complete, and
index.json last: an interrupted pack leaves no index, and data=shards refuses the folder.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import sys
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp.data.shard_index import FORMAT, INDEX
from hpc_ddp.errors import UserError
from hpc_ddp.rundir import write_text

SAMPLES_PER_SHARD = 1000
PROGRESS_EVERY_S = 5.0
# Files read at once from an image folder (a shared file system answers in parallel).
READ_THREADS = 8
_EXT = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png"}


def pack_folder(src: str, dst: str, splits: Sequence[str] = ("train", "val"),
                samples_per_shard: int = SAMPLES_PER_SHARD, seed: int = 0,
                out: TextIO | None = None) -> dict[str, Any]:
    """An image folder (``src/<split>/<class>/<file>``) -> shards in ``dst``; the index."""
    from hpc_ddp.data.image_folder import check_root  # deferred (start-up): data.image_folder

    classes = check_root(src, tuple(splits))[splits[0]]
    # deferred: torchvision; start-up: data.image_folder
    from torchvision.datasets import ImageFolder

    from hpc_ddp.data.image_folder import is_image

    written: dict[str, list[dict[str, Any]]] = {}
    for split in splits:
        found = ImageFolder(str(Path(src).expanduser() / split), is_valid_file=is_image)
        files = _shuffled(found.samples, seed)

        def samples(items: list[tuple[str, int]] = files) -> Iterator[tuple[bytes, str, int]]:
            def read(item: tuple[str, int]) -> tuple[bytes, str, int]:
                with open(item[0], "rb") as handle:
                    return handle.read(), _EXT.get(Path(item[0]).suffix.lower(), "jpg"), item[1]

            with ThreadPoolExecutor(READ_THREADS) as pool:
                yield from pool.map(read, items)

        written[split] = write_split(dst, split, samples(), len(files), samples_per_shard, out)
    return _write_index(dst, classes, written, str(src))


def pack_factory(target: str, kwargs: dict[str, Any], dst: str,
                 samples_per_shard: int = SAMPLES_PER_SHARD, seed: int = 0,
                 quality: int | None = None, out: TextIO | None = None) -> dict[str, Any]:
    """A data factory's (train, eval) sets (the data._target_ contract) -> shards."""
    # deferred: the typed schemas; start-up: targets
    from hpc_ddp.data.sets import num_classes_of
    from hpc_ddp.targets import build

    target = target.replace(":", ".")  # Hydra's instantiate takes the dotted form
    made = build("data", target, kwargs, auto={"rank": 0, "world_size": 1, "seed": seed})
    pairs = _train_and_eval(made, target)
    count = num_classes_of(made) or num_classes_of(pairs[0][1])
    classes = getattr(made, "classes", None) or getattr(pairs[0][1], "classes", None) or (
        [str(i) for i in range(count)] if count else [])
    written = {}
    for split, dataset in pairs:
        order = _shuffled(list(range(len(dataset))), seed)

        def samples(ds: Any = dataset, idx: list[int] = order
                    ) -> Iterator[tuple[bytes, str, int]]:
            for i in idx:
                yield encode_sample(ds[i], quality, target)

        written[split] = write_split(dst, split, samples(), len(order), samples_per_shard, out)
    return _write_index(dst, list(map(str, classes)), written, target)


def _train_and_eval(made: Any, target: str) -> list[tuple[str, Any]]:
    if isinstance(made, dict):
        train, evaluation = made.get("train"), made.get("eval")
    elif isinstance(made, tuple | list) and len(made) == 2:
        train, evaluation = made
    else:
        train, evaluation = getattr(made, "train", None), getattr(made, "eval", None)
    if train is None or not hasattr(train, "__getitem__"):
        raise UserError("SRC", target, "did not return map-style train (and eval) data sets.",
                        "return (train, eval) of Datasets with __len__ and __getitem__.")
    return [(name, ds) for name, ds in (("train", train), ("val", evaluation))
            if ds is not None]


def encode_sample(sample: Any, quality: int | None, target: str) -> tuple[bytes, str, int]:
    """(image, label) -> (encoded bytes, extension, label)."""
    # deferred: PIL, numpy
    import numpy as np
    from PIL import Image

    if not (isinstance(sample, tuple | list) and len(sample) == 2):
        raise UserError("SRC", target, f"gave a {type(sample).__name__} sample, not "
                        "(image, label).", "return (image, label) pairs from __getitem__.")
    image, label = sample
    if isinstance(image, bytes | bytearray):
        return bytes(image), "jpg" if image[:2] == b"\xff\xd8" else "png", int(label)
    if not isinstance(image, Image.Image):
        array = np.asarray(image.numpy() if hasattr(image, "numpy") else image)
        if array.ndim == 3 and array.shape[0] in (1, 3) and array.shape[-1] not in (1, 3):
            array = array.transpose(1, 2, 0)  # CHW -> HWC
        if array.dtype != np.uint8:
            raise UserError("SRC", target, f"gave {array.dtype} images; shards hold uint8 "
                            "images.", "return uint8 images (or PIL images, or encoded bytes).")
        image = Image.fromarray(array.squeeze(-1) if array.shape[-1] == 1 else array)
    buffer = io.BytesIO()
    if quality is None:
        image.save(buffer, "PNG")
        return buffer.getvalue(), "png", int(label)
    image.convert("RGB").save(buffer, "JPEG", quality=quality)
    return buffer.getvalue(), "jpg", int(label)


# A shard's files as _ShardWriter names them: <split>-<6 digits>.tar/.idx, and their
# temporary names while written.
_SHARD_FILE = re.compile(r"^\.?[^/]+-\d{6}\.(tar|idx)(\.tmp)?$")


def check_target(dst: str, replace: bool) -> None:
    """DST must be new or empty; ``replace`` (``--replace``) lets it hold an earlier pack,
    whose index.json goes when the first shard is written (write_split: an interrupted
    replacement leaves no index, so data=shards refuses the folder). A folder that holds
    files but no pack is never emptied. Nothing is changed here."""
    folder = Path(dst).expanduser()
    if folder.exists() and not folder.is_dir():
        raise UserError("DST", dst, "is a file.", "choose a folder for the shards.")
    entries = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if not entries:
        return
    shown = ", ".join(entries[:3]) + (" ..." if len(entries) > 3 else "")
    if not (folder / INDEX).is_file():
        raise UserError("DST", dst, f"holds files but no pack ({shown}; no {INDEX}).",
                        "choose a new or empty folder (--replace replaces an earlier pack "
                        "only).")
    if not replace:
        raise UserError("DST", dst, f"holds a pack already ({shown}); packing there would "
                        "mix its shards with the new ones.", "choose a new or empty folder, "
                        "or add --replace to replace that pack.")


def remove_stale(dst: str, index: dict[str, Any]) -> list[str]:
    """Shard files under DST's split folders that ``index`` does not list (an earlier pack's,
    replaced): removed, with split folders left empty; their names, DST-relative."""
    folder = Path(dst).expanduser()
    listed = {s["file"] for shards in index["splits"].values() for s in shards}
    listed |= {str(Path(name).with_suffix(".idx")) for name in listed}
    removed = []
    for sub in (p for p in folder.iterdir() if p.is_dir()):
        for path in sorted(sub.iterdir()):
            name = f"{sub.name}/{path.name}"
            if path.is_file() and _SHARD_FILE.match(path.name) and name not in listed:
                path.unlink()
                removed.append(name)
        if not any(sub.iterdir()):
            sub.rmdir()
    return removed


def _shuffled(items: list[Any], seed: int) -> list[Any]:
    items = list(items)
    random.Random(seed).shuffle(items)
    return items


def write_split(dst: str, split: str, samples: Iterable[tuple[bytes, str, int]], total: int,
                samples_per_shard: int, out: TextIO | None) -> list[dict[str, Any]]:
    """Write a split's shards; [{"file", "samples", "bytes"}] of each."""
    # The index of a pack this one replaces (check_target let it stay) goes before any shard.
    (Path(dst).expanduser() / INDEX).unlink(missing_ok=True)
    folder = Path(dst).expanduser() / split
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, Any]] = []
    writer: _ShardWriter | None = None
    progress = _Progress(split, total, out)
    for n, (data, ext, label) in enumerate(samples):
        if writer is None or writer.count == samples_per_shard:
            if writer is not None:
                shards.append(writer.close())
            writer = _ShardWriter(folder, split, len(shards))
        writer.add(f"{n:09d}", data, ext, label)
        progress.update(n + 1)
    if writer is not None:
        shards.append(writer.close())
    progress.done(len(shards))
    return shards


class _ShardWriter:
    """One .tar (WebDataset: <key>.<ext> then <key>.cls) and its .idx, under temporary names."""

    def __init__(self, folder: Path, split: str, number: int) -> None:
        self.path = folder / f"{split}-{number:06d}.tar"
        self.tmp = self.path.with_name(f".{self.path.name}.tmp")
        self.tar = tarfile.open(self.tmp, "w", format=tarfile.USTAR_FORMAT)
        self.rows: list[tuple[int, int, int]] = []
        self.count = 0
        self.folder, self.split = folder, split

    def _member(self, name: str, data: bytes) -> int:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o444, 0  # the same bytes every time
        self.tar.addfile(info, io.BytesIO(data))
        blocks = -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
        return self.tar.offset - blocks  # where the member's data starts

    def add(self, key: str, data: bytes, ext: str, label: int) -> None:
        offset = self._member(f"{key}.{ext}", data)
        self._member(f"{key}.cls", str(label).encode())
        self.rows.append((offset, len(data), label))
        self.count += 1

    def close(self) -> dict[str, Any]:
        import numpy as np  # deferred: numpy

        self.tar.close()
        idx = self.path.with_suffix(".idx")
        np.asarray(self.rows, dtype="<i8").reshape(-1, 3).tofile(idx.with_name(f".{idx.name}"))
        os.replace(idx.with_name(f".{idx.name}"), idx)
        os.replace(self.tmp, self.path)
        return {"file": f"{self.split}/{self.path.name}", "samples": self.count,
                "bytes": self.path.stat().st_size}


def _write_index(dst: str, classes: list[str], splits: dict[str, list[dict[str, Any]]],
                 source: str) -> dict[str, Any]:
    index = {"format": FORMAT, "classes": classes, "splits": splits, "source": source,
             "packed_at": time.time()}
    write_text(Path(dst).expanduser() / INDEX, json.dumps(index, indent=1) + "\n",
               durable=True)
    return index


class _Progress:
    def __init__(self, split: str, total: int, out: TextIO | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.split, self.total, self.out, self.clock = split, total, out or sys.stderr, clock
        self.started = self.last = clock()
        self.count = 0

    def update(self, count: int) -> None:
        self.count = count
        now = self.clock()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            rate = count / max(now - self.started, 1e-9)
            print(f"pack {self.split}: {count}/{self.total} samples "
                  f"({100 * count / max(self.total, 1):.0f}%), {rate:.0f} samples/s",
                  file=self.out, flush=True)

    def done(self, shards: int) -> None:
        elapsed = self.clock() - self.started
        print(f"pack {self.split}: {self.count} samples in {shards} shards, {elapsed:.1f}s",
              file=self.out, flush=True)
