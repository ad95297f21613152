"""How long a big sweep takes to submit, every job held so that only submission is timed.

    python -m hpc_ddp.bench sweep --points 1000 --rounds 1 cluster.partition=normal

Needs a Slurm cluster (SLURM_CONF / scontrol). Each leg submits ``--points`` held jobs (they
never start, so nothing loads the machine while the next leg is timed), is timed until its
command returns, then cancelled. Measured in the same run, interleaved:
- arrays:          python -m hpc_ddp.submit -m ... (one sbatch per array, split at MaxArraySize)
- per point:       the same command with sweep.max_array_size=1 (one sbatch per point)
- raw sbatch loop: `sbatch --hold --wrap true` once per point, the floor of per-point submission
and, for the two hpc_ddp legs, where the time went per point (start-up, composition,
planning, folders, pickles and sbatch; hpc_ddp/sweep/timing.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.config.given import text
from hpc_ddp.errors import USAGE_EXIT_CODE, UserError
from hpc_ddp.sweep.timing import SPLIT_ENV

# `++` adds the key or sets it where a cluster config already has one: every leg holds its jobs.
HOLD = "++cluster.sbatch_extra.hold=true"
LEGS = (("arrays", "hpc_ddp -m (job arrays)"),
        ("per_point", "hpc_ddp -m, one sbatch per point"),
        ("raw_sbatch", "bare sbatch --hold loop"))


class Failed(Exception):
    """A leg that did not submit; its message says what the command printed."""


def _timed_sweep(points: int, folder: Path, extra: list[str], per_point: bool,
                 submitted: list[str], name: str) -> tuple[float, dict[str, Any]]:
    """Seconds until `submit -m` returned, and its split; the job ids go into ``submitted``."""
    split = folder.parent / f"{folder.name}.split.json"
    cmd = [sys.executable, "-m", "hpc_ddp.submit", "-m", "cluster=slurm",
           f"trainer.seed=range(0,{points})", "trainer.max_steps=100000", f"sweep.dir={folder}",
           "sweep.parallel=1", HOLD, f"cluster.job_name={name}", *extra]
    if per_point:
        cmd.append("sweep.max_array_size=1")
    started = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, SPLIT_ENV: str(split)})
    try:
        _, stderr = child.communicate()
    except BaseException:  # interrupted: the sweep stops as on Ctrl-C and lists what went out
        try:  # a terminal's Ctrl-C reached it too; a kill of the bench did not
            child.wait(timeout=2)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGINT)
            child.communicate()
        raise
    finally:
        if (folder / "sweep.json").is_file():
            manifest = json.loads((folder / "sweep.json").read_text())
            submitted += sorted({str(p["job_id"]).split("_")[0] for p in manifest["points"]
                                 if p["job_id"]})
    elapsed = time.perf_counter() - started
    if child.returncode != 0:
        raise Failed(f"{' '.join(cmd[1:4])} ... exited {child.returncode}: "
                     f"{stderr.strip()[-800:]}")
    return elapsed, json.loads(split.read_text())


def _timed_raw_sbatch(points: int, partition: str | None, submitted: list[str],
                      name: str) -> float:
    args = ["sbatch", "--parsable", "--hold", "--output=/dev/null", f"--job-name={name}",
            "--wrap=true"]
    if partition:
        args.append(f"--partition={partition}")
    started = time.perf_counter()
    for _ in range(points):
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise Failed(f"sbatch {' '.join(args[1:])} exited {done.returncode}: "
                         f"{done.stderr.strip()}")
        submitted.append(done.stdout.strip().split(";")[0])
    return time.perf_counter() - started


def cancel(ids: list[str], name: str | None = None, wait_s: float = 30.0) -> None:
    """scancel the jobs (200 ids a call), and every job called ``name`` (the bench's own: also
    one whose sbatch was under way when the bench was interrupted), then wait until squeue
    lists none of them, so that no task still writes into the folders about to be removed."""
    if name:
        subprocess.run(["scancel", f"--name={name}"], capture_output=True, check=False)
    for start in range(0, len(ids), 200):
        subprocess.run(["scancel", *ids[start:start + 200]], capture_output=True, check=False)
    deadline = time.monotonic() + wait_s
    wanted = set(ids)
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-o", "%F %j"], capture_output=True,
                                text=True, check=False)
        rows = [line.split(maxsplit=1) for line in queued.stdout.splitlines()]
        if queued.returncode == 0 and not any(
                row[0] in wanted or row[1:] == [name] for row in rows):
            break
        time.sleep(0.5)
    ids.clear()


def remove_tree(folder: Path, attempts: int = 10, wait_s: float = 0.5) -> str | None:
    """Remove ``folder`` even while something still writes into it (a cancelled task's last
    lines): retried a few times; None when gone, else one line saying what is left."""
    error: OSError | None = None
    for attempt in range(attempts):
        try:
            shutil.rmtree(folder)
            return None
        except FileNotFoundError:
            return None
        except OSError as exc:  # "Directory not empty": a file appeared during the removal
            error = exc
            time.sleep(wait_s * (attempt + 1))
    return f"note: {folder} was left behind ({error}); remove it when its jobs are gone."


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def clean_up(ids: list[str], folder: Path, name: str | None = None) -> str | None:
    """The bench's exit path: its jobs cancelled and gone from the queue, its folder removed;
    None, or one line saying what was left (never a traceback)."""
    cancel(ids, name)
    return remove_tree(folder)


def split_lines(splits: dict[str, dict[str, Any]], points: int) -> Iterable[str]:
    """Per leg: start-up once, then each phase in milliseconds per point, and sbatch calls."""
    for name, label in LEGS:
        split = splits.get(name)
        if not split:
            continue
        seconds = dict(split["seconds"])
        startup = seconds.pop("start-up")
        phases = ", ".join(f"{phase} {1000 * s / points:.2f}" for phase, s in seconds.items())
        calls = split["counts"].get("sbatch calls", 0)
        yield (f"  {label:<34} start-up {startup:.2f} s once; ms per point: {phases}; "
               f"{calls} sbatch calls")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.bench sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=200, help="points per way to submit")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repetitions")
    parser.add_argument("--legs", default=",".join(name for name, _ in LEGS),
                        help="which ways to submit, comma-separated (default: all three)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("overrides", nargs="*", help="extra overrides for every point")
    args = parser.parse_args(argv)
    for flag, value in (("--points", args.points), ("--rounds", args.rounds)):
        if value < 1:
            problem = UserError(flag, value, "must be at least 1.", "e.g. --points 200 --rounds 2.")
            print(f"error: {problem.message}", file=sys.stderr)
            return USAGE_EXIT_CODE
    legs = [leg.strip() for leg in args.legs.split(",") if leg.strip()]
    unknown = [leg for leg in legs if leg not in dict(LEGS)] or ([] if legs else [args.legs])
    if unknown:
        problem = UserError("--legs", args.legs, f"names no leg {unknown[0]!r}.",
                            f"choose from {', '.join(dict(LEGS))}, e.g. --legs arrays.")
        print(f"error: {problem.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    if shutil.which("sbatch") is None:
        print("error: this benchmark needs a Slurm cluster (sbatch not found); run it where "
              "sbatch works, or bring up the test cluster (docs/testcluster.md)", file=sys.stderr)
        return 2
    partition = text(args.overrides, "cluster.partition")
    times: dict[str, list[float]] = {name: [] for name in legs}
    splits: dict[str, dict[str, Any]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="hpc_ddp_bench_sweep_"))
    submitted: list[str] = []
    name = f"hpc_ddp_bench_sweep_{os.getpid()}"  # every leg's jobs: cancelled by this name
    signal.signal(signal.SIGTERM, _interrupt)  # a kill cleans up like Ctrl-C
    try:
        for r in range(args.rounds):
            for leg in legs:
                print(f"round {r + 1}/{args.rounds}: {leg}, {args.points} held jobs ...",
                      file=sys.stderr, flush=True)
                if leg == "raw_sbatch":
                    times[leg].append(_timed_raw_sbatch(args.points, partition, submitted, name))
                else:
                    seconds, split = _timed_sweep(args.points, tmp / f"{leg}{r}", args.overrides,
                                                  leg == "per_point", submitted, name)
                    times[leg].append(seconds)
                    if seconds <= min(times[leg]):
                        splits[leg] = split
                cancel(submitted, name)
    except Failed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: cancelling the {len(submitted)} job(s) submitted",
              file=sys.stderr)
        return 130
    finally:
        left = clean_up(submitted, tmp, name)
        if left:
            print(left, file=sys.stderr)
    best = {leg: min(values) for leg, values in times.items()}
    result: dict[str, Any] = {"points": args.points, "seconds": times, "best_seconds": best,
                              "split": splits}
    print(f"submitting a {args.points}-point sweep, every job held (best of {args.rounds}, "
          "seconds until the command returns)")
    for leg, label in LEGS:
        if leg in best:
            per = 1000 * best[leg] / args.points
            print(f"  {label:<34} {best[leg]:8.2f} s  {per:6.2f} ms a point")
    for other, words in (("per_point", "one sbatch per point through submitit"),
                         ("raw_sbatch", "a bare sbatch loop")):
        if "arrays" in best and other in best:
            ratio = result[f"arrays_vs_{other}"] = best["arrays"] / best[other]
            print(f"  arrays take {ratio:.2f}x the time of {words}")
    print("where the time went (hpc_ddp/sweep/timing.py):")
    for line in split_lines(splits, args.points):
        print(line)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
