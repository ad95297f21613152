"""``python -m hpc_ddp.testcluster up|down|status [--nodes 4] [--state-dir DIR]``.

Exit codes: 0 done (``status``: the cluster is up), 1 it failed, 2 bad usage,
3 ``status``: the cluster is not up, 4 this machine cannot run it (not root, missing packages).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from hpc_ddp.errors import USAGE_EXIT_CODE, UserError
from hpc_ddp.testcluster.cluster import TestCluster, TestClusterError, requirements_missing
from hpc_ddp.testcluster.config import STATE_DIR_ENV, default_state_dir

EXIT_OK, EXIT_FAILED, EXIT_NOT_UP, EXIT_UNSUPPORTED = 0, 1, 3, 4
# The shape options: default, smallest allowed.
SHAPE = {"nodes": (4, 1), "cpus": (2, 1), "gpus": (2, 0)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hpc_ddp.testcluster",
        description="A multi-node Slurm cluster on this machine, one network namespace per node.",
    )
    p.add_argument("command", choices=["up", "down", "status"])
    p.add_argument("--nodes", type=int, default=SHAPE["nodes"][0])
    p.add_argument("--cpus", type=int, default=SHAPE["cpus"][0], help="CPUs per node")
    p.add_argument("--gpus", type=int, default=SHAPE["gpus"][0],
                   help="fake GPUs per node (0: no GRES)")
    p.add_argument(
        "--state-dir",
        default=None,
        help=f"where everything is written (default ${STATE_DIR_ENV} or {default_state_dir()})",
    )
    p.add_argument("--fresh", action="store_true", help="up: restart even if healthy")
    p.add_argument("--timeout", type=float, default=120.0, help="up: seconds for nodes to idle")
    p.add_argument("--json", action="store_true", help="status: print JSON")
    return p


def check_args(args: argparse.Namespace) -> None:
    """The options' values, before anything is checked or started (UserError if bad)."""
    for name, (default, least) in SHAPE.items():
        value = getattr(args, name)
        if value < least:
            raise UserError(f"--{name}", value, f"must be at least {least}.",
                            f"use --{name} {least} or more (default {default}).")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UserError("--timeout", args.timeout, "must be a positive number of seconds.",
                        "e.g. --timeout 120 (the default).")
    if args.state_dir is not None and Path(args.state_dir).is_file():
        raise UserError("--state-dir", args.state_dir, "is a file, not a folder.",
                        "choose a folder (it is made if missing).")


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
    try:
        check_args(args)
        # The shape's own checks (the nodes must fit the subnet): construction starts nothing.
        cluster = TestCluster(
            args.state_dir,
            nodes=args.nodes,
            cpus=args.cpus,
            gpus=args.gpus,
            say=lambda msg: print(msg, flush=True),
        )
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except ValueError as exc:
        print(f"error: {exc}. Fix: choose fewer --nodes.", file=sys.stderr)
        return USAGE_EXIT_CODE
    problem = requirements_missing()
    if problem:
        print(f"cannot run the test cluster here: {problem}", file=sys.stderr)
        return EXIT_UNSUPPORTED
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
