"""NCCL/Gloo/torch.distributed environment of a task: one precedence rule, every change logged.

The rule, from strongest to weakest:

1. what the config states (typed ``nccl.*`` fields, ``nccl.env``, ``nccl.extra_env``) —
   it overrides an exported value, and the override is logged with both values;
2. what the site or user exported — kept as it is;
3. what ``nccl.detect`` (``nccl=auto``) derives on the node — it fills only variables that
   are still unset, since a site's export knows its fabric better than a guess;
4. NCCL's own defaults.

Applied before the process group exists, since NCCL reads its variables once at
initialisation (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.config.nccl_schema import NCCL_DOCS, NcclConfig, nccl_warnings, wanted_env
from hpc_ddp.config.secrets import MASK, looks_secret, resolve
from hpc_ddp.rank.join import nodeinfo
from hpc_ddp.redact import secret_value

log = logging.getLogger(__name__)

# Variables worth recording for every rank (what NCCL, Gloo and torch.distributed read).
RECORDED = re.compile(r"^(NCCL_|TORCH_|GLOO_|MASTER_|CUDA_|SLURM_|OMP_|UCX_|FI_)")


@dataclass(frozen=True)
class EnvChange:
    name: str
    old: str | None
    new: str
    # "profile" (the config) or "detected" (nccl.detect on this node)
    source: str = "profile"
    # Why a detected value was chosen (empty for the config's own values).
    reason: str = ""


def planned_changes(cfg: NcclConfig, environ: Mapping[str, str],
                    node: nodeinfo.NodeInfo | None = None,
                    towards: str | None = None) -> list[EnvChange]:
    """What applying the config to ``environ`` changes (unchanged values are left out).

    ``node``: the facts ``nccl.detect`` derives from (ignored when detect is off);
    ``towards``: the interface that routes to rank 0, when known.
    """
    wanted = _resolved(wanted_env(cfg), environ)
    changes = [EnvChange(k, environ.get(k), v) for k, v in sorted(wanted.items())
               if environ.get(k) != v]
    if cfg.detect and node is not None:
        for name, (value, reason) in sorted(derived_env(cfg, node, towards).items()):
            if name not in wanted and name not in environ:
                changes.append(EnvChange(name, None, value, "detected", reason))
    return changes


def _resolved(wanted: dict[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """``${oc.env:NAME}`` values (a secret's reference, config/secrets.py) read from this
    task's environment; one whose variable is not set here is left out."""
    out = {}
    for name, value in wanted.items():
        resolved = resolve(value, environ)
        if resolved is None:
            log.warning("env: %s is not set: %s names a variable this task's environment does "
                        "not have (export it where you submit)", name, value)
            continue
        out[name] = resolved
    return out


def derived_env(cfg: NcclConfig, node: nodeinfo.NodeInfo,
                towards: str | None = None) -> dict[str, tuple[str, str]]:
    """variable -> (value, reason) that ``nccl.detect`` chooses for this node (pure)."""
    out: dict[str, tuple[str, str]] = {}
    use_ib = cfg.ib_disable is not True
    active = node.active_ports
    if use_ib and active:
        # Exact names (`=`) of ACTIVE ports only: a DOWN port NCCL tried would fail the
        # job, and a prefix like mlx5_1 would also pick mlx5_10-19 (NCCL_DOCS#nccl-ib-hca).
        names = ",".join(p.name for p in active)
        out["NCCL_IB_HCA"] = (f"={names}", f"ACTIVE ports: {names}")
        if node.peermem:
            # GPUDirect RDMA needs the peer-memory module; with it loaded, allow it up to the
            # CPU's host bridge (NCCL_DOCS#nccl-net-gdr-level-formerly-nccl-ib-gdr-level).
            out["NCCL_NET_GDR_LEVEL"] = ("PHB", f"{node.peermem} is loaded")
    elif use_ib and node.ib_ports:
        # HCAs present, no port ACTIVE: NCCL would still try verbs and fail.
        down = ", ".join(f"{p.name} {p.state}" for p in node.ib_ports)
        out["NCCL_IB_DISABLE"] = ("1", f"no ACTIVE IB port ({down})")
    if not (use_ib and active):
        iface = towards or _only_usable(node)
        if iface:
            out["NCCL_SOCKET_IFNAME"] = (f"={iface}", "the interface towards rank 0"
                                         if towards else "the only usable interface")
    return out


def _only_usable(node: nodeinfo.NodeInfo) -> str | None:
    usable = node.usable_interfaces()
    return usable[0].name if len(usable) == 1 else None


FAIL = "fail"  # NCCL would not start, or would fail, on this node
WARN = "warn"  # it works, but not as intended


def node_warnings(environ: Mapping[str, str],
                  node: nodeinfo.NodeInfo) -> list[tuple[str, str]]:
    """(FAIL or WARN, message): what the effective environment gets wrong on this node (pure)."""
    out: list[tuple[str, str]] = []
    hca = environ.get("NCCL_IB_HCA", "")
    ports = [p.name for p in node.ib_ports]
    if hca and ports and environ.get("NCCL_IB_DISABLE") != "1":
        picked = nodeinfo.selected(hca, ports)
        states = {p.name: p.state for p in node.ib_ports}
        if not picked:
            out.append((FAIL, f"NCCL_IB_HCA={hca} selects none of this node's ports "
                              f"({', '.join(ports)})."))
        down = [p for p in picked if states[p] != "ACTIVE"]
        if down:
            out.append((FAIL, f"NCCL_IB_HCA={hca} selects port(s) that are not ACTIVE: "
                        + ", ".join(f"{p} {states[p]}" for p in down) + "."))
        if not hca.removeprefix("^").startswith("="):
            tokens = [t.split(":")[0] for t in hca.removeprefix("^").split(",")]
            extra = sorted({p.split(":")[0] for p in picked} - set(tokens))
            if extra and not hca.startswith("^"):
                out.append((WARN, f"NCCL_IB_HCA={hca} is a prefix list and also selects "
                                  f"{', '.join(extra)} here; write ={hca} for exact names."))
    names = [i.name for i in node.interfaces]
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        spec = environ.get(var, "")
        if spec and names:
            gloo = var.startswith("GLOO")
            picked = ([n for n in spec.split(",") if n in names] if gloo
                      else nodeinfo.selected(spec, names))
            if not picked:
                out.append((FAIL, f"{var}={spec} matches no interface on this node "
                                  f"(it has {', '.join(names)})."))
    gdr = environ.get("NCCL_NET_GDR_LEVEL", "")
    if gdr and gdr != "LOC" and node.active_ports and not node.peermem:
        out.append((WARN, f"NCCL_NET_GDR_LEVEL={gdr} asks for GPUDirect RDMA but no "
                          "peer-memory module (nvidia_peermem) is loaded."))
    return out


def mask(name: str, value: str) -> str:
    """Values of secret-named or secret-shaped variables never reach a file or a log."""
    return MASK if looks_secret(name) or secret_value(value) else value


def recorded_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: mask(k, v) for k, v in sorted(environ.items()) if RECORDED.match(k)}


# torch's flight recorder appends the rank to this name (TORCH_FR_DUMP_TEMP_FILE, formerly
# TORCH_NCCL_DEBUG_INFO_TEMP_FILE: https://pytorch.org/docs/stable/torch_nccl_environment_variables.html).
FLIGHT_RECORDER_PREFIX = "nccl_trace_rank_"
FLIGHT_RECORDER_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def flight_recorder_on(environ: Mapping[str, str]) -> bool:
    """The NCCL flight recorder keeps a trace and dumps it on a timeout."""
    size = (environ.get("TORCH_FR_BUFFER_SIZE") or environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
            or "0").strip()
    dump = environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "").strip().lower()
    return size.isdigit() and int(size) > 0 and dump in ("1", "true", "yes")


def apply(cfg: NcclConfig, environ: MutableMapping[str, str],
          root: Path | None = None) -> list[EnvChange]:
    """Export the config into ``environ`` (the task's os.environ), logging every change.

    ``root``: where node facts are read (default: ``$HPC_DDP_SYSFS_ROOT`` or /).
    """
    for warning in nccl_warnings(cfg):
        log.warning("nccl: %s", warning)
    node = nodeinfo.detect(root or nodeinfo.sysfs_root(environ))
    towards = _interface_towards_master(environ) if cfg.detect and node.root == "/" else None
    changes = planned_changes(cfg, environ, node, towards)
    for change in changes:
        shown = mask(change.name, change.new)
        if change.source == "detected":
            log.info("env: %s=%s (detected: %s)", change.name, shown, change.reason)
        elif change.old is None:
            log.info("env: %s=%s (profile %s)", change.name, shown, cfg.profile)
        else:
            log.warning("env: %s=%s overrides the exported %s (profile %s)", change.name,
                        shown, mask(change.name, change.old), cfg.profile)
        environ[change.name] = change.new
    if cfg.detect and not changes:
        log.info("env: nccl.detect found nothing to set (profile %s)", cfg.profile)
    for level, warning in node_warnings(environ, node):
        log.warning("nccl on this node (%s): %s (%s)", level, warning, NCCL_DOCS)
    return changes


def _interface_towards_master(environ: Mapping[str, str]) -> str | None:
    """The interface the kernel routes rank 0's address through, when the environment names
    rank 0 (MASTER_ADDR, or the first host of the Slurm step: rank 0 runs there under Slurm's
    block distribution; the step's list, as a step may run on part of the job's nodes)."""
    # deferred (start-up): hostlist, rank.join.netif
    from hpc_ddp import hostlist
    from hpc_ddp.rank.join import netif

    master = environ.get("MASTER_ADDR")
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if not master and nodelist:
        try:
            master = hostlist.first_host(nodelist)
        except ValueError:
            return None
    iface = netif.interface_towards(master) if master else None
    # A master name that resolves to loopback says nothing about the network between nodes.
    return None if iface is None or iface.startswith("lo") else iface
