"""The fast image path (hpc_ddp/data/images.py), `python -m hpc_ddp.data pack` and the new
data keys: decoders that agree, crops that stay in the image and repeat from their seed, one
line for each bad input, loader workers for files to decode."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from hpc_ddp.config.compose import compose
from hpc_ddp.data import fake_images, images
from hpc_ddp.data.__main__ import main
from hpc_ddp.data.loaders import loader_settings
from tests.conftest import compose_refusal


@pytest.mark.parametrize("size", [(64, 64), (500, 375)])
def test_the_fast_decoder_gives_pillows_pixels(size: tuple[int, int]) -> None:
    pytest.importorskip("simplejpeg")
    data = fake_images.jpeg(*size, seed=1)
    fast, pil = images.decoder("simplejpeg")(data), images.decoder("pil")(data)
    assert fast.shape == pil.shape == (3, size[1], size[0]) and fast.dtype == torch.uint8
    # Both are libjpeg-turbo with its default (accurate) IDCT: equal, or off by rounding.
    assert (fast.int() - pil.int()).abs().max() <= 2


def test_png_goes_to_pillow_whatever_the_decoder() -> None:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (9, 7), (10, 20, 30)).save(buffer, "PNG")
    image = images.decoder("auto")(buffer.getvalue())
    assert image.shape == (3, 7, 9) and image[:, 0, 0].tolist() == [10, 20, 30]


def test_crops_stay_inside_and_repeat_from_their_seed() -> None:
    for n in range(200):
        height, width = 20 + n % 37, 15 + (n * 7) % 53
        top, left, h, w, _ = images.crop_box(height, width, 8, True,
                                             images.sample_random(0, 1, n))
        assert 0 <= top and top + h <= height and 0 <= left and left + w <= width and h and w
    a = images.load(fake_images.jpeg(80, 60, 2), images.decoder("pil"), 32, True, 5, 3, 11)
    b = images.load(fake_images.jpeg(80, 60, 2), images.decoder("pil"), 32, True, 5, 3, 11)
    c = images.load(fake_images.jpeg(80, 60, 2), images.decoder("pil"), 32, True, 5, 4, 11)
    assert torch.equal(a, b) and not torch.equal(a, c)  # the epoch changes the crop
    assert a.shape == (3, 32, 32) and a.dtype == torch.uint8 and a.is_contiguous()


def test_evaluation_takes_the_centre_square() -> None:
    assert images.crop_box(375, 500, 224, False, None) == (23, 86, 328, 328, False)
    assert images.crop_box(300, 300, 224, True, None)[4] is False


def test_a_random_stream_is_the_same_in_every_process() -> None:
    assert images.sample_random(1, 2, 3).random() == images.sample_random(1, 2, 3).random()
    assert isinstance(images.sample_random(0, 0, 0), random.Random)


def test_files_to_decode_get_the_tasks_cores_as_workers_on_cuda() -> None:
    cfg = compose(["data=image_folder", "data.root=/x"]).data
    assert loader_settings(cfg, "cuda", 8, decodes=True).num_workers == 7
    assert loader_settings(cfg, "cuda", 64, decodes=True).num_workers == 16
    assert loader_settings(cfg, "cuda", 1, decodes=True).num_workers == 1
    assert loader_settings(cfg, "cuda", 8).num_workers == 4  # tensors in memory: 4 suffice
    assert loader_settings(cfg, "cpu", 8, decodes=True).num_workers == 0


@pytest.mark.parametrize("overrides, key, words", [
    (["data.decoder=turbo"], "data.decoder=turbo", "auto, pil, simplejpeg, cuda"),
    (["data=image_folder", "data.root=/x", "data.decoder=cuda"], "data.decoder=cuda",
     "data=shards"),
    (["data.stage=true"], "data.stage=true", "nothing to copy"),
    (["data._target_=tests.usercode.parts:classes_data", "data.stage=true"], "data.root=null",
     "your factory takes root="),
    (["data=shards", "data.root=/x", "data.shuffle_buffer=0"], "data.shuffle_buffer=0", ">= 1"),
    (["data=image_folder", "data.root=/x", "data.stage_dir= "], "data.stage_dir=", "empty"),
])
def test_bad_data_keys_are_named(overrides: list[str], key: str, words: str) -> None:
    message = compose_refusal(overrides)
    assert message.startswith(key) and words in message, message


def test_stage_keys_stay_ours_under_a_target() -> None:
    cfg = compose(["data._target_=tests.usercode.parts:classes_data", "data.stage=true",
                   "+data.root=/shared/x"])
    assert cfg.data.stage and cfg.data.kwargs == {"root": "/shared/x"}


@pytest.mark.parametrize("args, said", [
    (["pack"], "SRC DST="),
    (["pack", "/a"], "SRC DST=/a"),
    (["pack", "/a", "/b", "/c"], "argument=/c"),
    (["pack", "nowhere", "/b"], "SRC=nowhere"),
    (["pack", "/tmp", "/tmp"], "DST=/tmp"),
    (["pack", "/tmp", "/b", "samples_per_shard=0"], "samples_per_shard=0"),
    (["pack", "/tmp", "/b", "quality=101"], "quality=101"),
    (["pack", "/tmp", "/b", "width=3"], "argument=width"),
])
def test_pack_names_the_wrong_part(args: list[str], said: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert said in err and "Fix:" in err and len(err.strip().splitlines()) == 1, err


def test_pack_a_factory_with_its_arguments(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "shards"
    assert main(["pack", "tests.usercode.parts:image_data", str(dst), "samples_per_shard=5",
                 "size=12"]) == 0
    assert "data=shards data.root=" in capsys.readouterr().out
    from hpc_ddp.data.shards import ShardSet

    train = ShardSet(str(dst), "train", 0, 1, 0, 8, True, False, "pil", 1)
    assert len(train) == 12 and train.classes == ["a", "b", "c"]
    data, label = train.read(0)
    assert data[:4] == b"\x89PNG" and label in (0, 1, 2)  # lossless by default
    image, _ = train.load(0, 0)
    assert image.shape == (3, 8, 8)


def test_pack_into_a_pack_is_refused_unless_replaced_and_then_leaves_no_stale_shard(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "shards"
    factory = ["pack", "tests.usercode.parts:image_data", str(dst), "size=12"]
    assert main([*factory, "samples_per_shard=2"]) == 0  # 6 train shards
    before = {p: p.stat().st_mtime_ns for p in dst.rglob("*")}
    assert main([*factory, "samples_per_shard=5"]) == 2  # without --replace: nothing touched
    err = capsys.readouterr().err
    assert f"DST={dst}: holds a pack already" in err and "--replace" in err, err
    assert {p: p.stat().st_mtime_ns for p in dst.rglob("*")} == before
    assert main([*factory, "samples_per_shard=5", "--replace"]) == 0  # 3 train shards
    # train: 6 shards -> 3, val: 2 -> 1; each a .tar and its .idx
    assert "removed 8 file(s) of the pack it replaced" in capsys.readouterr().out
    index = json.loads((dst / "index.json").read_text())
    listed = {s["file"] for shards in index["splits"].values() for s in shards}
    on_disk = {str(p.relative_to(dst)) for p in dst.rglob("*.tar")}
    assert on_disk == listed and len(index["splits"]["train"]) == 3
    assert {str(p.relative_to(dst)) for p in dst.rglob("*.idx")} == {
        n.replace(".tar", ".idx") for n in listed}


def test_pack_never_empties_a_folder_that_holds_no_pack(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    for extra in ([], ["--replace"]):
        assert main(["pack", "tests.usercode.parts:image_data", str(mine), *extra]) == 2
        assert "holds files but no pack" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    assert main(["pack", "tests.usercode.parts:image_data", str(mine), "--force"]) == 2
    assert "option=--force: is not an option of pack" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["image_folder", "cifar10", "shards"])
def test_a_data_root_that_does_not_exist_is_said_so(kind: str, tmp_path: Path) -> None:
    """Not "holds no train/ folder": the folder is not there at all, whatever the kind."""
    from hpc_ddp.data import cifar10, image_folder, shard_index
    from hpc_ddp.errors import UserError

    check = {"image_folder": lambda r: image_folder.check_root(r, ("train", "val")),
             "cifar10": cifar10.check_root, "shards": shard_index.read_index}[kind]
    missing = str(tmp_path / "no" / "such" / "dir")
    with pytest.raises(UserError) as info:
        check(missing)
    assert info.value.message.startswith(f"data.root={missing}: does not exist. Fix: ")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError) as info:  # a folder that exists but is not the data: as before
        check(str(tmp_path / "empty"))
    assert "does not exist" not in info.value.message
