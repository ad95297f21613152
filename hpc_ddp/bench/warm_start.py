"""What a warm start saves: ``python -m hpc_ddp.bench warm``.

    python -m hpc_ddp.bench warm --ranks 2,8 --rounds 3             # this machine
    python -m hpc_ddp.bench warm --ranks 8 cluster=slurm nodes=1    # one Slurm node

For each number of ranks on one node, the same one-step run of the built-in trainer
(``trainer.max_steps=1``) is submitted cold (``cluster.warm_start=false``: every rank process
a fresh interpreter), warm (forked from the node's warm process, started for this run:
``cluster.warm_keep_s=0``, as every run on Slurm) and, locally, kept (the default: forked from
the warm process an earlier run left, as a second local run is), in an order that alternates
from round to round. Two figures each, from the command's start to the end of rank 0's first
optimizer step (progress.json's time): the wall-clock seconds, and the CPU-seconds the whole
machine spent meanwhile (/proc/stat: every process, so run it on an idle machine; the test
cluster's nodes share this one). Medians of the rounds; the warm figure's ratio to the cold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.errors import USAGE_EXIT_CODE, UserError
from hpc_ddp.rundir import read_json

MODES = ("cold", "warm", "kept")
# What each mode's run is given.
_MODE_ARGS = {"cold": ["cluster.warm_start=false"],
              "warm": ["cluster.warm_start=true", "cluster.warm_keep_s=0"],
              "kept": ["cluster.warm_start=true"]}


def modes(extra: Sequence[str]) -> tuple[str, ...]:
    """The modes measured: on Slurm no warm process outlives its job, so none is kept."""
    return MODES[:2] if _on_slurm(extra) else MODES


def _on_slurm(extra: Sequence[str]) -> bool:
    return any(a.startswith("cluster=slurm") for a in extra)


def machine_cpu_s() -> float:
    """CPU-seconds every process of this machine has spent (user, nice, system, irq,
    softirq: https://man7.org/linux/man-pages/man5/proc_pid_stat.5.html, /proc/stat)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:8]
    ticks = sum(int(f) for i, f in enumerate(fields) if i not in (3, 4))  # less idle, iowait
    return ticks / os.sysconf("SC_CLK_TCK")


def one_run(ranks: int, mode: str, folder: Path, extra: Sequence[str],
            timeout_s: float) -> tuple[float, float]:
    """(seconds, machine CPU-seconds) from the command to rank 0's first step."""
    run_dir = folder / "run"
    argv = [sys.executable, "-m", "hpc_ddp.submit", "nodes=1",
            f"cluster.tasks_per_node={ranks}", "trainer.max_steps=1", *_MODE_ARGS[mode],
            f"run_dir={run_dir}", *(["wait=true"] if _on_slurm(extra) else []), *extra]
    started, cpu0 = time.time(), machine_cpu_s()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, cpu1 = time.monotonic() + timeout_s, None
    progress = run_dir / "progress.json"
    while proc.poll() is None or cpu1 is None:
        if cpu1 is None and progress.is_file():
            cpu1 = machine_cpu_s()
        if time.monotonic() > deadline:
            proc.kill()
            break
        if proc.poll() is not None and cpu1 is None:
            break
        time.sleep(0.01)
    out = proc.communicate()[0]
    first = read_json(progress)
    if proc.returncode != 0 or cpu1 is None or not isinstance(first, dict):
        raise RuntimeError(f"the {mode} run of {ranks} ranks failed: "
                           f"{out[-600:]}")
    return float(first["time"]) - started, cpu1 - cpu0


def measure(ranks: Sequence[int], rounds: int, extra: Sequence[str], root: Path,
            timeout_s: float = 600) -> dict[int, dict[str, list[tuple[float, float]]]]:
    measured = modes(extra)
    found: dict[int, dict[str, list[tuple[float, float]]]] = {
        n: {m: [] for m in measured} for n in ranks}
    for n in ranks:
        if "kept" in measured:  # the earlier run whose warm process the kept rounds use
            (root / f"{n}-first").mkdir(parents=True)
            one_run(n, "kept", root / f"{n}-first", extra, timeout_s)
        for r in range(rounds):
            for mode in measured if r % 2 == 0 else measured[::-1]:
                folder = root / f"{n}-{r}-{mode}"
                folder.mkdir(parents=True)
                found[n][mode].append(one_run(n, mode, folder, extra, timeout_s))
                wall, cpu = found[n][mode][-1]
                print(f"  {n} ranks, round {r + 1}/{rounds}, {mode}: {wall:5.1f} s, "
                      f"{cpu:5.1f} CPU-s", file=sys.stderr, flush=True)
    return found


def summary(found: dict[int, dict[str, list[tuple[float, float]]]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for n, by_mode in found.items():
        wall = {mode: statistics.median(w for w, _ in runs) for mode, runs in by_mode.items()}
        cpu = {mode: statistics.median(c for _, c in runs) for mode, runs in by_mode.items()}
        row: dict[str, Any] = {mode: {"wall_s": wall[mode], "cpu_s": cpu[mode],
                                      "rounds": runs} for mode, runs in by_mode.items()}
        row.update(wall_ratio=wall["warm"] / wall["cold"], cpu_ratio=cpu["warm"] / cpu["cold"],
                   cpu_saved_per_rank_s=(cpu["cold"] - cpu["warm"]) / n)
        if "kept" in by_mode:
            row.update(kept_wall_ratio=wall["kept"] / wall["cold"],
                       kept_cpu_ratio=cpu["kept"] / cpu["cold"])
        result[str(n)] = row
    return result


def lines(result: dict[str, Any], rounds: int) -> list[str]:
    kept = all("kept" in row for row in result.values())
    out = [f"command to the first step, one node, medians of {rounds} rounds:",
           f"  {'ranks':>5}  {'cold':>15}  {'warm':>15}  {'warm/cold':>15}  CPU-s saved a rank"
           + (f"  {'kept':>15}  {'kept/cold':>15}" if kept else "")]
    for n, row in result.items():
        out.append(f"  {n:>5}  {row['cold']['wall_s']:5.1f} s {row['cold']['cpu_s']:5.1f} CPU-s"
                   f"  {row['warm']['wall_s']:5.1f} s {row['warm']['cpu_s']:5.1f} CPU-s"
                   f"  {row['wall_ratio']:5.2f}x {row['cpu_ratio']:5.2f}x CPU"
                   f"  {row['cpu_saved_per_rank_s']:18.2f}" + (
                       f"  {row['kept']['wall_s']:5.1f} s {row['kept']['cpu_s']:5.1f} CPU-s"
                       f"  {row['kept_wall_ratio']:5.2f}x {row['kept_cpu_ratio']:5.2f}x CPU"
                       if kept else ""))
    return out


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.bench warm",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,8", help="ranks on the node, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (the order alternates)")
    parser.add_argument("--json", default=None, help="write the figures here")
    args, extra = parser.parse_known_args(argv)
    try:
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
        if not ranks or min(ranks) < 1:
            raise ValueError
    except ValueError:
        print(f"error: --ranks {args.ranks}: not a list of positive counts. Fix: e.g. "
              "--ranks 2,8.", file=sys.stderr)
        return USAGE_EXIT_CODE
    try:
        if args.rounds < 1:
            raise UserError("--rounds", args.rounds, "must be 1 or more.", "e.g. --rounds 3.")
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    with tempfile.TemporaryDirectory(prefix="hpc_ddp_bench_warm_", dir=Path.cwd()) as tmp:
        found = measure(ranks, args.rounds, extra, Path(tmp))
    result = summary(found)
    print("\n".join(lines(result, args.rounds)))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
