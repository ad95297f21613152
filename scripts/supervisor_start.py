"""A supervisor's start, two trees compared (docs/performance.md#a-supervisors-start).

    git worktree add /tmp/before 39aa4ec~1     # the supervisor that imported torch
    python scripts/supervisor_start.py --before /tmp/before --rounds 5

Each round starts, in a fresh interpreter per tree (their order alternating), what a
supervisor does before its child runs: import its modules, connect to the job's store (a
server of the same tree, started once) and make one request. Prints the median CPU seconds
(user + sys, from wait4) and wall seconds of each tree, and whether torch was loaded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SERVER = ("import sys, time; from hpc_ddp.rank.join import authstore as a; "
          "s = a.StoreServer(sys.argv[1], ['127.0.0.1']); print(s.port, flush=True); "
          "time.sleep(3600)")
CLIENT = ("import sys; import hpc_ddp.rank.main.task, hpc_ddp.rank.supervise.program, "
          "hpc_ddp.rank.join.joined; from hpc_ddp.rank.join import rendezvous as r; "
          "c = r.client(r.Endpoint('127.0.0.1', int(sys.argv[1]), sys.argv[2]), 30); "
          "c.set('x', '1'); print('torch' in sys.modules)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="a checkout of the earlier tree")
    parser.add_argument("--after", default=str(Path(__file__).resolve().parent.parent),
                        help="the tree to compare (default: this checkout)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    trees = {"before": args.before, "after": args.after}
    key = os.urandom(32).hex()
    servers, ports = [], {}
    for name, tree in trees.items():
        env = {**os.environ, "PYTHONPATH": tree}
        proc = subprocess.Popen([sys.executable, "-c", SERVER, key], stdout=subprocess.PIPE,
                                text=True, env=env, cwd=tree)
        servers.append(proc)
        ports[name] = int(proc.stdout.readline())  # type: ignore[union-attr]
    seen: dict[str, dict[str, list[float]]] = {n: {"cpu": [], "wall": []} for n in trees}
    loaded = {}
    try:
        for i in range(args.rounds):
            for name in (list(trees) if i % 2 == 0 else list(trees)[::-1]):
                env = {**os.environ, "PYTHONPATH": trees[name]}
                began = time.perf_counter()
                proc = subprocess.Popen([sys.executable, "-c", CLIENT, str(ports[name]), key],
                                        stdout=subprocess.PIPE, text=True, env=env,
                                        cwd=trees[name])
                _, status, usage = os.wait4(proc.pid, 0)
                seen[name]["wall"].append(time.perf_counter() - began)
                seen[name]["cpu"].append(usage.ru_utime + usage.ru_stime)
                loaded[name] = proc.stdout.read().strip()  # type: ignore[union-attr]
                if status != 0:
                    print(f"error: the {name} tree's supervisor start failed "
                          f"(status {status})", file=sys.stderr)
                    return 1
    finally:
        for proc in servers:
            proc.kill()
    for name, figures in seen.items():
        print(f"{name:7s} torch loaded: {loaded[name]:5s}  CPU "
              f"{statistics.median(figures['cpu']):.2f} s  wall "
              f"{statistics.median(figures['wall']):.2f} s  (median of {args.rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
