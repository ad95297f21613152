"""How long a big sweep takes to submit: job arrays against one sbatch per point.

    python -m hpc_ddp.bench.sweep --points 200 cluster.partition=normal

Needs a Slurm cluster (SLURM_CONF / scontrol). Submits, times the command until it returns,
then cancels everything it submitted. Measured in the same run, interleaved:
- arrays:          python -m hpc_ddp.submit -m ... (one sbatch per array, split at MaxArraySize)
- per point:       the same command with sweep.max_array_size=1 (one sbatch per point)
- raw sbatch loop: `sbatch --wrap true` once per point, the floor of per-point submission
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from hpc_ddp.errors import USAGE_EXIT_CODE, UserError


def _timed_sweep(points: int, folder: Path, extra: list[str], per_point: bool) -> float:
    cmd = [sys.executable, "-m", "hpc_ddp.submit", "-m", "cluster=slurm",
           f"trainer.seed=range(0,{points})", "trainer.max_steps=100000", f"sweep.dir={folder}",
           "sweep.parallel=1", *extra]
    if per_point:
        cmd.append("sweep.max_array_size=1")
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    subprocess.run([sys.executable, "-m", "hpc_ddp.status", str(folder), "--cancel"],
                   capture_output=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"sweep submission failed: {done.stderr.strip()[-500:]}")
    _cancel_points(folder)
    return elapsed


def _cancel_points(folder: Path) -> None:
    manifest = json.loads((folder / "sweep.json").read_text())
    ids = sorted({str(p["job_id"]).split("_")[0] for p in manifest["points"] if p["job_id"]})
    for start in range(0, len(ids), 200):
        subprocess.run(["scancel", *ids[start:start + 200]], capture_output=True, check=False)


def _timed_raw_sbatch(points: int, partition: str | None) -> float:
    args = ["sbatch", "--parsable", "--hold", "--output=/dev/null", "--wrap=true"]
    if partition:
        args.append(f"--partition={partition}")
    ids = []
    started = time.perf_counter()
    for _ in range(points):
        done = subprocess.run(args, capture_output=True, text=True, check=True)
        ids.append(done.stdout.strip().split(";")[0])
    elapsed = time.perf_counter() - started
    for start in range(0, len(ids), 200):
        subprocess.run(["scancel", *ids[start:start + 200]], capture_output=True, check=False)
    return elapsed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.bench sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=200, help="points per way to submit")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repetitions")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("overrides", nargs="*", help="extra overrides for every point")
    args = parser.parse_args(argv)
    for flag, value in (("--points", args.points), ("--rounds", args.rounds)):
        if value < 1:
            problem = UserError(flag, value, "must be at least 1.", "e.g. --points 200 --rounds 2.")
            print(f"error: {problem.message}", file=sys.stderr)
            return USAGE_EXIT_CODE
    if shutil.which("sbatch") is None:
        print("error: this benchmark needs a Slurm cluster (sbatch not found)", file=sys.stderr)
        return 2
    partition = next((o.split("=", 1)[1] for o in args.overrides
                      if o.startswith("cluster.partition=")), None)
    times: dict[str, list[float]] = {"arrays": [], "per_point": [], "raw_sbatch": []}
    with tempfile.TemporaryDirectory(prefix="hpc_ddp_bench_sweep_") as tmp:
        for r in range(args.rounds):
            times["arrays"].append(_timed_sweep(args.points, Path(tmp) / f"a{r}",
                                                args.overrides, per_point=False))
            times["per_point"].append(_timed_sweep(args.points, Path(tmp) / f"p{r}",
                                                   args.overrides, per_point=True))
            times["raw_sbatch"].append(_timed_raw_sbatch(args.points, partition))
    best = {name: min(values) for name, values in times.items()}
    result = {"points": args.points, "seconds": times, "best_seconds": best,
              "speedup_vs_per_point": best["per_point"] / best["arrays"],
              "speedup_vs_raw_sbatch": best["raw_sbatch"] / best["arrays"]}
    print(f"submitting a {args.points}-point sweep (best of {args.rounds}, seconds until the "
          "command returns)")
    for name, label in (("arrays", "hpc_ddp -m (job arrays)"),
                        ("per_point", "hpc_ddp -m, one sbatch per point"),
                        ("raw_sbatch", "bare sbatch loop, one per point")):
        print(f"  {label:<34} {best[name]:8.2f} s")
    print(f"  arrays are {result['speedup_vs_per_point']:.1f}x faster than one sbatch per point "
          f"through submitit, {result['speedup_vs_raw_sbatch']:.1f}x faster than a bare loop")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
