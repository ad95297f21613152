"""Nodes as network namespaces: a bridge, one veth pair and netns per node, /etc/hosts names.

Recipe (docs/testcluster.md, "Why it is set up this way"): a bridge with an address
in the root namespace, per node a netns with a veth into the bridge, its own address, lo up.
Kernel state outlives processes, so every function here is idempotent and ``teardown``
removes whatever an earlier run left behind.
"""

from __future__ import annotations

import ipaddress
import subprocess
from collections.abc import Sequence
from pathlib import Path

from hpc_ddp.testcluster.config import ClusterConfig, render_hosts_block

HOSTS_FILE = Path("/etc/hosts")
# The default cluster's markers; another instance's carry its name (ClusterConfig.hosts_marker).
HOSTS_MARKER = "hpc_ddp testcluster"
HOSTS_BEGIN = f"# BEGIN {HOSTS_MARKER}"
HOSTS_END = f"# END {HOSTS_MARKER}"
NETNS_DIR = Path("/run/netns")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def _link_exists(name: str) -> bool:
    return _ip("link", "show", "dev", name, check=False).returncode == 0


def netns_path(cfg: ClusterConfig, node: str) -> Path:
    return NETNS_DIR / cfg.netns(node)


def setup(cfg: ClusterConfig) -> None:
    """Create the bridge, namespaces and veths (removing leftovers first)."""
    teardown(cfg)
    _ip("link", "add", cfg.bridge, "type", "bridge")
    _ip("addr", "add", f"{cfg.controller_address}/{cfg.prefix_len}", "dev", cfg.bridge)
    _ip("link", "set", cfg.bridge, "up")
    for node, addr in cfg.node_addresses.items():
        ns, veth = cfg.netns(node), cfg.host_veth(node)
        _ip("netns", "add", ns)
        # The namespace end is called eth0, like a real node's interface.
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", cfg.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{addr}/{cfg.prefix_len}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
    _setup_fast_network(cfg)
    write_hosts_block(cfg)


def _setup_fast_network(cfg: ClusterConfig) -> None:
    """The IPv6-only second network (ClusterConfig.fast_subnet) on each node's ib0; nodad:
    the addresses are usable at once (no duplicate address detection to wait for)."""
    prefix = ipaddress.ip_network(cfg.fast_subnet).prefixlen
    _ip("link", "add", cfg.fast_bridge, "type", "bridge")
    _ip("link", "set", cfg.fast_bridge, "up")
    for node, addr in cfg.fast_addresses.items():
        ns, veth = cfg.netns(node), cfg.fast_veth(node)
        _ip("link", "add", veth, "type", "veth", "peer", "name", cfg.fast_interface, "netns", ns)
        _ip("link", "set", veth, "master", cfg.fast_bridge, "up")
        _ip("-n", ns, "-6", "addr", "add", f"{addr}/{prefix}", "dev", cfg.fast_interface,
            "nodad")
        _ip("-n", ns, "link", "set", cfg.fast_interface, "up")


def netns_pids(cfg: ClusterConfig, node: str) -> list[int]:
    """Processes still inside a node's namespace (job steps, slurmstepd, a slurmd)."""
    if not netns_path(cfg, node).exists():
        return []
    proc = _ip("netns", "pids", cfg.netns(node), check=False)
    return [int(p) for p in proc.stdout.split() if p.strip().isdigit()]


def known_nodes(cfg: ClusterConfig) -> list[str]:
    """The configured nodes plus any an earlier run (perhaps with more nodes) left behind."""
    names = dict.fromkeys(cfg.node_names)
    prefix = cfg.netns("")
    if NETNS_DIR.is_dir():
        names.update(
            dict.fromkeys(
                p.name.removeprefix(prefix)
                for p in sorted(NETNS_DIR.iterdir())
                if p.name.startswith(prefix)
            )
        )
    return list(names)


def teardown(cfg: ClusterConfig) -> None:
    """Delete namespaces, veths, the bridge and the hosts block; missing pieces are fine."""
    for node in known_nodes(cfg):
        if _link_exists(cfg.host_veth(node)):
            _ip("link", "del", cfg.host_veth(node), check=False)
        if netns_path(cfg, node).exists():
            _ip("netns", "del", cfg.netns(node), check=False)
        if _link_exists(cfg.fast_veth(node)):
            _ip("link", "del", cfg.fast_veth(node), check=False)
    for bridge in (cfg.bridge, cfg.fast_bridge):
        if _link_exists(bridge):
            _ip("link", "del", bridge, check=False)
    remove_hosts_block(cfg)


def is_up(cfg: ClusterConfig) -> bool:
    return (_link_exists(cfg.bridge) and _link_exists(cfg.fast_bridge)
            and all(netns_path(cfg, n).exists() for n in cfg.node_names))


# --- /etc/hosts ------------------------------------------------------------------------------
def strip_block(lines: Sequence[str], marker: str = HOSTS_MARKER) -> list[str]:
    """``lines`` without the block marked ``marker`` (pure, so it is unit-tested)."""
    out: list[str] = []
    inside = False
    for line in lines:
        if line.strip() == f"# BEGIN {marker}":
            inside = True
        elif line.strip() == f"# END {marker}" and inside:
            inside = False
        elif not inside:
            out.append(line)
    return out


def with_block(lines: Sequence[str], block: Sequence[str],
               marker: str = HOSTS_MARKER) -> list[str]:
    """``lines`` with the block marked ``marker`` replaced by ``block``, at the end (pure,
    idempotent; other clusters' blocks stay)."""
    return [*strip_block(lines, marker), f"# BEGIN {marker}", *block, f"# END {marker}"]


def _write_hosts(lines: list[str]) -> None:
    text = "\n".join(lines) + "\n"
    if HOSTS_FILE.read_text() != text:
        # Written in place, not renamed over: /etc/hosts is often a bind mount in containers.
        HOSTS_FILE.write_text(text)


def write_hosts_block(cfg: ClusterConfig) -> None:
    _write_hosts(with_block(HOSTS_FILE.read_text().splitlines(), render_hosts_block(cfg),
                            cfg.hosts_marker))


def remove_hosts_block(cfg: ClusterConfig) -> None:
    if HOSTS_FILE.exists():
        _write_hosts(strip_block(HOSTS_FILE.read_text().splitlines(), cfg.hosts_marker))
