"""Prepare a data set once, before training: fetch it, or pack it into shards.

    python -m hpc_ddp.data download cifar10 root=/shared/datasets
    python -m hpc_ddp.data pack SRC DST [samples_per_shard=1000] [seed=0] [splits=train,val]
                                        [quality=N] [--replace] [key=value ...]

download (on a machine with internet, a login node) writes cifar-10-batches-py/ under root;
train with data=cifar10 data.root=<root>.

pack writes WebDataset shards of SRC into DST (docs/data.md); train with data=shards
data.root=DST. SRC is an image folder (SRC/<split>/<class>/<image>, the files packed as they
are) or a data factory, pkg.module:function or pkg.module.function (what data._target_ names,
called with the key=value arguments; its images encoded as PNG, or JPEG with quality=N).
DST must be new or empty; --replace lets it hold an earlier pack, which the new one replaces
(the old shards the new index.json does not list are removed).
Exit codes: 0 done, 1 the download failed, 2 bad usage.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import urllib.error
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.errors import USAGE_EXIT_CODE, UserError

SUBCOMMANDS = ("download", "pack")
PACK_OPTIONS = ("samples_per_shard", "seed", "splits", "quality")
REPLACE = "--replace"  # pack: DST may hold an earlier pack, which is replaced
DATASETS = ("cifar10",)


def parse(args: Sequence[str]) -> tuple[str, str]:
    """(dataset, root) from ``download <dataset> root=<folder>``; UserError naming the part
    that is wrong."""
    roots = [a.partition("=")[2] for a in args if a.startswith("root=")]
    words = [a for a in args if not a.startswith("root=")]
    example = "e.g. python -m hpc_ddp.data download cifar10 root=/shared/datasets."
    if not words or words[0] not in SUBCOMMANDS:
        raise UserError("subcommand", words[0] if words else "",
                        "is not one of this command's." if words else "is missing.",
                        "use download or pack: python -m hpc_ddp.data download cifar10 "
                        "root=/shared/datasets (fetch a data set), or python -m hpc_ddp.data "
                        "pack SRC DST (WebDataset shards of an image folder or a factory).")
    if len(words) < 2:
        raise UserError("dataset", "", "is missing.", f"name one of {', '.join(DATASETS)}: "
                        f"{example}")
    if words[1] not in DATASETS:
        raise UserError("dataset", words[1], "cannot be downloaded by this command.",
                        f"use one of {', '.join(DATASETS)} (synthetic data needs no "
                        "download).")
    if len(words) > 2:
        raise UserError("argument", words[2], "is not understood.", example)
    if not roots or not roots[-1]:
        raise UserError("root", "", "is missing: where should the data go?",
                        f"add root=<a folder every node can read>, {example}")
    if len(roots) > 1:
        raise UserError("root", roots[-1], f"is given {len(roots)} times.", "give it once.")
    return words[1], roots[0]


def check_root(root: str) -> Path:
    """The data root as a folder this process can write (made if missing); UserError if not."""
    path = Path(root).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError("root", root, "is a file, not a folder.",
                        "choose a folder for the datasets, e.g. root=$HOME/datasets.")
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".hpc_ddp_probe_", dir=path))
    except OSError as exc:
        raise UserError("root", root, f"cannot be made or written ({exc.strerror or exc}).",
                        "choose a folder you can write, e.g. root=$HOME/datasets.") from None
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    if args and args[0] == "pack":
        return _pack(args[1:])
    try:
        _, root = parse(args)
        made = first_missing(Path(root).expanduser().absolute())
        path = check_root(root)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    code = _download(path)
    if code != 0 and made is not None:  # a failed download leaves no folder it made behind

        shutil.rmtree(made, ignore_errors=True)
    return code


def first_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` that does not exist yet (what mkdir -p would make)."""
    missing = None
    while not path.exists():
        missing, path = path, path.parent
    return missing


def parse_pack(args: Sequence[str]) -> tuple[str, str, dict[str, Any], dict[str, Any]]:
    """(SRC, DST, pack options, a factory's arguments) of ``pack SRC DST [key=value ...]``."""
    example = "e.g. python -m hpc_ddp.data pack /data/imagenet /data/imagenet-shards."
    words = [a for a in args if "=" not in a]
    flags = [w for w in words if w.startswith("-")]
    if flags:
        raise UserError("option", flags[0], "is not an option of pack.",
                        f"the only one is {REPLACE} (replace the pack DST holds).")
    if len(words) < 2:
        raise UserError("SRC DST", " ".join(words), "needs a source and a destination.",
                        example)
    if len(words) > 2:
        raise UserError("argument", words[2], "is not understood.", example)
    options: dict[str, Any] = {}
    kwargs: dict[str, Any] = {}
    for arg in (a for a in args if "=" in a):
        key, _, value = arg.partition("=")
        if key in PACK_OPTIONS:
            options[key] = _pack_option(key, value)
        else:
            kwargs[key] = _literal(value)
    src, dst = words
    if Path(dst).expanduser().resolve() == Path(src).expanduser().resolve():
        raise UserError("DST", dst, "is the source itself.", "write the shards elsewhere.")
    if not Path(src).expanduser().is_dir() and not ("." in src or ":" in src):
        raise UserError("SRC", src, "is neither a folder nor a data factory's import path "
                        "(pkg.module:function).", example)
    if Path(src).expanduser().is_dir() and kwargs:
        raise UserError("argument", next(iter(kwargs)), "is a factory's argument, but SRC "
                        "is a folder.", f"use only {', '.join(PACK_OPTIONS)} with a folder.")
    return src, dst, options, kwargs


_PACK_EXAMPLES = {"samples_per_shard": 1000, "seed": 0, "quality": 95}


def _pack_option(key: str, value: str) -> Any:
    if key == "splits":
        splits = [s for s in value.split(",") if s]
        if not splits:
            raise UserError(key, value, "names no split.", "e.g. splits=train,val.")
        return splits
    low, high = (1, 100) if key == "quality" else (1 if key == "samples_per_shard" else 0, None)
    number = int(value) if value.isdigit() else None
    if number is None or number < low or (high is not None and number > high):
        top = f" and at most {high}" if high else ""
        raise UserError(key, value, f"must be a whole number of at least {low}{top}.",
                        f"e.g. {key}={_PACK_EXAMPLES[key]}.")
    return number


def _literal(value: str) -> Any:
    import yaml  # deferred: yaml

    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def _pack(args: Sequence[str]) -> int:
    from hpc_ddp.data import pack  # deferred: concurrent, tarfile

    replace = REPLACE in args
    try:
        src, dst, options, kwargs = parse_pack([a for a in args if a != REPLACE])
        pack.check_target(dst, replace)
        Path(dst).expanduser().mkdir(parents=True, exist_ok=True)
        if Path(src).expanduser().is_dir():
            quality = options.pop("quality", None)
            if quality is not None:
                raise UserError("quality", quality, "re-encodes a factory's images; an image "
                                "folder's files are packed as they are.", "drop quality=.")
            index = pack.pack_folder(src, dst, **options)
        else:
            options.pop("splits", None)
            index = pack.pack_factory(src, kwargs, dst, **options)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except OSError as exc:
        print(f"error: packing into {dst} failed: {exc}", file=sys.stderr)
        return 1
    stale = pack.remove_stale(dst, index) if replace else []
    counts = ", ".join(f"{split} {sum(s['samples'] for s in shards)} samples in "
                       f"{len(shards)} shards" for split, shards in index["splits"].items())
    gone = f" (removed {len(stale)} file(s) of the pack it replaced)" if stale else ""
    print(f"packed {src} into {dst}: {counts}{gone}; train with data=shards data.root={dst}")
    return 0


def _download(path: Path) -> int:
    from hpc_ddp.data.cifar10 import download  # deferred (start-up): data.cifar10

    try:
        download(str(path))
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        print(f"error: could not download CIFAR-10 into {path}: {exc}. This needs internet "
              "access (run it on a login node), or copy cifar-10-batches-py/ there by hand.",
              file=sys.stderr)
        return 1
    except OSError as exc:  # the network answered; writing or unpacking failed
        print(f"error: could not write CIFAR-10 into {path}: {exc}. Check the free space "
              "and the folder, then run the command again.", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # torchvision: the archive's checksum does not match
        print(f"error: the CIFAR-10 download into {path} is corrupt ({exc}). Run the command "
              "again; delete the .tar.gz there if it keeps failing.", file=sys.stderr)
        return 1
    print(f"CIFAR-10 is in {path}; train with data=cifar10 data.root={path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
