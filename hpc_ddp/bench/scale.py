"""What one rank costs against the world size, and how long the node lists take to read.

    python -m hpc_ddp.bench scale                       # worlds of 8, 64, 512, 8192 ranks
    python -m hpc_ddp.bench scale --worlds 8,65536 --json scale.json

Runs on this machine, no job: for every world size, hpc_ddp's own code for one rank of a
simulated world (hpc_ddp/bench/scale_world.py: start-up of a requeued attempt, a checkpoint,
a resume, three kinds of failure), counted by a recording store and file layer
(recording.py): store operations and bytes, file operations, bytes and directory entries
read, Slurm commands. The rank shown is the busiest of four (rank 0, the fallback reporter,
a middle and the last rank). Then the seconds every rank spends at start-up reading a
10,000-node job's SLURM_JOB_NODELIST and SLURM_TASKS_PER_NODE (hpc_ddp/hostlist.py,
distenv.detect), best of ``--repeat``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import timeit
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.errors import USAGE_EXIT_CODE

NODES = 10_000


def _worlds(text: str) -> list[int]:
    try:
        sizes = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give sizes like 8,64,512") from None
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: every world has 2 ranks or more")
    return sorted(set(sizes))


def costs(sizes: Sequence[int], root: Path) -> dict[int, dict[str, dict[str, Any]]]:
    """world size -> scenario -> the busiest simulated rank's cost."""
    # deferred: the typed schemas; start-up: rank.supervise.diagnose
    from hpc_ddp.bench.scale_world import SCENARIOS, World
    from hpc_ddp.rank.supervise.diagnose import fallback_reporter

    found: dict[int, dict[str, dict[str, Any]]] = {}
    for size in sizes:
        ranks = sorted({0, fallback_reporter(-(-size // 8), 8, size), size // 2, size - 1})
        world = World(root, size, tuple(ranks))
        found[size] = {}
        for name, run in SCENARIOS.items():
            each = {rank: run(world, rank) for rank in ranks}
            rank, cost = max(each.items(), key=lambda kv: kv[1].values())
            found[size][name] = {"rank": rank, **dict(zip(cost.columns(), cost.values(),
                                                          strict=True))}
    return found


def node_lists(repeat: int) -> dict[str, float]:
    """Seconds to read a 10,000-node job's lists, best of ``repeat``."""
    # deferred (start-up): hostlist, rank.join.distenv
    from hpc_ddp import hostlist
    from hpc_ddp.rank.join.distenv import detect

    cartesian = "rack[001-050]-node[001-200]"  # 10,000 nodes in one expression
    scattered = "gpu[" + ",".join(f"{2 * i + 1:05d}" for i in range(NODES)) + "]"  # no ranges
    uniform, mixed = f"8(x{NODES})", ",".join("8" if i % 2 else "4" for i in range(NODES))
    environ = {"SLURM_PROCID": str(6 * NODES - 1), "SLURM_LOCALID": "3", "SLURM_NODEID":
               str(NODES - 1), "SLURM_NTASKS": str(6 * NODES), "SLURM_NNODES": str(NODES),
               "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": scattered,
               "SLURM_TASKS_PER_NODE": mixed}
    assert len(hostlist.expand(cartesian)) == NODES == len(hostlist.expand(scattered))
    assert len(hostlist.tasks_per_node(mixed)) == NODES
    cases = {"hostlist rack[001-050]-node[001-200]": lambda: hostlist.expand(cartesian),
             "hostlist of 10,000 single nodes": lambda: hostlist.expand(scattered),
             "SLURM_TASKS_PER_NODE 8(x10000)": lambda: hostlist.tasks_per_node(uniform),
             "SLURM_TASKS_PER_NODE of 10,000 entries": lambda: hostlist.tasks_per_node(mixed),
             "distenv.detect of a 10,000-node step": lambda: detect(environ)}
    return {name: min(timeit.repeat(fn, number=1, repeat=repeat)) for name, fn in cases.items()}


def main(argv: Sequence[str] | None = None) -> int:
    from hpc_ddp.bench.scale_world import Cost  # deferred: the typed schemas

    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.bench scale",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=_worlds, default=[8, 64, 512, 8192],
                        help="world sizes to simulate (default 8,64,512,8192)")
    parser.add_argument("--repeat", type=int, default=5, help="timings of each node list")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return USAGE_EXIT_CODE if exc.code else 0
    with tempfile.TemporaryDirectory(prefix="hpc_ddp_bench_scale_") as tmp:
        found = costs(args.worlds, Path(tmp))
    head = f"{'scenario':<36} {'world':>6} {'rank':>5} " + " ".join(
        f"{c:>11}" for c in Cost.columns())
    print("per-rank cost of one rank's work (the busiest of rank 0, the fallback reporter, a "
          "middle and the last rank)")
    print(head)
    for name in next(iter(found.values())):
        for size in args.worlds:
            row = found[size][name]
            print(f"{name:<36} {size:>6} {row['rank']:>5} " + " ".join(
                f"{row[c]:>11}" for c in Cost.columns()))
    lists = node_lists(args.repeat)
    print(f"reading a {NODES:,}-node job's lists (every rank, at start-up; best of "
          f"{args.repeat})")
    for name, seconds in lists.items():
        print(f"  {name:<42} {1000 * seconds:8.2f} ms")
    if args.json:
        args.json.write_text(json.dumps({"costs": found, "node_lists_s": lists}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
