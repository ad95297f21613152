"""Image loading throughput: hpc_ddp's loaders against the textbook one, side by side.

    python -m hpc_ddp.bench data                       # 2 workers, 64 px and 500 px JPEGs
    python -m hpc_ddp.bench data --workers 4 --images 2048 --out bench_data

For each source size, generated JPEGs (hpc_ddp/data/fake_images.py: photo-like entropy, about
ImageNet's bytes per pixel) in an image folder and packed as shards, then, interleaved over
the rounds, one epoch of random-resized 224 px training crops (+ flip) from each contender,
each with the same DataLoader workers:

- textbook: torchvision.datasets.ImageFolder + PIL transforms (RandomResizedCrop, flip,
  ToTensor, Normalize) + a default DataLoader (shuffle=True): float batches;
- folder: data=image_folder (simplejpeg where installed, crops on uint8): uint8 batches,
  normalised on the device by the trainer (a few microseconds of GPU time per batch);
- folder (pil): the same with data.decoder=pil, what the decoder alone buys;
- shards: data=shards from the packed copy.

Images/s per core counts the workers' cores (the main process only collects). The targets:
folder >= 1.5x and shards >= 2x the textbook's images/s. Then the staging of each form of the
data set to node-local disk (folder, tar, shards: files and MB/s), measured on this machine's
one disk: what staging costs, not what it saves over a shared file system (none here).
Writes data.json and data.png into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.bench.plot import save
from hpc_ddp.errors import USAGE_EXIT_CODE, UserError

TARGETS = {"folder": 1.5, "shards": 2.0}
CONTENDERS = ("textbook", "folder", "folder (pil)", "shards")


def make_data(root: Path, width: int, height: int, images: int, classes: int = 8) -> Path:
    """An image folder of ``images`` generated JPEGs and its shards, under ``root``."""
    from hpc_ddp.data import fake_images, pack  # deferred: concurrent, tarfile

    per_class = max(1, images // classes)
    fake_images.write_folder(root / "folder", classes, {"train": per_class, "val": 1},
                             (width, height))
    pack.pack_folder(str(root / "folder"), str(root / "shards"), samples_per_shard=256,
                     out=open("/dev/null", "w"))  # noqa: SIM115
    return root


def textbook_loader(root: Path, size: int, batch: int, workers: int) -> Any:
    """What the tutorials write (torchvision's ImageNet example)."""
    # deferred: torch, torchvision
    import torch
    from torchvision import datasets, transforms

    transform = transforms.Compose([
        transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize((0.485, 0.456, 0.406),
                                                    (0.229, 0.224, 0.225))])
    dataset = datasets.ImageFolder(str(root / "folder" / "train"), transform)
    return torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True,
                                       num_workers=workers, persistent_workers=workers > 0)


def our_loader(root: Path, kind: str, size: int, batch: int, workers: int,
               decoder: str = "auto") -> Any:
    # deferred: the typed schemas, torch
    from hpc_ddp.config.compose import compose
    from hpc_ddp.data.loaders import build_loaders

    data = "image_folder" if kind == "folder" else "shards"
    cfg = compose([f"data={data}", f"data.root={root / data.replace('image_', '')}",
                   f"data.image_size={size}", f"data.num_workers={workers}",
                   f"data.decoder={decoder}"])
    loaders = build_loaders(cfg.data, batch, 0, 1, 0)
    return loaders


def epoch_rate(make: Callable[[int], Any], epoch: int) -> tuple[float, int]:
    """(images/s, images) of one whole pass (persistent workers: started by round 0)."""
    loader = make(epoch)
    seen = 0
    started = time.perf_counter()
    for images, _ in loader:
        seen += len(images)
    return seen / max(time.perf_counter() - started, 1e-9), seen


def contenders(root: Path, size: int, batch: int, workers: int) -> dict[str, Callable[[int], Any]]:
    """name -> (epoch -> an iterable of batches positioned at that epoch)."""
    textbook = textbook_loader(root, size, batch, workers)
    ours = {"folder": our_loader(root, "folder", size, batch, workers),
            "folder (pil)": our_loader(root, "folder", size, batch, workers, "pil"),
            "shards": our_loader(root, "shards", size, batch, workers)}

    def positioned(loaders: Any) -> Callable[[int], Any]:
        def at(epoch: int) -> Any:
            loaders.set_position(epoch, 0)
            return loaders.train
        return at

    return {"textbook": lambda epoch: textbook,
            **{name: positioned(loaders) for name, loaders in ours.items()}}


def measure(sizes: Sequence[tuple[int, int]], images: int, crop: int, batch: int,
            workers: int, rounds: int, work: Path, decode_s: float = 2.0) -> dict[str, Any]:
    rows = []
    for width, height in sizes:
        root = make_data(work / f"{width}x{height}", width, height, images)
        print(f"  {width}x{height}: {images} JPEGs, "
              f"{_bytes(root / 'folder') / images / 1e3:.0f} KB each", file=sys.stderr,
              flush=True)
        runs = contenders(root, crop, batch, workers)
        rates: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(rounds + 1):  # round 0 warms the workers and the page cache
            order = list(runs) if r % 2 else list(reversed(runs))
            for name in order:
                rate, _ = epoch_rate(runs[name], r)
                if r:
                    rates[name].append(rate)
        base = statistics.median(rates["textbook"])
        for name in runs:
            rate = statistics.median(rates[name])
            rows.append({"source": f"{width}x{height}", "contender": name, "images_per_s": rate,
                         "per_core": rate / max(workers, 1), "ratio": rate / base,
                         "rounds": rates[name]})
    return {"rows": rows, "workers": workers, "batch": batch, "crop": crop,
            "images": images, "stage": staging_rates(work / f"{sizes[-1][0]}x{sizes[-1][1]}"),
            "decoders": decoder_rates(sizes, decode_s)}


def decoder_rates(sizes: Sequence[tuple[int, int]], seconds: float = 2.0
                  ) -> list[dict[str, Any]]:
    """Decodes per second on one core: Pillow, torchvision.io.decode_jpeg, simplejpeg (what
    data.decoder=auto chooses by)."""

    import torch  # deferred: torch; start-up: data.fake_images, data.images

    from hpc_ddp.data import fake_images, images

    def tv() -> Callable[[bytes], Any]:
        from torchvision.io import decode_jpeg  # deferred: torchvision

        def decode(data: bytes) -> Any:
            return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return decode

    decoders = {"pil": images.decoder("pil"), "torchvision": tv()}
    if images.has_simplejpeg():
        decoders["simplejpeg"] = images.decoder("simplejpeg")
    rows = []
    for width, height in sizes:
        data = [fake_images.jpeg(width, height, seed) for seed in range(8)]
        rates: dict[str, list[float]] = {name: [] for name in decoders}
        with warnings.catch_warnings():  # torchvision 0.29 warns on every call
            warnings.simplefilter("ignore")
            for _ in range(5):  # interleaved rounds, the median: a busy machine's noise
                for name, decode in decoders.items():
                    decode(data[0])
                    count, started = 0, time.perf_counter()
                    while time.perf_counter() - started < seconds / 5:
                        decode(data[count % len(data)])
                        count += 1
                    rates[name].append(count / (time.perf_counter() - started))
        rows += [{"source": f"{width}x{height}", "decoder": name,
                  "per_s": statistics.median(values)} for name, values in rates.items()]
    return rows


def staging_rates(root: Path) -> list[dict[str, Any]]:
    """Stage the folder, a tar of it and the shards to a fresh local stage_dir."""
    import tarfile  # deferred: concurrent, tarfile; start-up: rank.join.distenv

    from hpc_ddp.data import stage_node
    from hpc_ddp.rank.join.distenv import DistEnv

    with tarfile.open(root / "folder.tar", "w") as tar:
        tar.add(root / "folder", arcname="folder")
    env = DistEnv(rank=0, local_rank=0, world_size=1, node_rank=0, num_nodes=1,
                  local_world_size=1, source="single", job_id="bench")
    out = []
    for name in ("folder", "folder.tar", "shards"):
        started = time.perf_counter()
        staged = stage_node.stage(str(root / name), str(root / "stage"), env, "bench", None, {})
        seconds = time.perf_counter() - started
        out.append({"source": name, "files": staged.files, "bytes": staged.bytes,
                    "seconds": seconds, "mb_per_s": staged.bytes / seconds / 1e6,
                    "files_per_s": staged.files / seconds})
    stage_node.release()
    return out


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.jpg"))


def table(result: dict[str, Any]) -> str:
    lines = [f"{'source':<9} {'contender':<13} {'images/s':>9} {'per core':>9} {'x textbook':>10}"]
    for r in result["rows"]:
        lines.append(f"{r['source']:<9} {r['contender']:<13} {r['images_per_s']:9.0f} "
                     f"{r['per_core']:9.0f} {r['ratio']:9.2f}x")
    lines.append("")
    for r in result["rows"]:
        goal = TARGETS.get(r["contender"])
        if goal is not None:
            verdict = "met" if r["ratio"] >= goal else "NOT met"
            lines.append(f"target {r['contender']} >= {goal}x textbook at {result['crop']} px "
                         f"({r['source']}): {r['ratio']:.2f}x, {verdict}")
    lines.append("")
    lines.append("decodes/s on one core: " + "; ".join(
        f"{d['source']} {d['decoder']} {d['per_s']:.0f}" for d in result["decoders"]))
    lines.append("staging to local disk: " + "; ".join(
        f"{s['source']} {s['files']} files {s['bytes'] / 1e6:.1f} MB in {s['seconds']:.2f}s "
        f"({s['mb_per_s']:.0f} MB/s)" for s in result["stage"]))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> str:
    try:
        import matplotlib  # optional: matplotlib

        matplotlib.use("Agg")  # files only
        import matplotlib.pyplot as plt  # optional: matplotlib
    except ImportError:
        return "plot: skipped (matplotlib is not installed: pip install matplotlib)"
    sources = list(dict.fromkeys(r["source"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(sources), figsize=(5 * len(sources), 3.2), squeeze=False)
    for ax, source in zip(axes[0], sources, strict=True):
        rows = [r for r in result["rows"] if r["source"] == source]
        bars = ax.barh([r["contender"] for r in rows], [r["per_core"] for r in rows],
                       color=["#bdbdbd" if r["contender"] == "textbook" else "#3182bd"
                              for r in rows])
        for bar, r in zip(bars, rows, strict=True):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                    f"  {r['ratio']:.2f}x", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, max(r["per_core"] for r in rows) * 1.3)
        ax.set_xlabel("images/s per core")
        ax.set_title(f"{source} JPEGs -> {result['crop']} px crops, "
                     f"{result['workers']} workers", fontsize=9)
    return save(plt, fig, path)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.bench data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers, each")
    parser.add_argument("--images", type=int, default=512, help="JPEGs per source size")
    parser.add_argument("--sizes", default="64x64,500x375", help="source sizes, WxH,...")
    parser.add_argument("--crop", type=int, default=224, help="training crop side")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timed epochs per contender")
    parser.add_argument("--decode-s", type=float, default=2.0,
                        help="seconds of each decoder's one-core measurement")
    parser.add_argument("--out", default="bench_data", help="folder for data.json, data.png")
    args = parser.parse_args(argv)
    for name, low in (("workers", 0), ("images", 16), ("crop", 8), ("batch", 1),
                      ("rounds", 1)):
        if getattr(args, name) < low:
            raise UserError(f"--{name}", getattr(args, name), f"must be {low} or more.",
                            f"e.g. --{name} {max(low, 2)}.")
    try:
        args.sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
        assert all(len(s) == 2 and min(s) >= 8 for s in args.sizes)
    except (ValueError, AssertionError):
        raise UserError("--sizes", args.sizes, "is not a list of WxH sizes of 8 px or more.",
                        "e.g. --sizes 64x64,500x375.") from None
    return args


def main(argv: Sequence[str]) -> int:
    try:
        args = parse(argv)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    import torch  # deferred: torch

    torch.set_num_threads(1)  # the main process collects; the workers do the work
    print(f"data loading: {args.images} JPEGs per size, {args.workers} workers, batch "
          f"{args.batch}, {args.rounds} rounds ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="hpc_ddp_bench_data_") as tmp:
        result = measure(args.sizes, args.images, args.crop, args.batch, args.workers,
                         args.rounds, Path(tmp), args.decode_s)
    result["command"] = "python -m hpc_ddp.bench data " + " ".join(argv)
    result["time"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(table(result))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"json: {out / 'data.json'}")
    print(plot(result, out / "data.png"))
    return 0
