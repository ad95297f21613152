"""Folders of generated JPEGs in ImageNet's layout, for the tests and the data benchmark (no
download): ``root/<split>/<class>/<n>.jpg``.

An image is a smooth random colour field (a coarse grid upsampled) with pixel noise, encoded
at quality 90: about 0.5 bytes a pixel, near ImageNet's average (~110 KB at ~400x350), so a
decoder works as hard on it as on a photograph. Each class has its own mean colour, so a
network can learn the classes.
"""

from __future__ import annotations

import io
import zlib
from pathlib import Path


def jpeg(width: int, height: int, seed: int, tint: tuple[int, int, int] = (0, 0, 0),
         quality: int = 90) -> bytes:
    """One generated JPEG."""
    # deferred: PIL, numpy
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    cell = max(4, min(width, height) // 12)
    coarse = rng.random((height // cell + 2, width // cell + 2, 3)) * 180
    field = Image.fromarray(coarse.astype("uint8")).resize((width, height),
                                                           Image.Resampling.BICUBIC)
    pixels = np.asarray(field, dtype=np.float32) + rng.normal(0, 12, (height, width, 3))
    pixels += np.asarray(tint, dtype=np.float32)
    buffer = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype("uint8")).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def write_folder(root: Path, classes: int, per_class: dict[str, int], size: tuple[int, int],
                 seed: int = 0) -> Path:
    """``root/<split>/c<k>/<n>.jpg`` with ``per_class[split]`` images of each class."""
    width, height = size
    for split, count in per_class.items():
        for k in range(classes):
            folder = root / split / f"c{k:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            tint = ((k * 67) % 60, (k * 29) % 60, (k * 43) % 60)
            for n in range(count):
                (folder / f"{n:05d}.jpg").write_bytes(
                    jpeg(width, height, zlib.crc32(f"{seed}:{split}:{k}:{n}".encode()), tint))
    return root
