"""A slow fabric: Linux traffic control on each node's ``eth0``, a rate and a delay.

``shape(cfg, "300mbit", "1ms")`` makes gradient sync between the test cluster's nodes slow for
real; ``clear(cfg)`` undoes it; ``shaped(cfg)`` reads back what is in place. Only the egress
of each node's namespace end (``eth0``) is shaped: node-to-node traffic crosses exactly one
shaped egress in each direction (data out of the sender's eth0, ACKs out of the receiver's),
the bridge and the host ends stay unshaped, and that is enough for a slow fabric between
nodes. The ``*_link`` functions take a namespace and a device, so the tests shape namespaces
of their own instead of the cluster's.

The qdiscs (the delay needs a kernel with netem, ``CONFIG_NET_SCH_NETEM``; the rate needs
only tbf):

- rate only: ``root tbf``;
- delay only: ``root netem delay D``;
- both: ``root handle 1: netem delay D`` with ``parent 1:1 tbf`` as its child, the tc-netem(8)
  man page's own example for "rate control with a delay"
  (https://man7.org/linux/man-pages/man8/tc-netem.8.html, EXAMPLES).

The rate is always tbf's, not netem's own ``rate``: one rate limiter on every kernel (tbf is
built where netem may not be: the Linux 6.18 this was written on has tbf and no netem), which
behaves the same with and without a delay.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from collections.abc import Sequence
from typing import Any

from hpc_ddp.errors import UserError
from hpc_ddp.testcluster import network
from hpc_ddp.testcluster.config import ClusterConfig

DEVICE = "eth0"
# tc(8) "PARAMETERS": rates in bits (bit, kbit, mbit, gbit; SI, x1000) or bytes (bps, kbps,
# ...) per second, times in s, ms or us (https://man7.org/linux/man-pages/man8/tc.8.html).
RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
              "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9}
DELAY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_AMOUNT = re.compile(r"(\d+(?:\.\d+)?)([a-z]+)")
RATE_LIMITS = (8 * 10**3, 100 * 10**9)  # 8kbit .. 100gbit
MAX_DELAY = 10.0  # seconds
# tc-tbf(8): the bucket must hold at least rate/HZ bytes, or tokens that arrive in one timer
# tick overflow it; 250 is the usual HZ (the larger HZ=1000 needs less). At least 64 KiB: one
# TSO/GSO packet of a veth, which tbf would otherwise split in software.
# https://man7.org/linux/man-pages/man8/tc-tbf.8.html
TBF_HZ = 250
TBF_MIN_BURST = 64 * 1024
# tc-tbf(8) "latency": how long a packet may wait in tbf's queue before it is dropped. Deep
# enough that the flows of several ranks at once are queued rather than dropped: a drop costs
# TCP a retransmission timeout (200 ms at least), far noisier than the queueing.
TBF_LATENCY = "200ms"
NETEM_MISSING = "Specified qdisc kind is unknown"


class ShapingError(RuntimeError):
    """tc refused or failed; the message carries its command and what it printed."""


class MachineLacks(RuntimeError):
    """This machine's kernel lacks what is asked for (a qdisc, a cgroup controller)."""


# --- the values -----------------------------------------------------------------------------
def rate_bits(rate: str, key: str = "--rate") -> int:
    """``rate`` (``300mbit``, ``1gbit``, ``500kbit``, ``10mbps``) in bits per second;
    UserError if it is not one tc reads or is out of range."""
    fix = "a number and a unit of tc(8), e.g. 300mbit, 1gbit or 500kbit"
    match = _AMOUNT.fullmatch(rate.strip().lower())
    if not match or match.group(2) not in RATE_UNITS:
        raise UserError(key, rate, "is not a rate.",
                        f"{fix} (units: {', '.join(RATE_UNITS)}).")
    bits = round(float(match.group(1)) * RATE_UNITS[match.group(2)])
    low, high = RATE_LIMITS
    if not low <= bits <= high:
        raise UserError(key, rate, "is out of range.", f"{fix}, from 8kbit to 100gbit.")
    return bits


def delay_seconds(delay: str, key: str = "--delay") -> float:
    """``delay`` (``1ms``, ``200us``, ``0.5s``) in seconds; UserError if it is not one tc
    reads or is over 10 s."""
    match = _AMOUNT.fullmatch(delay.strip().lower())
    if not match or match.group(2) not in DELAY_UNITS:
        raise UserError(key, delay, "is not a delay.",
                        "a number and one of s, ms, us, e.g. 1ms or 200us.")
    seconds = float(match.group(1)) * DELAY_UNITS[match.group(2)]
    if seconds > MAX_DELAY:
        raise UserError(key, delay, "is longer than 10 s.", "e.g. 1ms or 200us.")
    return seconds


def format_rate(bits: float) -> str:
    """Bits per second as tc writes them, in the largest unit that keeps a whole number."""
    for unit in ("gbit", "mbit", "kbit"):
        if bits >= RATE_UNITS[unit] and bits % RATE_UNITS[unit] == 0:
            return f"{int(bits // RATE_UNITS[unit])}{unit}"
    return f"{int(bits)}bit"


def format_delay(seconds: float) -> str:
    """Seconds as ``1ms``, ``200us``, ``1.5ms``."""
    micros = round(seconds * 1e6)
    if micros >= 1000 and micros % 1000 == 0:
        return f"{micros // 1000}ms" if micros % 10**6 else f"{micros // 10**6}s"
    return f"{micros / 1000:g}ms" if micros >= 1000 else f"{micros}us"


def tbf_args(bits: int) -> list[str]:
    burst = max(TBF_MIN_BURST, math.ceil(bits / 8 / TBF_HZ))
    return ["tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", TBF_LATENCY]


# --- one link -------------------------------------------------------------------------------
def _tc(netns: str, *args: str) -> str:
    cmd = ["tc", "-n", netns, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode == 0:
        return proc.stdout
    said = proc.stderr.strip() or proc.stdout.strip()
    if "netem" in args and NETEM_MISSING in said:
        raise MachineLacks(
            "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM; `modprobe sch_netem` where "
            "it is a module), so a delay cannot be applied; shape with a rate alone")
    raise ShapingError(f"`{' '.join(cmd)}` failed: {said}")


def _qdiscs(netns: str, device: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = json.loads(_tc(netns, "-j", "qdisc", "show", "dev", device)
                                             or "[]")
    return found


def read_link(netns: str, device: str = DEVICE) -> str | None:
    """What shapes ``device`` in ``netns``: ``rate 300mbit delay 1ms`` (either part may be
    missing), or None when neither a tbf nor a netem qdisc is there."""
    parts: list[str] = []
    for qdisc in _qdiscs(netns, device):
        options = qdisc.get("options") or {}
        if qdisc.get("kind") == "tbf" and "rate" in options:
            parts.insert(0, f"rate {format_rate(8 * options['rate'])}")
        elif qdisc.get("kind") == "netem":
            delay = (options.get("delay") or {}).get("delay", 0.0)
            parts.append(f"delay {format_delay(delay)}")
    return " ".join(parts) or None


def clear_link(netns: str, device: str = DEVICE) -> bool:
    """Remove our root qdisc (tbf or netem, with its child) from ``device``; True if there was
    one. The default qdisc (a veth's ``noqueue``) and anything else stay: deleting them is
    refused ("Cannot delete qdisc with handle of zero"), and they are not ours."""
    roots = [q for q in _qdiscs(netns, device) if q.get("root")]
    if not any(q.get("kind") in ("tbf", "netem") for q in roots):
        return False
    _tc(netns, "qdisc", "del", "dev", device, "root")
    return True


def shape_link(netns: str, device: str, rate: str | None, delay: str | None) -> None:
    """Shape what leaves ``device`` in ``netns`` (the module's docstring: which qdiscs)."""
    bits = rate_bits(rate) if rate else None
    seconds = delay_seconds(delay) if delay else 0.0
    if bits is None and not seconds:
        raise UserError("--rate", rate, "nothing to shape: neither a rate nor a delay.",
                        "e.g. --rate 300mbit --delay 1ms.")
    clear_link(netns, device)  # from the default, so a change of kind leaves nothing behind
    dev = ["qdisc", "add", "dev", device]
    if seconds:
        _tc(netns, *dev, "root", "handle", "1:", "netem", "delay", format_delay(seconds))
        if bits is not None:
            _tc(netns, *dev, "parent", "1:1", "handle", "10:", *tbf_args(bits))
    elif bits is not None:
        _tc(netns, *dev, "root", "handle", "1:", *tbf_args(bits))


# --- the cluster's nodes --------------------------------------------------------------------
def running_nodes(cfg: ClusterConfig) -> list[str]:
    """The nodes whose namespace exists (also of a cluster started with another --nodes);
    not the login node's."""
    return [n for n in network.known_nodes(cfg)
            if re.fullmatch(rf"{re.escape(cfg.node_prefix)}\d+", n)
            and network.netns_path(cfg, n).exists()]


def _targets(cfg: ClusterConfig, nodes: Sequence[str] | None) -> list[str]:
    running = running_nodes(cfg)
    if nodes is None:
        if not running:
            pattern = cfg.netns(cfg.node_prefix + "*")
            raise ShapingError(f"the test cluster is not up (no namespace {pattern});"
                               " start it first: python -m hpc_ddp.testcluster up")
        return running
    for node in nodes:
        if node not in running:
            raise UserError("--node", node, "is not a node of the running test cluster.",
                            f"choose from {', '.join(running) or 'none (start it first: up)'}.")
    return list(dict.fromkeys(nodes))


def shape(cfg: ClusterConfig, rate: str | None, delay: str | None,
          nodes: Sequence[str] | None = None) -> list[str]:
    """Shape ``nodes`` (default: every running node); returns them. Values are checked
    first; if tc fails on one node, every target is cleared again before the error."""
    if rate:
        rate_bits(rate)
    if delay:
        delay_seconds(delay)
    targets = _targets(cfg, nodes)
    try:
        for node in targets:
            shape_link(cfg.netns(node), DEVICE, rate, delay)
    except (ShapingError, MachineLacks):
        for node in targets:
            clear_link(cfg.netns(node), DEVICE)
        raise
    return targets


def clear(cfg: ClusterConfig, nodes: Sequence[str] | None = None) -> list[str]:
    """Remove shaping from ``nodes`` (default: all running); returns those that had some.
    Idempotent: a node without shaping, or without a namespace, is fine."""
    names = running_nodes(cfg) if nodes is None else list(nodes)
    return [n for n in names
            if network.netns_path(cfg, n).exists() and clear_link(cfg.netns(n), DEVICE)]


def shaped(cfg: ClusterConfig) -> dict[str, str]:
    """Node -> what shapes its eth0 (``rate 300mbit delay 1ms``), for the shaped nodes."""
    found = {n: read_link(cfg.netns(n), DEVICE) for n in running_nodes(cfg)}
    return {n: what for n, what in found.items() if what}
