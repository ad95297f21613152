"""A straggler node: one node's processes capped to a fraction of a CPU (cgroup v1 cpu).

``straggle(cfg, "node3", 0.5)`` makes a cgroup ``hpc_ddp_testcluster_node3`` under the cpu
controller with a CFS quota of half a CPU and moves every process of that node into it: its
slurmd and whatever runs in its network namespace (slurmstepd is started by a double fork, so
it is not slurmd's descendant, but it lives in the node's namespace). Later jobs there are
forked by slurmd or slurmstepd and inherit the cgroup: the test cluster tracks processes
with proctrack/linuxproc and no cgroup plugin (docs/testcluster.md), so Slurm never moves
them elsewhere. ``unstraggle`` moves them back to the root cgroup and removes the folder.

CFS bandwidth control: a group may run ``cpu.cfs_quota_us`` in every ``cpu.cfs_period_us``
(https://docs.kernel.org/scheduler/sched-bwc.html); ``cgroup.procs`` moves a whole process
(https://docs.kernel.org/admin-guide/cgroup-v1/cgroups.html).
"""

from __future__ import annotations

import errno
import math
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from hpc_ddp.errors import UserError
from hpc_ddp.testcluster import daemons, network
from hpc_ddp.testcluster.config import ClusterConfig
from hpc_ddp.testcluster.shaping import MachineLacks, ShapingError, running_nodes

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
PREFIX = "hpc_ddp_testcluster_"
# sched-bwc: the default period (the longest used here); the quota may be as small as 1 ms.
PERIOD_US = 100_000
MIN_QUOTA_US = 1_000
# The shortest period used: a capped node is slow evenly, in 10 ms windows. With the default
# 100 ms a rank's 5 ms of compute ran at full speed inside its 10 ms of quota (0.1 CPU) and
# the throttle fell on its all-reduce instead: a straggler read as a slow fabric (seen in CI).
SHORT_PERIOD_US = 10_000


def period_for(cpu: float) -> int:
    """The shortest period (10 ms up to 100 ms) whose quota for ``cpu`` is 1 ms or more."""
    return min(PERIOD_US, max(SHORT_PERIOD_US, math.ceil(MIN_QUOTA_US / cpu)))


def check_cpu(cpu: float, key: str = "--cpu") -> float:
    """``cpu`` if it is a share of CPUs this machine can cap to (0.01 .. its CPU count)."""
    most = os.cpu_count() or 1
    if not (math.isfinite(cpu) and MIN_QUOTA_US / PERIOD_US <= cpu <= most):
        raise UserError(key, cpu, f"must be between 0.01 and {most} (this machine's CPUs).",
                        "e.g. --cpu 0.5 for half of one CPU.")
    return cpu


def controller_missing(root: Path = CPU_CGROUP) -> str | None:
    """What is missing for a CPU cap under ``root``, with the fix; None if nothing."""
    if (root / "cpu.cfs_quota_us").is_file():
        return None
    return (f"{root}/cpu.cfs_quota_us does not exist: the cgroup v1 cpu controller (with "
            f"CONFIG_CFS_BANDWIDTH) is not mounted at {root}. Fix: "
            f"`mkdir -p {root} && mount -t cgroup -o cpu cgroup {root}` as root "
            "(a machine with cgroup v2 alone is not supported)")


def _move(pid: int, procs: Path) -> bool:
    """Move ``pid`` into the cgroup whose ``cgroup.procs`` is ``procs``; False if it is gone."""
    try:
        procs.write_text(f"{pid}\n")
    except OSError as e:
        if e.errno == errno.ESRCH:
            return False
        raise
    return True


def cap(group: Path, cpu: float, pids: Iterable[int]) -> list[int]:
    """Make ``group`` (a cgroup folder under a cpu controller) with a quota of ``cpu`` CPUs and
    move ``pids`` into it; returns those moved (the others had exited)."""
    check_cpu(cpu, "cpu")
    missing = controller_missing(group.parent)
    if missing:
        raise MachineLacks(missing)
    group.mkdir(exist_ok=True)
    period = period_for(cpu)
    # The quota first when the period shrinks: the kernel refuses a quota/period pair above
    # the parent's at any moment (a shorter period with the old, longer quota would be one).
    (group / "cpu.cfs_quota_us").write_text("-1\n")
    (group / "cpu.cfs_period_us").write_text(f"{period}\n")
    (group / "cpu.cfs_quota_us").write_text(f"{round(cpu * period)}\n")
    return [pid for pid in dict.fromkeys(pids) if _move(pid, group / "cgroup.procs")]


def cap_of(group: Path) -> float | None:
    """The CPUs ``group`` may use (quota / period), None if it is gone or not capped."""
    try:
        quota = int((group / "cpu.cfs_quota_us").read_text())
        period = int((group / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 else None


def uncap(group: Path, root: Path = CPU_CGROUP, timeout: float = 5.0) -> None:
    """Move every process of ``group`` into ``root`` and remove the folder; a missing one is
    fine. A process forked while we move the others lands in ``group``: so again until the
    folder can be removed."""
    deadline = time.monotonic() + timeout
    while group.is_dir():
        try:
            for pid in (group / "cgroup.procs").read_text().split():
                _move(int(pid), root / "cgroup.procs")
            group.rmdir()
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise ShapingError(f"cannot remove {group}: {e}") from e
            time.sleep(0.05)


# --- the cluster's nodes --------------------------------------------------------------------
def group_of(node: str, root: Path = CPU_CGROUP) -> Path:
    return root / f"{PREFIX}{node}"


def straggle(cfg: ClusterConfig, node: str, cpu: float, *, root: Path = CPU_CGROUP) -> int:
    """Cap ``node`` (its slurmd, its jobs' processes, those started later) at ``cpu`` CPUs;
    returns how many processes were moved. Calling it again changes the cap."""
    check_cpu(cpu)
    running = running_nodes(cfg)
    if node not in running:
        raise UserError("--node", node, "is not a node of the running test cluster.",
                        f"choose from {', '.join(running) or 'none (start it first: up)'}.")
    missing = controller_missing(root)
    if missing:
        raise MachineLacks(missing)
    slurmd = daemons.daemon_pid(cfg, f"slurmd-{node}")
    if slurmd is None:
        raise ShapingError(f"slurmd of {node} is not running (no live pid in "
                           f"{cfg.pid_file(f'slurmd-{node}')}); start the cluster: up --fresh")
    group = group_of(node, root)
    moved = set(cap(group, cpu, [slurmd, *network.netns_pids(cfg, node)]))
    # Once more: a process forked by one not yet moved was born outside the group.
    moved |= set(cap(group, cpu, network.netns_pids(cfg, node)))
    return len(moved)


def stragglers(cfg: ClusterConfig, *, root: Path = CPU_CGROUP) -> dict[str, float]:
    """Node -> the CPUs it is capped at, for every straggler group in place."""
    if not root.is_dir():
        return {}
    found = {node: cap_of(root / f"{PREFIX}{node}") for node in _groups(cfg, root)}
    return {node: cpu for node, cpu in found.items() if cpu is not None}


def _groups(cfg: ClusterConfig, root: Path) -> list[str]:
    """The nodes of this cluster with a straggler group (another cluster on this machine
    names its nodes with another prefix: config.instance_settings)."""
    names = (p.name.removeprefix(PREFIX) for p in sorted(root.glob(f"{PREFIX}*")) if p.is_dir())
    return [n for n in names if n.removeprefix(cfg.node_prefix).isdigit()
            and n.startswith(cfg.node_prefix)]


def unstraggle(cfg: ClusterConfig, nodes: Sequence[str] | None = None, *,
               root: Path = CPU_CGROUP) -> list[str]:
    """Move ``nodes``' processes (default: every straggler's) back to the root cgroup and
    remove their groups; returns the nodes released. Idempotent."""
    if not root.is_dir():
        return []
    names = _groups(cfg, root) if nodes is None else list(nodes)
    released = [n for n in names if group_of(n, root).is_dir()]
    for node in released:
        uncap(group_of(node, root), root)
    return released
