"""CIFAR-10 through torchvision's real reader, on files written in the real on-disk format."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from hpc_ddp.data.cifar10 import load_split
from hpc_ddp.errors import UserError


def write_cifar10(root: Path, per_batch: int = 20) -> None:
    """cifar-10-batches-py/ as the original tarball unpacks: pickled dicts of uint8 rows."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        # The original files are Python 2 pickles whose str keys load as str with latin1.
        batch = {"batch_label": name, "labels": rng.integers(0, 10, per_batch).tolist(),
                 "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 "filenames": [f"{name}_{i}.png" for i in range(per_batch)]}
        with open(folder / name, "wb") as handle:
            pickle.dump(batch, handle, protocol=2)
    meta = {"label_names": [f"class{i}" for i in range(10)], "num_vis": 3072}
    with open(folder / "batches.meta", "wb") as handle:
        pickle.dump(meta, handle, protocol=2)


def test_reads_real_format_as_uint8_nchw(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    train = load_split(str(tmp_path), train=True, verify_checksum=False)
    test = load_split(str(tmp_path), train=False, verify_checksum=False)
    assert len(train) == 100 and len(test) == 20
    image, label = train[0]
    assert tuple(image.shape) == (3, 32, 32) and str(image.dtype) == "torch.uint8"
    assert 0 <= int(label) < 10
    # Row layout of the format: 1024 red, then green, then blue values.
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_1", "rb") as handle:
        raw = pickle.load(handle, encoding="latin1")["data"][0]
    assert image[1].flatten().tolist() == raw[1024:2048].tolist()


def test_checksums_catch_altered_files(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    with pytest.raises(UserError, match="verify_checksum"):
        load_split(str(tmp_path), train=True, verify_checksum=True)


def test_missing_root_says_how_to_fetch(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="python -m hpc_ddp.data download cifar10"):
        load_split(str(tmp_path / "nope"), train=True)
