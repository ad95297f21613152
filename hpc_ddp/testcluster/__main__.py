"""``python -m hpc_ddp.testcluster up|down|status [--nodes 4] [--state-dir DIR] [--instance K]``.

``--instance 1`` is a second cluster beside the default one (nodes bnode1.., its own
state folder, subnet and ports: config.instance_settings), as the test suite runs them.

``shape --rate 300mbit [--delay 1ms] [--node node2 ...]`` / ``shape --clear``: a slow fabric;
``straggle --node node3 --cpu 0.5`` / ``straggle --clear``: a slow node (docs/testcluster.md).

Exit codes: 0 done (``status``: the cluster is up), 1 it failed, 2 bad usage,
3 ``status``: the cluster is not up, 4 this machine cannot run it (not root, missing packages;
``shape --delay``: no netem in the kernel; ``straggle``: no cgroup v1 cpu controller).
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
from hpc_ddp.testcluster.config import MAX_INSTANCES, STATE_DIR_ENV, default_state_dir
from hpc_ddp.testcluster.shaping import MachineLacks, ShapingError, delay_seconds, rate_bits
from hpc_ddp.testcluster.straggler import check_cpu

EXIT_OK, EXIT_FAILED, EXIT_NOT_UP, EXIT_UNSUPPORTED = 0, 1, 3, 4
# The shape options: default, smallest allowed.
SHAPE = {"nodes": (4, 1), "cpus": (2, 1), "gpus": (2, 0)}
# The options of shape and straggle, by command.
SLOWING = {"shape": ("rate", "delay", "node", "clear"), "straggle": ("node", "cpu", "clear")}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hpc_ddp.testcluster",
        description="A multi-node Slurm cluster on this machine, one network namespace per node.",
    )
    p.add_argument("command", choices=["up", "down", "status", "shape", "straggle"])
    p.add_argument("--nodes", type=int, default=SHAPE["nodes"][0])
    p.add_argument("--cpus", type=int, default=SHAPE["cpus"][0], help="CPUs per node")
    p.add_argument("--gpus", type=int, default=SHAPE["gpus"][0],
                   help="fake GPUs per node (0: no GRES)")
    p.add_argument(
        "--state-dir",
        default=None,
        help=f"where everything is written (default ${STATE_DIR_ENV} or {default_state_dir()})",
    )
    p.add_argument("--instance", type=int, default=0,
                   help="which of the clusters that run side by side (0: the default; 1: "
                   "nodes bnode1.. in 10.78.0.0/24 with its own state folder and ports)")
    p.add_argument("--fresh", action="store_true", help="up: restart even if healthy")
    p.add_argument("--timeout", type=float, default=120.0, help="up: seconds for nodes to idle")
    p.add_argument("--json", action="store_true", help="status: print JSON")
    p.add_argument("--rate", help="shape: e.g. 300mbit, 1gbit, 500kbit")
    p.add_argument("--delay", help="shape: e.g. 1ms, 200us (needs a kernel with netem)")
    p.add_argument("--node", action="append",
                   help="shape: a node to shape (repeat; default all); straggle: the node")
    p.add_argument("--cpu", type=float, help="straggle: the CPUs the node gets, e.g. 0.5")
    p.add_argument("--clear", action="store_true",
                   help="shape, straggle: remove it (from --node, default all)")
    return p


def _check_slowing(args: argparse.Namespace) -> None:
    given = [o for o in ("rate", "delay", "node", "cpu", "clear")
             if getattr(args, o) not in (None, False)]
    for option in given:
        if option not in SLOWING.get(args.command, ()):
            raise UserError(f"--{option}", _shown(args, option),
                            f"is not an option of {args.command}.",
                            "it belongs to shape or straggle (docs/testcluster.md).")
    if args.command == "shape" and not args.clear:
        if not (args.rate or args.delay):
            raise UserError("--rate", None, "shape needs --rate, --delay or both.",
                            "e.g. shape --rate 300mbit --delay 1ms, or shape --clear.")
        if args.rate:
            rate_bits(args.rate)
        if args.delay:
            delay_seconds(args.delay)
    if args.command == "straggle" and not args.clear:
        if len(args.node or []) != 1:
            raise UserError("--node", _shown(args, "node"), "straggle needs one --node.",
                            "e.g. straggle --node node3 --cpu 0.5.")
        if args.cpu is None:
            raise UserError("--cpu", None, "straggle needs --cpu.", "e.g. --cpu 0.5.")
        check_cpu(args.cpu)
    if args.clear and (args.rate or args.delay or args.cpu is not None):
        raise UserError("--clear", True, "removes; it takes no --rate, --delay or --cpu.",
                        f"run {args.command} --clear [--node NODE] alone.")


def _shown(args: argparse.Namespace, option: str) -> object:
    value = getattr(args, option)
    return " ".join(value) if isinstance(value, list) else value


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
    if not 0 <= args.instance < MAX_INSTANCES:
        raise UserError("--instance", args.instance, f"must be 0 to {MAX_INSTANCES - 1}.",
                        "use --instance 0 (the default cluster) or 1 (a second one beside it).")
    if args.state_dir is not None and Path(args.state_dir).is_file():
        raise UserError("--state-dir", args.state_dir, "is a file, not a folder.",
                        "choose a folder (it is made if missing).")
    _check_slowing(args)


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
    shaped = "; ".join(f"{node} {what}" for node, what in st["shaping"].items())
    slow = "; ".join(f"{node} {cpu:g} CPU" for node, cpu in st["stragglers"].items())
    print(f"  shaping: {shaped or 'none'}; stragglers: {slow or 'none'}")


def _slow_down(cluster: TestCluster, args: argparse.Namespace) -> str:
    """shape or straggle (or their --clear); what was done, in words."""
    nodes = args.node or None
    if args.command == "shape" and args.clear:
        return f"shaping cleared: {', '.join(cluster.clear_shaping(nodes)) or 'none was set'}"
    if args.command == "shape":
        done = cluster.shape(args.rate, args.delay, nodes)
        what = " ".join(f"--{o} {getattr(args, o)}" for o in ("rate", "delay") if getattr(args, o))
        return f"shaped {', '.join(done)}: {what} on eth0 (check: status)"
    if args.clear:
        return f"stragglers cleared: {', '.join(cluster.unstraggle(nodes)) or 'none was set'}"
    moved = cluster.straggle(args.node[0], args.cpu)
    return f"{args.node[0]} capped at {args.cpu:g} CPU ({moved} processes now; its jobs follow)"


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
            instance=args.instance,
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
    if args.command in SLOWING:
        try:
            print(_slow_down(cluster, args))
        except UserError as exc:  # a --node that is not running
            print(f"error: {exc.message}", file=sys.stderr)
            return USAGE_EXIT_CODE
        except MachineLacks as exc:
            print(f"cannot {args.command} here: {exc}", file=sys.stderr)
            return EXIT_UNSUPPORTED
        except ShapingError as exc:
            print(f"{args.command} failed: {exc}", file=sys.stderr)
            return EXIT_FAILED
        return EXIT_OK
    st = cluster.status()
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        _print_status(st)
    return EXIT_OK if st["up"] else EXIT_NOT_UP


if __name__ == "__main__":
    sys.exit(main())
