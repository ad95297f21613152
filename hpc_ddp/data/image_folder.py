"""Images in ImageNet's folder layout: ``root/<split>/<class>/<image>`` (JPEG or PNG).

torchvision's ImageFolder finds the files and the classes (sorted folder names); images are
decoded by Pillow (torchvision.io's decoders are deprecated since torchvision 0.29) into uint8
tensors and cropped there, so a batch leaves the loader
as uint8 [N, 3, S, S] and is normalised on the device, like the other image data sets.
Training: a random resized crop and a horizontal flip (``augment``); evaluation: a resize to
S / 0.875 and a centre crop (the usual ImageNet recipe). The random draws come from torch's
RNG, which a checkpoint captures, so with ``num_workers=0`` a resumed run draws the same ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_ddp.errors import UserError

# ImageNet's channel statistics (of [0, 1] pixels).
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
EXTENSIONS = (".jpg", ".jpeg", ".png", ".JPG", ".JPEG", ".PNG")
# Evaluation resizes to image_size / this, then crops the centre (224 -> 256 -> 224).
CENTER_CROP_FRACTION = 0.875


def check_root(root: str, splits: tuple[str, ...]) -> dict[str, list[str]]:
    """The classes of each split, read from the folder names only (no file is opened);
    UserError naming what is missing. Both splits must have the same classes."""
    base = Path(root).expanduser()
    found: dict[str, list[str]] = {}
    for split in splits:
        folder = base / split
        if not folder.is_dir():
            raise UserError("data.root", root, f"holds no {split}/ folder.",
                            "point data.root at the folder with the split folders (ImageNet "
                            "layout: train/<class>/*.jpg, val/<class>/*.jpg), or set "
                            "data.train_split / data.eval_split to their names.")
        classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
        if not classes:
            raise UserError("data.root", root, f"{split}/ holds no class folders.",
                            f"put each class's images in {split}/<class name>/.")
        found[split] = classes
    first, *rest = splits
    for split in rest:
        if found[split] != found[first]:
            only = sorted(set(found[first]) ^ set(found[split]))
            raise UserError("data.root", root, f"{first}/ and {split}/ have different class "
                            f"folders ({', '.join(only[:5])}{' ...' if len(only) > 5 else ''}).",
                            "give both splits the same class folders (empty ones included).")
    return found


def decode(path: str) -> Any:
    """A file -> uint8 [3, H, W] (grey and RGBA images become RGB)."""
    from PIL import Image
    from torchvision.transforms.v2.functional import pil_to_tensor

    with Image.open(path) as image:
        return pil_to_tensor(image.convert("RGB"))


class _Crop:
    """uint8 [3, H, W] -> uint8 [3, S, S]: a random resized crop (+ flip), or resize + centre."""

    def __init__(self, size: int, train: bool) -> None:
        from torchvision.transforms import v2

        if train:
            self.transform = v2.Compose([v2.RandomResizedCrop(size, antialias=True),
                                         v2.RandomHorizontalFlip()])
        else:
            self.transform = v2.Compose([
                v2.Resize(round(size / CENTER_CROP_FRACTION), antialias=True),
                v2.CenterCrop(size)])

    def __call__(self, image: Any) -> Any:
        return self.transform(image)


def load_split(root: str, split: str, image_size: int, train: bool) -> Any:
    """torchvision's ImageFolder over ``root/split`` with our decoder and crops."""
    from torchvision.datasets import ImageFolder

    try:
        return ImageFolder(str(Path(root).expanduser() / split), loader=decode,
                           transform=_Crop(image_size, train), is_valid_file=_is_image)
    except FileNotFoundError as exc:  # a class folder without images
        raise UserError("data.root", root, f"{split}/: {exc}.",
                        "every class folder needs at least one .jpg/.jpeg/.png file.") from None


def _is_image(path: str) -> bool:
    return path.endswith(EXTENSIONS)
