"""Schema of the ``nccl`` group: the NCCL / Gloo / torch.distributed environment of a task.

Typed fields map one-to-one to environment variables (``FIELD_VARS``); ``env`` and
``extra_env`` carry anything else. Every value that names a variable we know is checked
against its documented meaning before anything is submitted (``validate_nccl``); what is legal
but risky is returned by ``nccl_warnings``. Sources: NCCL's environment variables
(https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html) and PyTorch's
(https://pytorch.org/docs/stable/torch_nccl_environment_variables.html).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from hpc_ddp.errors import UserError

NCCL_DOCS = "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html"
TORCH_NCCL_DOCS = "https://pytorch.org/docs/stable/torch_nccl_environment_variables.html"
DIST_DOCS = "https://pytorch.org/docs/stable/distributed.html"


@dataclass
class NcclConfig:
    # Profile name (conf/nccl/<profile>.yaml), shown in every log line of what it sets.
    profile: str = "default"
    # Derive settings on each node from what it has: HCAs with ACTIVE ports, the GPUDirect
    # peer-memory module, the interface towards rank 0 (nccl=auto). Fills only what is unset.
    detect: bool = False
    # NCCL_SOCKET_IFNAME: IP interfaces for bootstrap and sockets; prefixes, `^` excludes,
    # `=` exact names.
    # https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-socket-ifname
    socket_ifname: str | None = None
    # GLOO_SOCKET_IFNAME: Gloo's interface(s), exact names only (no `^`/`=`).
    # https://pytorch.org/docs/stable/distributed.html#choosing-the-network-interface-to-use
    gloo_socket_ifname: str | None = None
    # NCCL_IB_DISABLE: true forces IP sockets instead of IB/RoCE verbs.
    # https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-ib-disable
    ib_disable: bool | None = None
    # NCCL_IB_HCA: RDMA devices `hca[:port]`, `^` excludes, `=` exact (else mlx5_1 = mlx5_1*).
    # https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-ib-hca
    ib_hca: str | None = None
    # NCCL_NET_GDR_LEVEL: farthest NIC-GPU distance for GPUDirect RDMA: LOC PIX PXB PHB SYS.
    # https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-net-gdr-level-formerly-nccl-ib-gdr-level
    gdr_level: str | None = None
    # NCCL_IB_TIMEOUT: verbs timeout 4.096 us * 2^t, 1-31 (0 or >= 32: infinite).
    # https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-ib-timeout
    ib_timeout: int | None = None
    # NCCL_IB_RETRY_CNT: verbs retries, 0-7 (default 7).
    # https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-ib-retry-cnt
    ib_retry_cnt: int | None = None
    # NCCL_CROSS_NIC: 0 same NIC per ring (rail-optimized), 1 any NIC, 2 prefer same (default).
    # https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-cross-nic
    cross_nic: int | None = None
    # NCCL_IB_GID_INDEX: RoCE GID index (see show_gids); -1 lets NCCL choose.
    # https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-ib-gid-index
    ib_gid_index: int | None = None
    # NCCL_IB_ROCE_VERSION_NUM: RoCE version (1 or 2) of the GID NCCL picks itself.
    # https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-ib-roce-version-num
    ib_roce_version_num: int | None = None
    # NCCL_DEBUG: VERSION, WARN, INFO or TRACE.
    # https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-debug
    debug: str | None = None
    # NCCL_DEBUG_SUBSYS: subsystems of the INFO output, e.g. INIT,NET.
    # https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-debug-subsys
    debug_subsys: str | None = None
    # TORCH_DISTRIBUTED_DEBUG: OFF, INFO or DETAIL (checks collective mismatches; slower).
    # https://pytorch.org/docs/stable/distributed.html#torch-distributed-debug
    torch_distributed_debug: str | None = None
    # TORCH_NCCL_ASYNC_ERROR_HANDLING: 0-3, what a failed collective does to the process.
    # https://pytorch.org/docs/stable/torch_nccl_environment_variables.html
    async_error_handling: int | None = None
    # TORCH_NCCL_DUMP_ON_TIMEOUT: the flight recorder dumps its trace when a collective times out.
    # https://pytorch.org/docs/stable/torch_nccl_environment_variables.html
    dump_on_timeout: bool | None = None
    # TORCH_FR_BUFFER_SIZE (torch 2.14's name for TORCH_NCCL_TRACE_BUFFER_SIZE): collectives
    # the flight recorder keeps (0: recorder off).
    # https://pytorch.org/docs/stable/torch_nccl_environment_variables.html
    trace_buffer_size: int | None = None
    # Debugging-only NCCL variables this profile forces on purpose: no warning for them.
    acknowledged_debug: list[str] = field(default_factory=list)
    # Variables exported in every task before the process group exists (checked like the
    # typed fields when they name a known variable).
    env: dict[str, str] = field(default_factory=dict)
    # Anything else, exported the same way; wins over env for the same name.
    extra_env: dict[str, str] = field(default_factory=dict)


#: typed field -> the variable it sets
FIELD_VARS: dict[str, str] = {
    "socket_ifname": "NCCL_SOCKET_IFNAME", "gloo_socket_ifname": "GLOO_SOCKET_IFNAME",
    "ib_disable": "NCCL_IB_DISABLE", "ib_hca": "NCCL_IB_HCA", "gdr_level": "NCCL_NET_GDR_LEVEL",
    "ib_timeout": "NCCL_IB_TIMEOUT", "ib_retry_cnt": "NCCL_IB_RETRY_CNT",
    "cross_nic": "NCCL_CROSS_NIC", "ib_gid_index": "NCCL_IB_GID_INDEX",
    "ib_roce_version_num": "NCCL_IB_ROCE_VERSION_NUM", "debug": "NCCL_DEBUG",
    "debug_subsys": "NCCL_DEBUG_SUBSYS", "torch_distributed_debug": "TORCH_DISTRIBUTED_DEBUG",
    "async_error_handling": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "dump_on_timeout": "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "trace_buffer_size": "TORCH_FR_BUFFER_SIZE",
}
#: Listed under "Debugging" in NCCL's docs: "should generally not be set for production".
DEBUG_ONLY = frozenset({
    "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_P2P_DIRECT_DISABLE", "NCCL_SHM_DISABLE",
    "NCCL_BUFFSIZE", "NCCL_NTHREADS", "NCCL_MAX_NCHANNELS", "NCCL_MIN_NCHANNELS",
    "NCCL_CHECKS_DISABLE", "NCCL_CHECK_POINTERS", "NCCL_LAUNCH_MODE", "NCCL_IB_DISABLE",
    "NCCL_IB_AR_THRESHOLD", "NCCL_IB_QPS_PER_CONNECTION", "NCCL_IB_SPLIT_DATA_ON_QPS",
    "NCCL_IB_CUDA_SUPPORT", "NCCL_IB_PCI_RELAXED_ORDERING", "NCCL_IB_ADAPTIVE_ROUTING",
    "NCCL_IB_ECE_ENABLE", "NCCL_MEM_SYNC_DOMAIN", "NCCL_CUMEM_ENABLE", "NCCL_NET_GDR_LEVEL",
    "NCCL_NET_GDR_C2C", "NCCL_NET_GDR_READ", "NCCL_NET_SHARED_BUFFERS", "NCCL_NET_SHARED_COMMS",
    "NCCL_ALGO", "NCCL_PROTO", "NCCL_NVB_DISABLE", "NCCL_PXN_DISABLE", "NCCL_P2P_PXN_LEVEL",
    "NCCL_RUNTIME_CONNECT", "NCCL_GRAPH_REGISTER", "NCCL_LOCAL_REGISTER", "NCCL_DMABUF_ENABLE",
    "NCCL_P2P_NET_CHUNKSIZE", "NCCL_COMM_BLOCKING", "NCCL_CGA_CLUSTER_SIZE", "NCCL_MAX_CTAS",
    "NCCL_MIN_CTAS", "NCCL_NVLS_ENABLE", "NCCL_IB_MERGE_NICS", "NCCL_MNNVL_ENABLE",
})
#: Old name -> the name read today (PyTorch deprecated the NCCL_ prefix for its own
#: variables; NCCL renamed IB_GDR_LEVEL in 2.4.0).
DEPRECATED = {
    "NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG",
    "NCCL_IB_GDR_LEVEL": "NCCL_NET_GDR_LEVEL",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "TORCH_FR_DUMP_TEMP_FILE",
}
PATH_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS")
DEBUG_SUBSYSTEMS = ("INIT", "COLL", "P2P", "SHM", "NET", "GRAPH", "TUNING", "ENV", "ALLOC",
                    "CALL", "PROXY", "NVLS", "BOOTSTRAP", "REG", "PROFILE", "RAS", "ALL")

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PROFILE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# Linux interface names: at most 15 characters (IFNAMSIZ 16), no '/' or whitespace.
_IFNAME = re.compile(r"^[A-Za-z0-9_.:-]{1,15}$")
_HCA_TOKEN = re.compile(r"^([A-Za-z0-9_.-]+)(?::([0-9]+))?$")

Problem = tuple[str, str]  # (what is wrong, the fix)


def _anchor(var: str) -> str:
    if var.startswith("NCCL_"):
        slug = var.lower().replace("_", "-")
        if var == "NCCL_NET_GDR_LEVEL":
            slug += "-formerly-nccl-ib-gdr-level"
        return f"{NCCL_DOCS}#{slug}"
    if var in ("TORCH_DISTRIBUTED_DEBUG", "GLOO_SOCKET_IFNAME"):
        return DIST_DOCS
    return TORCH_NCCL_DOCS


def _int_range(low: int, high: int, why: str = "") -> Callable[[str], Problem | None]:
    def check(value: str) -> Problem | None:
        if re.fullmatch(r"-?[0-9]+", value.strip()) and low <= int(value) <= high:
            return None
        return (f"must be an integer {low}-{high}{'; ' + why if why else ''}.",
                f"use a value from {low} to {high}.")
    return check


def _choice(*allowed: str, fold: bool = False) -> Callable[[str], Problem | None]:
    def check(value: str) -> Problem | None:
        if (value.upper() if fold else value) in allowed:
            return None
        return f"must be one of {', '.join(allowed)}.", f"use one of {', '.join(allowed)}."
    return check


def _path_level(value: str) -> Problem | None:
    if re.fullmatch(r"[0-9]+", value.strip()):
        return ("is a legacy integer level: NCCL kept integers only for old scripts and their "
                "meaning changed as path types were added (values above 4 mean SYS).",
                "use a name: LOC (never), PIX (same PCI switch), PXB (across PCI switches), "
                "PHB (same NUMA node, through the CPU) or SYS (anywhere).")
    return _choice(*PATH_LEVELS)(value)


def _ifnames(nccl_syntax: bool) -> Callable[[str], Problem | None]:
    def check(value: str) -> Problem | None:
        body = value
        if nccl_syntax:
            body = body.removeprefix("^").removeprefix("=")
        elif body[:1] in ("^", "="):
            return ("Gloo takes exact interface names only; `^` and `=` are NCCL's syntax.",
                    "list the names, e.g. eth0 or eth0,eth1.")
        names = body.split(",")
        bad = [n for n in names if not _IFNAME.match(n)]
        if bad:
            return (f"{bad[0]!r} is not an interface name (up to 15 letters, digits, _ . : -; "
                    "comma-separated, no spaces or empty items).",
                    "use e.g. eth0, =ib0 or ^docker,lo (see `ip -br link`).")
        return None
    return check


def _ib_hca(value: str) -> Problem | None:
    body = value.removeprefix("^").removeprefix("=")
    for token in body.split(","):
        match = _HCA_TOKEN.match(token)
        if not match or (match.group(2) is not None and int(match.group(2)) < 1):
            return (f"{token!r} is not `hca` or `hca:port` (ports count from 1; comma-separated; "
                    "optional `^` then `=` prefix for the whole list).",
                    "use e.g. =mlx5_0:1,mlx5_1:1 (see `ibstat` or /sys/class/infiniband).")
    if len(body.split(",")) > 32:
        return "names more than 32 HCAs, NCCL's fixed limit.", "list at most 32."
    return None


def _debug_subsys(value: str) -> Problem | None:
    tokens = [t.removeprefix("^") for t in value.split(",")]
    if any(not t for t in tokens):
        return "has an empty item.", "use e.g. INIT,NET or ^COLL."
    return None


_BOOL = _choice("0", "1")
#: variable -> check of its value (None: fine; else (problem, fix))
RULES: dict[str, Callable[[str], Problem | None]] = {
    "NCCL_SOCKET_IFNAME": _ifnames(True), "NCCL_OOB_NET_IFNAME": _ifnames(True),
    "GLOO_SOCKET_IFNAME": _ifnames(False), "NCCL_IB_HCA": _ib_hca,
    "NCCL_NET_GDR_LEVEL": _path_level, "NCCL_P2P_LEVEL": lambda v: (
        None if v == "NVL" else _path_level(v)),
    "NCCL_IB_TIMEOUT": _int_range(1, 31, "0 or 32 and above mean an infinite timeout: a dead "
                                  "link would hang the job instead of failing it"),
    "NCCL_IB_RETRY_CNT": _int_range(0, 7, "the InfiniBand retry counter has 3 bits"),
    "NCCL_CROSS_NIC": _int_range(0, 2), "NCCL_IB_GID_INDEX": _int_range(-1, 255),
    "NCCL_IB_ROCE_VERSION_NUM": _int_range(1, 2), "NCCL_IB_SL": _int_range(0, 15),
    "NCCL_IB_TC": _int_range(0, 255), "NCCL_IB_DISABLE": _BOOL, "NCCL_P2P_DISABLE": _BOOL,
    "NCCL_SHM_DISABLE": _BOOL, "NCCL_DEBUG": _choice("VERSION", "WARN", "INFO", "TRACE",
                                                     fold=True),
    "NCCL_DEBUG_SUBSYS": _debug_subsys,
    "TORCH_DISTRIBUTED_DEBUG": _choice("OFF", "INFO", "DETAIL", fold=True),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": _int_range(0, 3), "TORCH_NCCL_BLOCKING_WAIT": _BOOL,
    "TORCH_NCCL_DUMP_ON_TIMEOUT": _BOOL, "TORCH_NCCL_DESYNC_DEBUG": _BOOL,
    "TORCH_NCCL_TRACE_BUFFER_SIZE": _int_range(0, 10**9),
    "TORCH_FR_BUFFER_SIZE": _int_range(0, 10**9),
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": _int_range(1, 10**7),
}


@dataclass(frozen=True)
class Setting:
    """One variable the config sets, with the key it came from (for messages)."""
    key: str
    var: str
    value: str


def _render(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def settings(cfg: NcclConfig) -> list[Setting]:
    """Every (key, variable, value) the config sets, in precedence order (later wins):
    typed fields, then ``env``, then ``extra_env``; deprecated names are renamed."""
    found = [Setting(f"nccl.{name}", var, _render(getattr(cfg, name)))
             for name, var in FIELD_VARS.items() if getattr(cfg, name) is not None]
    for section, values in (("env", cfg.env), ("extra_env", cfg.extra_env)):
        for name, value in values.items():
            found.append(Setting(f"nccl.{section}.{name}", DEPRECATED.get(name, name),
                                 _render(value)))
    return found


def wanted_env(cfg: NcclConfig) -> dict[str, str]:
    """variable -> value the config exports (validated configs only)."""
    return {s.var: s.value for s in settings(cfg)}


def validate_nccl(cfg: NcclConfig) -> None:
    """Refuse what NCCL or PyTorch would misread; UserError names the key, range and fix."""
    if not _PROFILE.match(cfg.profile):
        raise UserError("nccl.profile", cfg.profile, "is not a plain name.",
                        "use letters, digits and _ . - only.")
    for section, values in (("nccl.env", cfg.env), ("nccl.extra_env", cfg.extra_env)):
        for name, value in values.items():
            if not _ENV_NAME.match(name):
                raise UserError(f"{section}.{name}", value, "is not an environment variable name.",
                                "use letters, digits and _ only, e.g. NCCL_DEBUG.")
    for name in cfg.acknowledged_debug:
        if name not in DEBUG_ONLY:
            raise UserError("nccl.acknowledged_debug", name,
                            "is not one of NCCL's debugging-only variables.",
                            f"list only names from {NCCL_DOCS}#debugging.")
    typed: dict[str, Setting] = {}
    for item in settings(cfg):
        rule = RULES.get(item.var)
        problem = rule(item.value) if rule else None
        if problem:
            raise UserError(item.key, item.value, f"{item.var} {problem[0]}",
                            f"{problem[1]} See {_anchor(item.var)}")
        first = typed.get(item.var)
        if first and first.key.count(".") == 1 and first.value != item.value:
            raise UserError(item.key, item.value, f"sets {item.var} again; {first.key}="
                            f"{first.value} already sets it.", f"set it once, through {first.key}.")
        typed.setdefault(item.var, item)


def nccl_warnings(cfg: NcclConfig) -> list[str]:
    """Legal but risky settings, one line each (logged by every rank, shown by the doctor)."""
    out: list[str] = []
    wanted = wanted_env(cfg)
    for item in settings(cfg):
        old = item.key.rsplit(".", 1)[-1]
        if old in DEPRECATED:
            out.append(f"{item.key}: {old} is deprecated; exported as {DEPRECATED[old]} instead "
                       f"(see {_anchor(DEPRECATED[old])}).")
        if (item.var in DEBUG_ONLY and cfg.profile != "debug"
                and item.var not in cfg.acknowledged_debug):
            out.append(f"{item.key}={item.value}: NCCL's docs list {item.var} under Debugging "
                       "(\"should generally not be set for production\"): keep it only as a "
                       f"workaround, or add it to nccl.acknowledged_debug ({NCCL_DOCS}#debugging).")
    hca = wanted.get("NCCL_IB_HCA", "")
    if hca and not hca.removeprefix("^").startswith("="):
        # Device names end in _<n> (mlx5_1, hfi1_0); a family prefix (mlx5) is meant as one.
        # Other shapes are caught on the node, against the HCAs it has (nccl.node_warnings).
        trapped = [t.split(":")[0] for t in hca.removeprefix("^").split(",")
                   if re.search(r"_[0-9]+$", t.split(":")[0])]
        if trapped:
            exact = ("^=" if hca.startswith("^") else "=") + hca.removeprefix("^")
            out.append(f"NCCL_IB_HCA={hca}: without `=` each name is a prefix, so {trapped[0]} "
                       f"also selects {trapped[0]}0..{trapped[0]}9 if they exist; write {exact} "
                       f"for exact names ({_anchor('NCCL_IB_HCA')}).")
    unknown = [t for t in wanted.get("NCCL_DEBUG_SUBSYS", "").split(",")
               if t and t.removeprefix("^").upper() not in DEBUG_SUBSYSTEMS]
    if unknown:
        out.append(f"NCCL_DEBUG_SUBSYS: {unknown[0]} is not a subsystem NCCL documents "
                   f"({', '.join(DEBUG_SUBSYSTEMS)}); NCCL ignores unknown names.")
    if "NCCL_IB_ROCE_VERSION_NUM" in wanted and wanted.get("NCCL_IB_GID_INDEX", "-1") != "-1":
        out.append("NCCL_IB_ROCE_VERSION_NUM only steers the GID NCCL picks itself; with "
                   "NCCL_IB_GID_INDEX set it is ignored.")
    if wanted.get("TORCH_NCCL_DUMP_ON_TIMEOUT") == "1" and wanted.get(
            "TORCH_FR_BUFFER_SIZE", "0") == "0":
        out.append("TORCH_NCCL_DUMP_ON_TIMEOUT=1 records nothing while "
                   "TORCH_FR_BUFFER_SIZE is 0: set nccl.trace_buffer_size (e.g. 2000).")
    if wanted.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL" and cfg.profile != "debug":
        out.append("TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective and slows training; "
                   "use it to debug, not for production runs.")
    return out
