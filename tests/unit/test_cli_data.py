"""``python -m hpc_ddp.data`` and ``hpc_ddp.check_data``: say which part of the input is wrong."""

from __future__ import annotations

import urllib.error
from pathlib import Path

import pytest

import hpc_ddp
from hpc_ddp.data import cifar10, loaders
from hpc_ddp.data.__main__ import main
from hpc_ddp.errors import UserError


@pytest.fixture(autouse=True)
def no_download(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(root: str) -> Path:
        raise AssertionError("nothing may be downloaded in the unit tests")

    monkeypatch.setattr(cifar10, "download", refuse)


def test_help_prints_the_usage_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "download cifar10 root=" in capsys.readouterr().out


@pytest.mark.parametrize("args, said", [
    ([], "subcommand=: is missing"),
    (["fetch", "cifar10", "root=/tmp"], "subcommand=fetch"),
    (["download"], "dataset=: is missing"),
    (["download", "mnist", "root=/tmp"], "dataset=mnist"),
    (["download", "cifar10"], "root=: is missing"),
    (["download", "cifar10", "root="], "root=: is missing"),
    (["download", "cifar10", "extra", "root=/tmp"], "argument=extra"),
])
def test_each_wrong_part_is_named(args: list[str], said: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert said in err and "Fix:" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args", [[], ["fetch"]])
def test_a_missing_or_wrong_subcommand_names_both(args: list[str],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "python -m hpc_ddp.data download cifar10 root=" in err, err
    assert "python -m hpc_ddp.data pack SRC DST" in err, err


def test_a_root_that_is_a_file_is_a_path_problem(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["download", "cifar10", f"root={afile}"]) == 2
    err = capsys.readouterr().err
    assert "is a file" in err and "internet" not in err
    assert main(["download", "cifar10", f"root={afile}/sub"]) == 2
    assert "cannot be made or written" in capsys.readouterr().err


def test_no_internet_is_said_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    def offline(root: str) -> Path:
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(cifar10, "download", offline)
    assert main(["download", "cifar10", f"root={tmp_path}"]) == 1
    assert "needs internet access" in capsys.readouterr().err


def test_a_failed_download_leaves_no_folder_it_made(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def half_then_offline(root: str) -> Path:
        (Path(root) / "cifar-10-python.tar.gz.part").write_bytes(b"x")
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(cifar10, "download", half_then_offline)
    assert main(["download", "cifar10", f"root={tmp_path / 'new' / 'data'}"]) == 1
    assert not (tmp_path / "new").exists()  # nothing left of what the command made
    kept = tmp_path / "mine"
    kept.mkdir()
    assert main(["download", "cifar10", f"root={kept}"]) == 1
    assert kept.is_dir()  # a folder that was there stays


def test_a_full_disk_is_not_blamed_on_the_internet(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    def full(root: str) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cifar10, "download", full)
    assert main(["download", "cifar10", f"root={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert "could not write" in err and "internet" not in err


# -- check_data -----------------------------------------------------------------------------
SMALL = ["data.train_size=96", "data.eval_size=32", "trainer.batch_size=8"]


@pytest.mark.parametrize("kwargs, key", [({"world_size": 0}, "world_size=0"),
                                         ({"world_size": -1}, "world_size=-1"),
                                         ({"batches": 0}, "batches=0"),
                                         ({"epoch": -1}, "epoch=-1")])
def test_check_data_refuses_bad_counts(kwargs: dict[str, int], key: str) -> None:
    with pytest.raises(UserError, match=key):
        hpc_ddp.check_data(SMALL, **kwargs)


def test_check_data_builds_the_data_set_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = loaders.build_loaders

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(args)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(loaders, "build_loaders", counted)
    report = hpc_ddp.check_data(SMALL, world_size=64, batches=2)
    assert len(calls) == 1 and report.ok and len(report.indices) == 64


def test_check_data_shards_are_the_trainers(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = hpc_ddp.compose(SMALL)
    t = cfg.trainer
    expected = {}
    for rank in range(3):
        built = loaders.build_loaders(cfg.data, t.batch_size, rank, 3, t.seed)
        built.sampler.set_position(1, 0)
        expected[rank] = list(built.sampler)
    assert hpc_ddp.check_data(cfg, world_size=3, epoch=1, batches=1).indices == expected


def test_check_data_shows_progress_when_slow(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from hpc_ddp import datacheck

    monkeypatch.setattr(datacheck._Progress, "EVERY_S", 0.0)
    hpc_ddp.check_data(SMALL, world_size=4, batches=1)
    assert "check_data: shards of 1 of 4 ranks drawn" in capsys.readouterr().err


def test_check_data_of_a_run_that_may_shrink_shows_the_global_order() -> None:
    """cluster.min_nodes: each rank's part of the global micro-batches, the trainer's own
    batch sampler's, at the world size asked (the planned 4 ranks' batch on 3)."""
    cfg = hpc_ddp.compose([*SMALL, "cluster=slurm", "nodes=4", "cluster.min_nodes=3"])
    t = cfg.trainer
    expected = {}
    for rank in range(3):
        built = loaders.build_loaders(cfg.data, t.batch_size, rank, 3, t.seed, planned=4)
        built.sampler.set_position(1, 0)
        expected[rank] = [i for batch in built.sampler for i in batch]
    report = hpc_ddp.check_data(cfg, world_size=3, epoch=1, batches=1)
    assert report.indices == expected and report.ok, report
    assert [len(part) for part in report.indices.values()] == [33, 33, 30]  # 3 x (11, 11, 10)
    assert ("micro-batch of 32 (8 x 4 planned ranks), parts of 10 or 11 on 3; 3 an epoch, "
            "0 samples left out") in str(report)
    plain = hpc_ddp.check_data(SMALL, world_size=3, batches=1)
    assert "global order" not in str(plain) and len(plain.indices[0]) == 32
    with pytest.raises(UserError, match="world_size=40.*cannot feed 40 ranks"):
        hpc_ddp.check_data(cfg, world_size=40, batches=1)
