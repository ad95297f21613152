"""Time to the first training step on Slurm, against bare ``salloc`` + ``srun``:
``python -m hpc_ddp.bench startup``.

    python -m hpc_ddp.bench startup --nodes 2 --rounds 3      # on a login node

Legs, in an order that rotates from round to round, on the same nodes, one after another:

- ``script=``: hpc_ddp/bench/ddp_script.py (a torchrun-style script) under
  ``python -m hpc_ddp.submit script=... wait=true`` (sbatch, the supervisors, the script);
- ``trainer``: the built-in trainer, ``trainer.max_steps=1 wait=true``, supervised
  (``cluster.supervise=true``) and not;
- ``batch``: the same script in a hand-written batch script, ``sbatch`` of ``srun bash -c
  '...'`` with the torchrun variables set by hand: what a user writes instead of hpc_ddp (its
  first step read from the file the script writes, the moment it is there: ``sbatch --wait``
  would poll only every ~30 s);
- ``bare``: the same script under ``salloc -N<n> srun bash -c '...'``, as users write it
  interactively.

Each figure is wall-clock seconds from the command's start to the end of rank 0's first
optimizer step (the script writes the time; the trainer's progress.json holds it): what a
user waits before training runs, the queue included (idle here). Medians of the rounds, and
each leg's ratio to the batch and the bare legs as the medians of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.errors import USAGE_EXIT_CODE, UserError
from hpc_ddp.rundir import read_json

SCRIPT = Path(__file__).with_name("ddp_script.py")
LEGS = ("script=", "trainer supervised", "trainer", "batch", "bare")
# Steps the script runs (its first is what is timed; a few more show it trains on).
STEPS = 12


def _submit(args: Sequence[str], timeout_s: float) -> None:
    done = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "cluster=slurm", *args],
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"`hpc_ddp.submit {shlex.join(args)}` failed: "
                           f"{(done.stdout + done.stderr)[-600:]}")


def script_leg(nodes: int, folder: Path, extra: Sequence[str], timeout_s: float) -> float:
    first = folder / "first"
    _submit([f"nodes={nodes}", f"script={SCRIPT}", f"run_dir={folder / 'run'}", "wait=true",
             *extra, "--", "--steps", str(STEPS), "--warmup", "0",
             "--out", str(folder / "out.json"), "--first-step", str(first)], timeout_s)
    return float(first.read_text())


def trainer_leg(nodes: int, folder: Path, extra: Sequence[str], timeout_s: float,
                supervised: bool) -> float:
    run = folder / "run"
    _submit([f"nodes={nodes}", "trainer.max_steps=1", f"run_dir={run}", "wait=true",
             f"cluster.supervise={str(supervised).lower()}", *extra], timeout_s)
    progress = read_json(run / "progress.json")
    if not isinstance(progress, dict) or "time" not in progress:
        raise RuntimeError(f"the trainer leg left no progress.json in {run}")
    return float(progress["time"])


def _by_hand(folder: Path) -> str:
    """Each task's command as users write it: the torchrun variables from Slurm's."""
    return (f"RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS "
            f"LOCAL_WORLD_SIZE=1 MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST "
            f"| head -n1) MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000)) "
            f"exec {shlex.quote(sys.executable)} {shlex.quote(str(SCRIPT))} "
            f"--steps {STEPS} --warmup 0 --out {shlex.quote(str(folder / 'out.json'))} "
            f"--first-step {shlex.quote(str(folder / 'first'))}")


def batch_leg(nodes: int, folder: Path, timeout_s: float) -> float:
    """A hand-written batch script, ``srun`` inside; its first step the moment the script
    writes it, then its end awaited (the next leg gets the nodes free)."""
    script = folder / "job.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --nodes={nodes}\n#SBATCH --ntasks-per-node=1\n"
                      f"#SBATCH --output={folder}/slurm-%j.out\n"
                      f"srun bash -c {shlex.quote(_by_hand(folder))}\n")
    done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True,
                          text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the batch leg's sbatch failed: {done.stderr[-600:]}")
    job = done.stdout.strip().split(";")[0]
    first, deadline = folder / "first", time.monotonic() + timeout_s
    while not (first.is_file() and first.read_text().strip()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the batch leg's job {job} wrote no first step in time")
        time.sleep(0.05)
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True,
                         check=False).stdout.strip():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the batch leg's job {job} did not end in time")
        time.sleep(0.5)
    return float(first.read_text())


def bare_leg(nodes: int, folder: Path, timeout_s: float) -> float:
    """salloc + srun with the torchrun variables by hand (the script's own first step)."""
    first = folder / "first"
    done = subprocess.run(["salloc", f"-N{nodes}", "--ntasks-per-node=1", "-Q", "srun",
                           "bash", "-c", _by_hand(folder)], capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    if done.returncode != 0 or not first.is_file():
        raise RuntimeError(f"the bare leg failed: {(done.stdout + done.stderr)[-600:]}")
    return float(first.read_text())


def measure(nodes: int, rounds: int, extra: Sequence[str], root: Path,
            timeout_s: float = 600) -> dict[str, list[float]]:
    """Seconds to the first step of each leg, per round (the order rotating)."""
    legs: dict[str, Callable[[Path], float]] = {
        "script=": lambda f: script_leg(nodes, f, extra, timeout_s),
        "trainer supervised": lambda f: trainer_leg(nodes, f, extra, timeout_s, True),
        "trainer": lambda f: trainer_leg(nodes, f, extra, timeout_s, False),
        "batch": lambda f: batch_leg(nodes, f, timeout_s),
        "bare": lambda f: bare_leg(nodes, f, timeout_s),
    }
    found: dict[str, list[float]] = {name: [] for name in LEGS}
    for r in range(rounds):
        order = LEGS[r % len(LEGS):] + LEGS[:r % len(LEGS)]
        for name in order:
            folder = root / f"{r}-{name.replace(' ', '_').rstrip('=')}"
            folder.mkdir(parents=True)
            started = time.time()
            found[name].append(legs[name](folder) - started)
            print(f"  round {r + 1}/{rounds} {name:<19} {found[name][-1]:6.1f} s",
                  file=sys.stderr, flush=True)
    return found


def summary(found: dict[str, list[float]]) -> dict[str, Any]:
    """Each leg's median and its ratios to the batch and the bare legs (medians of the
    rounds' ratios)."""
    def ratio(values: list[float], base: list[float]) -> float:
        return statistics.median(v / b for v, b in zip(values, base, strict=True))

    return {name: {"median_s": statistics.median(values),
                   "ratio_batch": ratio(values, found["batch"]),
                   "ratio": ratio(values, found["bare"]),
                   "rounds_s": values} for name, values in found.items()}


# Against the hand-written batch script (issue 47): the script's fixed costs, the trainer's.
GOALS = {"script=": 1.15, "trainer supervised": 1.3, "trainer": 1.3}


def lines(result: dict[str, Any], nodes: int, rounds: int) -> list[str]:
    out = [f"time to the first step on {nodes} node(s), medians of {rounds} rounds:"]
    for name in LEGS:
        leg = result[name]
        goal = GOALS.get(name)
        verdict = (f" (goal <= {goal}x batch: "
                   f"{'met' if leg['ratio_batch'] <= goal else 'NOT met'})" if goal else "")
        out.append(f"  {name:<19} {leg['median_s']:6.1f} s  {leg['ratio_batch']:5.2f}x batch  "
                   f"{leg['ratio']:5.2f}x bare{verdict}")
    return out


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.bench startup",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2, help="nodes of every leg")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (the order rotates)")
    parser.add_argument("--json", default=None, help="write the figures here")
    args, extra = parser.parse_known_args(argv)
    try:
        for name in ("nodes", "rounds"):
            if getattr(args, name) < 1:
                raise UserError(f"--{name}", getattr(args, name), "must be 1 or more.",
                                f"e.g. --{name} 2.")
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    with tempfile.TemporaryDirectory(prefix="hpc_ddp_bench_startup_", dir=Path.cwd()) as tmp:
        found = measure(args.nodes, args.rounds, extra, Path(tmp))
    result = summary(found)
    print("\n".join(lines(result, args.nodes, args.rounds)))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
