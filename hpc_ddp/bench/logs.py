"""How fast ``python -m hpc_ddp.logs`` answers on a run of thousands of ranks.

    python -m hpc_ddp.bench logs                        # 4,096 ranks x 200 lines
    python -m hpc_ddp.bench logs --ranks 8192 --lines 100 --json logs.json

Writes a synthetic run dir (``--keep DIR`` keeps it there) whose every rank's log holds
``--lines`` lines as a rank writes them (hpc_ddp/ranklines.py: two attempts, the program's
stdout and stderr, hpc_ddp's own lines), then times the command as a user runs it (a new
Python process each time, best of ``--repeat``): one rank, a few ranks, a ``--grep`` over
every rank, and the last lines of all of them merged. docs/observability.md shows the figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.errors import USAGE_EXIT_CODE
from hpc_ddp.ranklines import ATTEMPT, ERR, OUT, attempt_text, line

START = 1_800_000_000.0  # the first line's time (Unix), any fixed day


def write_run(root: Path, ranks: int, lines: int) -> Path:
    """A run dir whose ``ranks`` logs hold ``lines`` lines each; returns it."""
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    half = lines // 2
    for rank in range(ranks):
        host = f"node{rank // 8:04d}"
        text = []
        for index in range(lines):
            when = START + index * 0.5 + rank * 1e-4
            if index in (0, half):
                text.append(line(rank, host, ATTEMPT, attempt_text("42.0", index // max(half, 1),
                                                                  0), when))
            elif index % 10 == 3:
                text.append(line(rank, host, "INFO", f"step {index} loss 2.{index:04d}", when))
            elif index % 50 == 7:
                text.append(line(rank, host, ERR, f"warning: slow batch on rank {rank}", when))
            else:
                text.append(line(rank, host, OUT, f"epoch {index // 20} batch {index} "
                                                  f"acc 0.{(rank * index) % 9973:04d}", when))
        (logs / f"rank{rank}.log").write_text("".join(text))
    return root


CASES = {"one rank": ["--rank", "5"], "eight ranks": ["--ranks", "0-7"],
         "grep over all": ["--grep", "slow batch on rank 4095$"],
         "last 20 of all": ["--tail", "20"]}


def timed(run_dir: Path, args: list[str], repeat: int) -> float:
    """Seconds of ``python -m hpc_ddp.logs RUN_DIR ARGS`` (best of ``repeat``)."""
    best = float("inf")
    for _ in range(repeat):
        began = time.perf_counter()
        subprocess.run([sys.executable, "-m", "hpc_ddp.logs", str(run_dir), *args],
                       stdout=subprocess.DEVNULL, check=True)
        best = min(best, time.perf_counter() - began)
    return best


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.bench logs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--lines", type=int, default=200, help="lines per rank")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="write the run dir here and keep it")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.lines < 2 or args.repeat < 1:
        print(f"error: --ranks={args.ranks} --lines={args.lines} --repeat={args.repeat}: "
              "need ranks >= 1, lines >= 2, repeat >= 1. Fix: raise them.", file=sys.stderr)
        return USAGE_EXIT_CODE
    with tempfile.TemporaryDirectory() as scratch:
        root = args.keep or Path(scratch) / "run"
        began = time.perf_counter()
        write_run(root, args.ranks, args.lines)
        made = time.perf_counter() - began
        size = sum(p.stat().st_size for p in (root / "logs").iterdir())
        print(f"logs of {args.ranks} ranks x {args.lines} lines ({size / 2**20:.0f} MiB), "
              f"written in {made:.1f} s; python -m hpc_ddp.logs, best of {args.repeat}:")
        figures: dict[str, Any] = {"ranks": args.ranks, "lines": args.lines, "bytes": size}
        for name, case in CASES.items():
            seconds = timed(root, case, args.repeat)
            figures[name] = seconds
            print(f"  {name:<15} {' '.join(case):<34} {seconds:6.2f} s")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
