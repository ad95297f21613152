"""``python -m hpc_ddp.bench sweep`` here: removing a folder something still writes into,
the per-point split it prints, and the split a sweep writes (hpc_ddp/sweep/timing.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_ddp.bench.sweep import remove_tree, split_lines
from hpc_ddp.sweep.timing import SPLIT_ENV, Phases

# Writes files into the folder for ``seconds`` after its 50th (the test waits for those 50:
# on a loaded machine the interpreter's start alone can take seconds).
WRITER = """
import os, sys, time
point, seconds = sys.argv[1], float(sys.argv[2])
end = None
i = 0
while end is None or time.monotonic() < end:
    if i == 50 and end is None:
        end = time.monotonic() + seconds
    try:
        os.makedirs(point, exist_ok=True)
        open(os.path.join(point, f"f{i}"), "w").close()
    except (FileNotFoundError, FileExistsError):  # removed meanwhile (a parent too,
        continue  # mid-makedirs; or between its mkdir's EEXIST and its isdir check): again
    i += 1
"""


def test_a_folder_still_written_into_is_removed_once_the_writer_stops(tmp_path: Path) -> None:
    folder = tmp_path / "bench"
    point = folder / "p0"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(point), "1.5"])
    try:
        deadline = time.monotonic() + 30
        while not point.is_dir() or len(list(point.iterdir())) < 50:
            assert time.monotonic() < deadline and writer.poll() is None
            time.sleep(0.01)
        assert remove_tree(folder, attempts=40, wait_s=0.2) is None  # 8 s: a loaded machine
    finally:
        writer.wait(timeout=30)
    assert writer.returncode == 0
    assert remove_tree(folder) is None and not folder.exists()  # gone, or gone now


def test_a_folder_that_cannot_be_removed_is_named_not_raised(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "bench"
    folder.mkdir()
    calls = []

    def busy(path: Path) -> None:
        calls.append(path)
        raise OSError(39, "Directory not empty", str(path / "p0"))

    monkeypatch.setattr("hpc_ddp.bench.sweep.shutil.rmtree", busy)
    left = remove_tree(folder, attempts=3, wait_s=0.001)
    assert left is not None and str(folder) in left and "Directory not empty" in left
    assert len(calls) == 3


def test_the_split_prints_start_up_once_and_each_phase_per_point() -> None:
    split = {"seconds": {"start-up": 0.6, "composition": 3.5, "submission (pickles, sbatch)": 1.0,
                         "the rest": 0.25},
             "counts": {"sbatch calls": 100}}
    lines = list(split_lines({"arrays": split}, 1000))
    assert len(lines) == 1
    assert "start-up 0.60 s once" in lines[0] and "composition 3.50" in lines[0]
    assert "submission (pickles, sbatch) 1.00" in lines[0] and "100 sbatch calls" in lines[0]


def test_phases_write_their_split_only_when_asked(tmp_path: Path) -> None:
    phases = Phases()
    with phases.timed("composition"):
        time.sleep(0.02)
    with phases.timed("composition"):
        time.sleep(0.02)
    phases.count("sbatch calls", 3)
    phases.write({}, 10)  # not asked: nothing written
    assert not list(tmp_path.iterdir())
    target = tmp_path / "split.json"
    phases.write({SPLIT_ENV: str(target)}, 10)
    split = json.loads(target.read_text())
    seconds = split["seconds"]
    assert split["points"] == 10 and split["counts"] == {"sbatch calls": 3}
    assert seconds["composition"] >= 0.04 and seconds["start-up"] > 0
    assert abs(sum(seconds.values()) - split["total_s"]) < 1e-6
