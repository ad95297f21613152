"""Encoded image -> uint8 [3, S, S] crop, fast: the decoder measured fastest, crops on uint8.

Decoders (``data.decoder``; docs/performance.md has the measurements): ``simplejpeg``
(libjpeg-turbo, 1.3x Pillow on 500 px JPEGs and 3.9x on 64 px ones, where Pillow's per-call
overhead dominates) where it is installed, else Pillow; PNG and other formats always go to
Pillow. torchvision.io's decode_jpeg is not offered: deprecated since torchvision 0.29 (for
TorchCodec), with a warning on every call, and slower than simplejpeg on one core.

The crop is the ImageNet recipe on uint8 tensors (never float): training takes a random
resized crop (scale 0.08-1, ratio 3/4-4/3, torchvision's algorithm) and a flip; evaluation
the centre square of side 0.875 x the shorter side (= resize to S/0.875, crop S). The random
draws come from the sample's own seed (run seed, epoch, sample number): any number of loader
workers, and a run resumed mid-epoch, draws the same crops as an uninterrupted one.
"""

from __future__ import annotations

import functools
import hashlib
import io
import math
import random
from collections.abc import Callable
from typing import Any

# ImageNet's channel statistics (of [0, 1] pixels).
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
# Evaluation resizes to image_size / this, then crops the centre (224 -> 256 -> 224).
CENTER_CROP_FRACTION = 0.875
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
_JPEG_MAGIC = b"\xff\xd8"


def has_simplejpeg() -> bool:
    try:
        # optional: simplejpeg
        import simplejpeg  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_decoder(name: str) -> str:
    """The decoder ``data.decoder`` means here: auto -> simplejpeg if installed, else pil."""
    if name == "auto":
        return "simplejpeg" if has_simplejpeg() else "pil"
    if name == "simplejpeg" and not has_simplejpeg():
        from hpc_ddp.errors import UserError  # deferred (start-up): errors

        raise UserError("data.decoder", name, "is not installed in this environment.",
                        "pip install simplejpeg (it is in hpc_ddp's dependencies), or "
                        "data.decoder=auto.")
    return name


@functools.cache
def decoder(name: str) -> Callable[[bytes], Any]:
    """bytes -> uint8 [3, H, W] tensor (RGB; a view of the decoder's HWC array)."""
    import torch  # deferred: torch

    def pil(data: bytes) -> Any:
        # deferred: PIL, numpy
        import numpy as np
        from PIL import Image

        with Image.open(io.BytesIO(data)) as image:
            array = np.array(image.convert("RGB"))  # writable (asarray: a read-only view)
        return torch.from_numpy(array).permute(2, 0, 1)

    if resolve_decoder(name) != "simplejpeg":
        return pil
    import simplejpeg  # deferred: simplejpeg

    def fast(data: bytes) -> Any:
        if data[:2] != _JPEG_MAGIC:
            return pil(data)
        return torch.from_numpy(simplejpeg.decode_jpeg(data, colorspace="RGB")).permute(2, 0, 1)

    return fast


def image_size_of(data: bytes) -> tuple[int, int]:
    """(height, width) from the header alone (for crops decided before decoding)."""
    if data[:2] == _JPEG_MAGIC and has_simplejpeg():
        import simplejpeg  # deferred: simplejpeg

        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        return int(height), int(width)
    from PIL import Image  # deferred: PIL

    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
    return height, width


def sample_random(seed: int, epoch: int, sample: int) -> random.Random:
    """The random draws of one sample in one epoch (the same in every process)."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{sample}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def crop_box(height: int, width: int, size: int, train: bool, rnd: random.Random | None
             ) -> tuple[int, int, int, int, bool]:
    """(top, left, crop height, crop width, flip) of one sample."""
    if not train or rnd is None:
        side = max(1, min(round(min(height, width) * CENTER_CROP_FRACTION), height, width))
        return (height - side) // 2, (width - side) // 2, side, side, False
    area = height * width
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):  # torchvision's RandomResizedCrop.get_params, with our own draws
        target = area * rnd.uniform(*SCALE)
        aspect = math.exp(rnd.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top, left = rnd.randint(0, height - h), rnd.randint(0, width - w)
            return top, left, h, w, rnd.random() < 0.5
    ratio = width / height  # fallback: the whole image, clamped to the ratio range
    if ratio < RATIO[0]:
        w, h = width, round(width / RATIO[0])
    elif ratio > RATIO[1]:
        h, w = height, round(height * RATIO[1])
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w, rnd.random() < 0.5


def crop(image: Any, size: int, box: tuple[int, int, int, int, bool]) -> Any:
    """uint8 [3, H, W] -> uint8 [3, size, size]: the box, resized (bilinear, antialiased, on
    uint8: torch's vectorised uint8 kernel), flipped if the box says so."""
    # deferred: torch
    import torch
    import torch.nn.functional as F

    top, left, h, w, flip = box
    region = image[:, top:top + h, left:left + w].unsqueeze(0)
    if (h, w) != (size, size):
        # The crop copied to a dense channels-last block first: torch's uint8 kernel then
        # runs 1.6x faster than on the strided view (0.23 vs 0.37 ms for 350x300 -> 224).
        region = F.interpolate(region.contiguous(memory_format=torch.channels_last),
                               size=(size, size), mode="bilinear", antialias=True,
                               align_corners=False)
    out = region[0]
    return (out.flip(-1) if flip else out).contiguous()


def load(data: bytes, decode: Callable[[bytes], Any], size: int, train: bool, seed: int,
         epoch: int, sample: int) -> Any:
    """One sample's crop: decode, then the crop its own seed draws."""
    image = decode(data)
    rnd = sample_random(seed, epoch, sample) if train else None
    return crop(image, size, crop_box(int(image.shape[1]), int(image.shape[2]), size, train,
                                      rnd))
