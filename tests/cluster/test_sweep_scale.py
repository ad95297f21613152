"""A sweep's submission costs the same per point at 50 and at 500 points (issue 18), counted
on the real cluster: Hydra composes, files opened for writing and sbatch calls, seen through
Python's audit events (every open() and every subprocess, whoever makes them: our code,
submitit, Hydra). Following a 1,000-point sweep costs at most two Slurm calls a refresh, and
one job one call (issue 15). Every job is held, then cancelled; the bench's cleanup is tested
against a job still writing into the folder it removes."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.bench.sweep import HOLD, cancel, clean_up
from hpc_ddp.sweep.arrays import max_array_size
from hpc_ddp.sweep.launch import launch

pytestmark = pytest.mark.cluster

_COUNTS: Counter[str] = Counter()
_ON: list[bool] = []
_HOOKED: list[bool] = []
# The Slurm clients whose calls are counted (each one RPC to slurmctld or slurmdbd).
_CLIENTS = ("sbatch", "squeue", "sacct", "sinfo", "scontrol", "scancel", "srun")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _ON:
        return
    if event == "open":
        path, mode, flags = args
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else \
            bool(isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writes and isinstance(path, (str, bytes, os.PathLike)):
            _COUNTS["file writes"] += 1
    elif event == "subprocess.Popen":
        argv = args[1]
        name = Path(os.fsdecode(argv[0])).name if argv else ""
        if name in _CLIENTS:
            _COUNTS[f"{name} calls"] += 1


def _hook() -> None:
    """Python's audit hooks are process-wide and permanent: add ours once (twice would count
    every event twice). It counts only while _ON."""
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED.append(True)


def _counted_launch(points: int, folder: Path, monkeypatch: pytest.MonkeyPatch
                    ) -> tuple[Counter[str], dict[str, Any]]:
    import hydra

    real = hydra.compose

    def counting(*args: Any, **kwargs: Any) -> Any:
        _COUNTS["composes"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(hydra, "compose", counting)
    _COUNTS.clear()
    _ON.append(True)
    try:
        code = launch(["cluster=slurm", f"trainer.seed=range(0,{points})",
                       "trainer.max_steps=100000", f"sweep.dir={folder}", HOLD],
                      io.StringIO(), cwd=folder.parent, environ=os.environ)
    finally:
        _ON.clear()
        monkeypatch.setattr(hydra, "compose", real)
    assert code == 0
    return Counter(_COUNTS), json.loads((folder / "sweep.json").read_text())


def test_submission_cost_per_point_does_not_grow_with_the_sweep(
        slurm_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _hook()
    limit = max_array_size(os.environ)
    counts, arrays = {}, []
    try:
        for points in (50, 500):
            folder = tmp_path / f"sweep{points}"
            counts[points], manifest = _counted_launch(points, folder, monkeypatch)
            arrays += manifest["arrays"]
            # Complete, as ever: every point has its config, overrides, hparams and job id.
            assert len(manifest["points"]) == points
            for p in manifest["points"]:
                run = Path(p["run_dir"])
                assert p["job_id"] and p["job_id"].split("_")[0] in manifest["arrays"]
                assert all((run / f).is_file() for f in ("config.yaml", "overrides.yaml",
                                                         "hparams.json"))
            assert counts[points]["sbatch calls"] == math.ceil(points / limit)
            assert counts[points]["composes"] == 1  # one defaults tree for one group choice
            assert counts[points]["sinfo calls"] == 1  # the can-it-ever-start check, once
        # Held, so nothing ran: submission alone was counted.
        reasons = subprocess.run(["squeue", "-h", "-r", "-o", "%r", "-j", ",".join(arrays)],
                                 env=slurm_env, capture_output=True, text=True, check=True)
        assert set(reasons.stdout.split()) == {"JobHeldUser"}
    finally:
        cancel(list(arrays))
    small, large = counts[50], counts[500]
    print("per point at 50 / 500 points: " + ", ".join(
        f"{k} {small[k] / 50:.2f} / {large[k] / 500:.2f}" for k in sorted(small)))
    for key in ("file writes", "sbatch calls", "composes"):
        assert large[key] / 500 <= small[key] / 50, key
    assert small["file writes"] >= 4 * 50  # the count sees the writes it claims to count


def _counted(what: Any) -> tuple[Any, Counter[str]]:
    _COUNTS.clear()
    _ON.append(True)
    try:
        result = what()
    finally:
        _ON.clear()
    return result, Counter({k: v for k, v in _COUNTS.items() if k.endswith(" calls")})


def test_following_a_1000_point_sweep_costs_two_slurm_calls_a_refresh(
        slurm_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc_ddp.api import Run
    from hpc_ddp.watch.follow import RunView
    from hpc_ddp.watch.status import Lookups, main, rows_of, runs_of

    _hook()
    folder = tmp_path / "sweep1000"
    t0 = time.monotonic()
    _, manifest = _counted_launch(1000, folder, monkeypatch)
    print(f"launch {time.monotonic() - t0:.1f}s")
    arrays = list(manifest["arrays"])
    try:
        assert len(arrays) == math.ceil(1000 / max_array_size(os.environ))  # 100 arrays
        runs, _ = runs_of(folder)
        looks = Lookups()
        for _ in range(3):  # three refreshes of one `status --watch`
            t0 = time.monotonic()
            rows, calls = _counted(lambda: rows_of(runs, looks))
            print(f"refresh {time.monotonic() - t0:.1f}s {calls}")
            assert sum(calls.values()) <= 2, calls
            assert {r["state"] for r in rows} == {"PENDING"} and len(rows) == 1000
            assert {r["reason"] for r in rows} == {"JobHeldUser"}
        # The command itself, one refresh, in JSON.
        out = io.StringIO()
        code, calls = _counted(lambda: main([str(folder), "--json"], out=out))
        assert code == 0 and sum(calls.values()) <= 2, calls
        assert len(json.loads(out.getvalue())["runs"]) == 1000
        # Run.wait / wait=true following one point: one call a refresh.
        view = RunView(Run.from_dir(runs[500][1]))
        for _ in range(3):
            done, calls = _counted(view.done)
            assert not done and sum(calls.values()) == 1, calls
        assert view.pending is not None and view.pending.code == "JobHeldUser"
    finally:
        t0 = time.monotonic()
        cancel(arrays)
        print(f"cancel {time.monotonic() - t0:.1f}s")
    t0 = time.monotonic()
    # Cancelled before they started: every task is found in its array's range record.
    deadline = time.monotonic() + 30
    while True:
        rows, calls = _counted(lambda: rows_of(runs))
        assert sum(calls.values()) <= 2, calls
        if {r["state"] for r in rows} == {"CANCELLED"} or time.monotonic() > deadline:
            break
        time.sleep(1)
    print(f"cancelled seen {time.monotonic() - t0:.1f}s")
    assert {r["state"] for r in rows} == {"CANCELLED"}
    assert {r["slurm_state"] for r in rows} <= {"CANCELLED", "CANCELLED by 0"}


def test_the_bench_cleans_up_while_a_cancelled_job_still_writes(
        slurm_env: dict[str, str], tmp_path: Path) -> None:
    folder = tmp_path / "bench"
    point = folder / "p0"
    point.mkdir(parents=True)
    # A task that writes into the folder until it is cancelled, and for two seconds after
    # (its TERM trap: the last lines a cancelled task flushes, what broke the old cleanup).
    # (sbatch --wrap runs /bin/sh: POSIX only.)
    script = (f"trap 'for i in $(seq 200); do mkdir -p {point}; touch {point}/late$i; "
              f"sleep 0.01; done; exit 0' TERM; i=0; "
              f"while true; do i=$((i+1)); mkdir -p {point}; touch {point}/f$i; sleep 0.01; "
              f"done")
    done = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/job.out",
                           f"--wrap={script}"], env=slurm_env,
                          capture_output=True, text=True, check=True)
    job = done.stdout.strip().split(";")[0]
    ids = [job]
    try:
        deadline = time.monotonic() + 60
        while len(list(point.iterdir())) < 20:
            assert time.monotonic() < deadline, "the writing job did not start"
            time.sleep(0.2)
        assert clean_up(ids, folder) is None  # cancel, wait until Slurm lists it no more
    finally:
        subprocess.run(["scancel", job], env=slurm_env, check=False)  # never left writing
    assert ids == [] and not folder.exists()
    queued = subprocess.run(["squeue", "-h", "-o", "%i", "-j", job], env=slurm_env,
                            capture_output=True, text=True, check=False)
    assert job not in queued.stdout.split()
