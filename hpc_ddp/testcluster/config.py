"""The test cluster's shape and its configuration files, as pure functions of a dataclass.

Nothing here touches the machine: :class:`ClusterConfig` says what the cluster looks like, and
``render_*`` turn it into the text of slurm.conf, gres.conf and slurmdbd.conf. The facts each
setting relies on are in docs/testcluster.md, "Why it is set up this way" (cited below as
"recipe").
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_STATE_DIR = Path("/tmp/hpc_ddp_testcluster")
STATE_DIR_ENV = "HPC_DDP_TESTCLUSTER_DIR"
# Clusters 0..MAX_INSTANCES-1 can run side by side on one machine (instance_settings).
MAX_INSTANCES = 8


def default_state_dir() -> Path:
    """The state folder: ``$HPC_DDP_TESTCLUSTER_DIR`` or /tmp/hpc_ddp_testcluster."""
    return Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)


def instance_settings(instance: int) -> dict[str, object]:
    """The :class:`ClusterConfig` fields of test cluster number ``instance``: 0 is the default
    cluster (node1.., 10.77.0.0/24, ports 6817-6819); cluster 1 is ``hpcddpb`` with nodes
    bnode1.. in 10.78.0.0/24 and ports 6827-6829, and so on. Every name the machine shares
    (state folder, bridges, namespaces, veths, node names in /etc/hosts, ports, database,
    straggler cgroups) differs, so the test suite runs two chains of cluster tests at once,
    one cluster each (tests/conftest.py)."""
    if not 0 <= instance < MAX_INSTANCES:
        raise ValueError(f"instance must be 0..{MAX_INSTANCES - 1}, got {instance}")
    if instance == 0:
        return {}
    letter = "abcdefgh"[instance]
    return {
        "instance": instance,
        "state_dir": Path(f"{default_state_dir()}-{letter}"),
        "subnet": f"10.{77 + instance}.0.0/24",
        "fast_subnet": f"fd{77 + instance}::/64",
        "bridge": f"hpcddp{letter}0",
        "fast_bridge": f"hpcddp{letter}1",
        "cluster_name": f"hpcddp{letter}",
        "db_name": f"hpc_ddp_testcluster_{letter}_acct",
        "node_prefix": f"{letter}node",
        "ns_prefix": f"hpcddp{letter}",
        "port_base": 6817 + 10 * instance,
    }


@dataclass(frozen=True)
class Partition:
    """One Slurm partition over all nodes."""

    name: str
    # Higher tier preempts lower tier (PreemptType=preempt/partition_prio).
    priority_tier: int
    default: bool = False
    # Seconds between the preemption signal and the requeue; the job checkpoints in between.
    grace_time: int | None = None
    preempt_mode: str | None = None


def default_partitions() -> tuple[Partition, ...]:
    # Recipe, "Preemption and requeue": a normal partition that can be preempted (with a grace
    # time for the checkpoint) and an urgent one on the same nodes that preempts it.
    return (
        Partition("normal", priority_tier=1, default=True, grace_time=30, preempt_mode="REQUEUE"),
        Partition("urgent", priority_tier=2),
    )


@dataclass(frozen=True)
class ClusterConfig:
    """Everything that decides what the cluster looks like; the files follow from it."""

    # Where every file the cluster writes lives (confs, spool, logs, pid files).
    state_dir: Path = field(default_factory=default_state_dir)
    nodes: int = 4
    cpus: int = 2
    # Fake GPUs per node through GRES; 0 disables GRES altogether.
    gpus: int = 2
    real_memory_mb: int = 3000
    # The bridge in the root namespace; the controller listens on its address.
    subnet: str = "10.77.0.0/24"
    bridge: str = "hpcddp0"
    # Node i (1-based) gets host number first_node_host + i - 1 in the subnet: 10.77.0.11 ...
    first_node_host: int = 11
    # A second, IPv6-only network on every node's `ib0` (host numbers as above: fd77::b ...):
    # the "fast fabric" that node names do not resolve to, as on clusters whose host names
    # are the management network (cluster.master_interface=ib0 is tested on it).
    fast_subnet: str = "fd77::/64"
    fast_bridge: str = "hpcddp1"
    fast_interface: str = "ib0"
    cluster_name: str = "hpcddp"
    # Recipe: the controller's name must be this machine's real hostname, or slurmctld exits
    # with "This host not a valid controller".
    controller_name: str = field(default_factory=socket.gethostname)
    # A dedicated accounting database, dropped and recreated by a fresh `up`.
    db_name: str = "hpc_ddp_testcluster_acct"
    db_user: str = "hpcddp_slurm"
    db_password: str = "hpcddp_slurm"
    partitions: tuple[Partition, ...] = field(default_factory=default_partitions)
    # Bind every task to the CPUs it was allocated (task/affinity), for a test that proves
    # cpus_per_task reaches each rank. Off by default: the four nodes share this machine's
    # cores and 22.05's task/affinity confines each task to its allocation even with
    # --cpu-bind=none, so every node's 1-CPU task would run on the same physical core 0
    # (the suite ran ~1.5x slower).
    task_affinity: bool = False
    # Which of the clusters that can run side by side this is (instance_settings), and the
    # names and ports that keep it apart from the others.
    instance: int = 0
    node_prefix: str = "node"
    ns_prefix: str = "hpcddp"
    # slurmctld listens on port_base, slurmd on port_base + 1, slurmdbd on port_base + 2.
    port_base: int = 6817

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.nodes}")
        if self.gpus < 0:
            raise ValueError(f"gpus must be >= 0, got {self.gpus}")
        net = ipaddress.ip_network(self.subnet)
        if self.first_node_host + self.nodes >= net.num_addresses - 1:
            raise ValueError(f"{self.nodes} nodes do not fit in {self.subnet}")

    # --- names and addresses -------------------------------------------------------------
    @property
    def node_names(self) -> list[str]:
        return [f"{self.node_prefix}{i}" for i in range(1, self.nodes + 1)]

    @property
    def node_addresses(self) -> dict[str, str]:
        return self._addresses_in(self.subnet)

    @property
    def fast_addresses(self) -> dict[str, str]:
        return self._addresses_in(self.fast_subnet)

    def _addresses_in(self, subnet: str) -> dict[str, str]:
        net = ipaddress.ip_network(subnet)
        return {
            name: str(net.network_address + self.first_node_host + i)
            for i, name in enumerate(self.node_names)
        }

    def fast_veth(self, node: str) -> str:
        return f"{self.ns_prefix}f-{node.removeprefix(self.node_prefix)}"

    @property
    def controller_address(self) -> str:
        return str(ipaddress.ip_network(self.subnet).network_address + 1)

    @property
    def prefix_len(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen

    def netns(self, node: str) -> str:
        return f"{self.ns_prefix}-{node}"

    def host_veth(self, node: str) -> str:
        # The root-namespace end of the node's veth pair (IFNAMSIZ: at most 15 characters).
        return f"{self.ns_prefix}-{node.removeprefix(self.node_prefix)}"

    @property
    def hosts_marker(self) -> str:
        """What marks this cluster's block in /etc/hosts (each cluster has its own)."""
        suffix = "" if self.instance == 0 else f" {self.cluster_name}"
        return f"hpc_ddp testcluster{suffix}"

    @property
    def slurmdbd_port(self) -> int:
        return self.port_base + 2

    @property
    def gpu_devices(self) -> list[Path]:
        return [Path(f"/dev/fakegpu{i}") for i in range(self.gpus)]

    # --- paths under the state folder ------------------------------------------------------
    @property
    def slurm_conf(self) -> Path:
        return self.state_dir / "slurm.conf"

    @property
    def gres_conf(self) -> Path:
        # Recipe: gres.conf and slurmdbd.conf are found beside slurm.conf (SLURM_CONF's folder).
        return self.state_dir / "gres.conf"

    @property
    def slurmdbd_conf(self) -> Path:
        return self.state_dir / "slurmdbd.conf"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def pid_dir(self) -> Path:
        return self.state_dir / "pids"

    @property
    def ctld_state_dir(self) -> Path:
        return self.state_dir / "ctld-state"

    def pid_file(self, daemon: str) -> Path:
        """Pid file of ``slurmctld``, ``slurmdbd``, ``slurmd-nodeN``, ``munged``, ``mariadb``.

        munged and mariadb get one only when this cluster started them (so ``down`` stops
        only what ``up`` started).
        """
        return self.pid_dir / f"{daemon}.pid"

    def log_file(self, daemon: str) -> Path:
        return self.log_dir / f"{daemon}.log"

    @property
    def task_prolog(self) -> Path:
        return self.state_dir / "task-prolog.sh"

    @property
    def node_env_dir(self) -> Path:
        """Per-node variables for every task started there (TaskProlog; node_environment)."""
        return self.state_dir / "node-env"


def render_task_prolog(cfg: ClusterConfig) -> str:
    """TaskProlog: a node's own variables (node-env/<node>, lines ``export NAME=value``) for
    every task started on it, as a site's node-local setup would give them; a test makes one
    node differ this way (https://slurm.schedmd.com/prolog_epilog.html: TaskProlog's
    ``export`` lines become the task's environment). A requeue signal that reaches the step
    while it runs (a 1-minute limit's warning can come at the step's start) is not its end,
    nor the task's: slurmstepd fails a task whose TaskProlog dies, and the task that does not
    exist yet is left to the rank's own resend (rank/services/lost_signal.py).

    Every task also gets OMP_WAIT_POLICY=PASSIVE unless its job set one: the nodes share this
    machine's cores, and an OpenMP thread of torch's intra-op pool (more than one where a job
    asks cluster.cpus_per_task=2) otherwise spins at each barrier on a core another node's
    rank is waiting for (libgomp's default; 4 processes of 2 threads training on 2 cores
    spent ~5x the CPU: https://gcc.gnu.org/onlinedocs/libgomp/OMP_005fWAIT_005fPOLICY.html)."""
    return (
        "#!/bin/sh\n# Written by hpc_ddp.testcluster.\ntrap '' USR1 USR2\n"
        '[ -n "${OMP_WAIT_POLICY+x}" ] || echo "export OMP_WAIT_POLICY=PASSIVE"\n'
        f'f={cfg.node_env_dir}/"$(hostname)"\n'
        '[ -f "$f" ] && cat "$f"\nexit 0\n'
    )


def _hostlist(names: list[str]) -> str:
    # A plain comma list: Slurm accepts it everywhere and it needs no range compression.
    return ",".join(names)


def render_node_lines(cfg: ClusterConfig) -> list[str]:
    gres = f" Gres=gpu:{cfg.gpus}" if cfg.gpus else ""
    return [
        # One line per node: each has its own NodeAddr inside its namespace.
        f"NodeName={name} NodeAddr={addr} CPUs={cfg.cpus} RealMemory={cfg.real_memory_mb}"
        f"{gres} State=UNKNOWN"
        for name, addr in cfg.node_addresses.items()
    ]


def render_partition_line(cfg: ClusterConfig, part: Partition) -> str:
    words = [
        f"PartitionName={part.name}",
        f"Nodes={_hostlist(cfg.node_names)}",
        f"Default={'YES' if part.default else 'NO'}",
        f"PriorityTier={part.priority_tier}",
    ]
    if part.grace_time is not None:
        words.append(f"GraceTime={part.grace_time}")
    if part.preempt_mode is not None:
        words.append(f"PreemptMode={part.preempt_mode}")
    words += ["MaxTime=INFINITE", "State=UP"]
    return " ".join(words)


def render_slurm_conf(cfg: ClusterConfig) -> str:
    """The text of slurm.conf for ``cfg``."""
    s = cfg.state_dir
    lines = [
        "# Written by hpc_ddp.testcluster; regenerated by every fresh `up`.",
        f"ClusterName={cfg.cluster_name}",
        f"SlurmctldHost={cfg.controller_name}({cfg.controller_address})",
        # Recipe: daemons as root, munge for authentication.
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        f"SlurmctldPort={cfg.port_base}",
        f"SlurmdPort={cfg.port_base + 1}",
        f"StateSaveLocation={cfg.ctld_state_dir}",
        # Recipe: %n makes per-node paths so several slurmds share one slurm.conf.
        f"SlurmdSpoolDir={s}/spool-%n",
        f"SlurmctldPidFile={cfg.pid_file('slurmctld')}",
        f"SlurmdPidFile={cfg.pid_dir}/slurmd-%n.pid",
        f"SlurmctldLogFile={cfg.log_file('slurmctld')}",
        f"SlurmdLogFile={cfg.log_dir}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # Recipe: no cgroups inside the namespaces, so track and bind tasks without them.
        "ProctrackType=proctrack/linuxproc",
        # No binding unless asked (see ClusterConfig.task_affinity). A rank's cores are
        # recorded in ranks/rank<N>.json. https://slurm.schedmd.com/slurm.conf.html#OPT_TaskPlugin
        f"TaskPlugin=task/{'affinity' if cfg.task_affinity else 'none'}",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        # Every slurmd sees the whole machine; take CPUs/RealMemory from slurm.conf instead,
        # so the node shape does not depend on the host (e.g. 4 x 2 CPUs on a 1-core runner).
        "SlurmdParameters=config_overrides",
        # A node that registers after a restart comes back idle on its own.
        "ReturnToService=2",
        "MpiDefault=none",
        "SwitchType=switch/none",
        # Recipe, "Accounting": sacct works as on real clusters (submitit polls it).
        "AccountingStorageType=accounting_storage/slurmdbd",
        # The bridge's address (slurmdbd listens on all of them), not localhost: sacct run
        # inside a namespace (the login node, a node's job) reaches it too.
        f"AccountingStorageHost={cfg.controller_address}",
        f"AccountingStoragePort={cfg.slurmdbd_port}",
        "JobAcctGatherType=jobacct_gather/linux",
        "JobCompType=jobcomp/none",
        # Recipe, "Preemption and requeue" (in 22.05 PreemptParameters= is not a valid key).
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        "SlurmctldParameters=preempt_send_user_signal",
        "JobRequeue=1",
        "MaxArraySize=10",
        # Fast tests: short kill grace, frequent scheduling, forget finished jobs after 5 min.
        "MinJobAge=300",
        "KillWait=5",
        "InactiveLimit=0",
        "MessageTimeout=20",
        "SlurmdTimeout=60",
        "SlurmctldTimeout=30",
        "Waittime=0",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=5,bf_interval=5",
        "SchedulerTimeSlice=5",
        f"TaskProlog={cfg.task_prolog}",
    ]
    if cfg.gpus:
        lines.append("GresTypes=gpu")
    lines += render_node_lines(cfg)
    lines += [render_partition_line(cfg, p) for p in cfg.partitions]
    return "\n".join(lines) + "\n"


def render_gres_conf(cfg: ClusterConfig) -> str:
    """The text of gres.conf: ``gpus`` fake devices (recipe, "Fake GPUs"); empty when 0."""
    if not cfg.gpus:
        return "# No GRES configured (gpus=0).\n"
    files = "/dev/fakegpu0" if cfg.gpus == 1 else f"/dev/fakegpu[0-{cfg.gpus - 1}]"
    return f"Name=gpu File={files}\n"


def render_slurmdbd_conf(cfg: ClusterConfig) -> str:
    """The text of slurmdbd.conf (recipe, "Accounting"); it must be mode 600."""
    return (
        "\n".join(
            [
                "# Written by hpc_ddp.testcluster.",
                "AuthType=auth/munge",
                "DbdHost=localhost",
                f"DbdPort={cfg.slurmdbd_port}",
                "SlurmUser=root",
                f"LogFile={cfg.log_file('slurmdbd')}",
                f"PidFile={cfg.pid_file('slurmdbd')}",
                "StorageType=accounting_storage/mysql",
                # localhost: the client library talks to MariaDB over its unix socket.
                "StorageHost=localhost",
                f"StorageUser={cfg.db_user}",
                f"StoragePass={cfg.db_password}",
                f"StorageLoc={cfg.db_name}",
            ]
        )
        + "\n"
    )


def render_hosts_block(cfg: ClusterConfig) -> list[str]:
    """/etc/hosts lines: gloo and init_process_group resolve MASTER_ADDR through them."""
    lines = [f"{cfg.controller_address}\t{cfg.controller_name}"]
    lines += [f"{addr}\t{name}" for name, addr in cfg.node_addresses.items()]
    return lines


def fingerprint(cfg: ClusterConfig) -> str:
    """A string that changes whenever a running cluster would have to be restarted."""
    return render_slurm_conf(cfg) + render_gres_conf(cfg) + render_slurmdbd_conf(cfg)
