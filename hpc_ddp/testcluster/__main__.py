"""``python -m hpc_ddp.testcluster up|down|status [--nodes 4] [--state-dir DIR]``.

Exit codes: 0 done (``status``: the cluster is up), 1 it failed, 2 bad usage,
3 ``status``: the cluster is not up, 4 this machine cannot run it (not root, missing packages).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hpc_ddp.testcluster.cluster import TestCluster, TestClusterError, requirements_missing
from hpc_ddp.testcluster.config import STATE_DIR_ENV, default_state_dir

EXIT_OK, EXIT_FAILED, EXIT_NOT_UP, EXIT_UNSUPPORTED = 0, 1, 3, 4


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hpc_ddp.testcluster",
        description="A multi-node Slurm cluster on this machine, one network namespace per node.",
    )
    p.add_argument("command", choices=["up", "down", "status"])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--cpus", type=int, default=2, help="CPUs per node")
    p.add_argument("--gpus", type=int, default=2, help="fake GPUs per node (0: no GRES)")
    p.add_argument(
        "--state-dir",
        default=None,
        help=f"where everything is written (default ${STATE_DIR_ENV} or {default_state_dir()})",
    )
    p.add_argument("--fresh", action="store_true", help="up: restart even if healthy")
    p.add_argument("--timeout", type=float, default=120.0, help="up: seconds for nodes to idle")
    p.add_argument("--json", action="store_true", help="status: print JSON")
    return p


def _print_status(st: dict[str, Any]) -> None:
    print(f"cluster: {'UP' if st['up'] else 'DOWN'}   state: {st['state_dir']}")
    for name, pid in st["daemons"].items():
        print(f"  {name:<14} {'pid ' + str(pid) if pid else '-'}")
    if st["nodes"]:
        print(f"  {'NODE':<8} {'ADDRESS':<14} STATE")
        for node, state in st["nodes"].items():
            print(f"  {node:<8} {st['node_addresses'].get(node, '?'):<14} {state}")
    print(
        f"  partitions: {', '.join(st['partitions'])}; network: "
        f"{'present' if st['network'] else 'absent'}"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problem = requirements_missing()
    if problem:
        print(f"cannot run the test cluster here: {problem}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    cluster = TestCluster(
        args.state_dir,
        nodes=args.nodes,
        cpus=args.cpus,
        gpus=args.gpus,
        say=lambda msg: print(msg, flush=True),
    )
    if args.command == "up":
        try:
            cluster.up(fresh=args.fresh, timeout=args.timeout)
        except TestClusterError as e:
            print(f"up failed: {e}", file=sys.stderr)
            return EXIT_FAILED
        for key, value in cluster.env().items():
            print(f"export {key}={value}")
        return EXIT_OK
    if args.command == "down":
        cluster.down()
        print("cluster down")
        return EXIT_OK
    st = cluster.status()
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        _print_status(st)
    return EXIT_OK if st["up"] else EXIT_NOT_UP


if __name__ == "__main__":
    sys.exit(main())
