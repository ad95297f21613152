"""Can the job ever start? What one ``sinfo`` says about the partitions, before sbatch.

A job no node of its partition can hold (``nodes=8`` on a 4-node partition, more CPUs, memory
or GPUs per node than any node has, a time or node limit above the partition's) is accepted
by Slurm and pends forever, or refused by sbatch with words that name no key. Here it is
refused with exit 2 and the key, the value and the fix, from ONE ``sinfo`` call per
submission (a whole sweep included).

Only what Slurm would never run is refused: nodes that are busy, down or drained still
count (they come back); whatever cannot be told from sinfo (constraints, reservations,
accounts, a QOS that may exceed the partition's limits, another cluster) is left to sbatch
and to the pending reason ``status`` shows (slurm_reasons). Heterogeneous partitions are
counted node group by node group (``sinfo -e``).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpc_ddp.config.schema import Config
from hpc_ddp.errors import UserError

# Partition (default marked *), nodes, CPUs, memory (MB), GRES, MaxTime, job size
# (MinNodes-MaxNodes), node names: one line per partition and node shape with -e (exact:
# nodes are grouped only when their CPUs and memory are the same), -a: hidden partitions too.
# https://slurm.schedmd.com/sinfo.html#OPT_format
SINFO_FORMAT = "%P|%D|%c|%m|%G|%l|%s|%N"
# Options that let a job past a check here (sbatch_extra keys, or SBATCH_* variables, which
# override the script's #SBATCH lines: https://slurm.schedmd.com/sbatch.html#SECTION_INPUT-ENVIRONMENT-VARIABLES).
_RELAXING_OPTIONS = {"clusters": "all", "overcommit": "cpus", "time-min": "time"}
_RELAXING_ENV = {"SBATCH_CLUSTERS": "all", "SLURM_CLUSTERS": "all", "SBATCH_OVERCOMMIT": "cpus",
                 "SBATCH_MEM_PER_NODE": "mem", "SBATCH_MEM_PER_CPU": "mem",
                 "SBATCH_MEM_PER_GPU": "mem", "SBATCH_GPUS": "gpus",
                 "SBATCH_GPUS_PER_NODE": "gpus", "SBATCH_GPUS_PER_TASK": "gpus",
                 "SBATCH_TIMELIMIT": "time"}


@dataclass(frozen=True)
class NodeGroup:
    """Nodes of one shape in a partition (None: sinfo did not say)."""

    count: int
    cpus: int | None
    memory_mb: int | None
    gpus: int
    names: str = ""


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool = False
    max_time_min: int | None = None  # None: unlimited (or not said)
    min_nodes: int = 1
    max_nodes: int | None = None
    groups: tuple[NodeGroup, ...] = ()

    @property
    def total_nodes(self) -> int:
        return sum(g.count for g in self.groups)


def partitions(environ: Mapping[str, str]) -> dict[str, Partition] | None:
    """The cluster's partitions from one ``sinfo`` call; None when sinfo gives nothing."""
    try:
        done = subprocess.run(["sinfo", "-a", "-e", "-h", "-o", SINFO_FORMAT],
                              env=dict(environ), capture_output=True, text=True, timeout=30,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = parse_sinfo(done.stdout) if done.returncode == 0 else {}
    return found or None


def parse_sinfo(text: str) -> dict[str, Partition]:
    """``sinfo -a -e -h -o SINFO_FORMAT`` -> {name: Partition}."""
    found: dict[str, Partition] = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 8 or not fields[0]:
            continue
        name, count, cpus, memory, gres, limit, size, names = fields
        group = NodeGroup(_int(count) or 0, _int(cpus), _int(memory), gpu_count(gres), names)
        low, _, high = size.partition("-")
        before = found.get(name.rstrip("*"))
        found[name.rstrip("*")] = Partition(
            name.rstrip("*"), name.endswith("*"), minutes(limit), _int(low) or 1,
            _int(high if high else low), (*(before.groups if before else ()), group))
    return found


def gpu_count(gres: str) -> int:
    """GPUs per node in sinfo's GRES column: "gpu:2", "gpu:a100:4(S:0-1)", "gpu:4,shard:8",
    "gpu:a100:2,gpu:v100:1" (3), "(null)" (0)."""
    total = 0
    for entry in re.sub(r"\([^)]*\)", "", gres).split(","):
        parts = entry.strip().split(":")
        if parts[0] == "gpu" and len(parts) > 1 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def minutes(limit: str) -> int | None:
    """A Slurm time ("infinite", "30", "45:00" = min:sec, "1:30:00", "2-00:00:00") in whole
    minutes, rounded up; None for no limit or an unreadable one."""
    text, days = limit.strip().lower(), 0
    if "-" in text:
        head, _, text = text.partition("-")
        if not head.isdigit():
            return None
        days = int(head)
    parts = text.split(":")
    if not all(p.isdigit() for p in parts) or len(parts) > 3:
        return None  # "infinite", "UNLIMITED", "N/A"
    n = [int(p) for p in parts]
    if days:  # days-hours[:minutes[:seconds]]
        hours, mins, secs = [*n, 0, 0][:3]
    elif len(n) == 3:
        hours, mins, secs = n
    else:  # minutes[:seconds]
        hours, mins, secs = 0, n[0], n[1] if len(n) == 2 else 0
    return (days * 24 + hours) * 60 + mins + (1 if secs else 0)


def _int(text: str) -> int | None:
    match = re.match(r"\d+", text.strip())
    return int(match.group()) if match else None


@dataclass(frozen=True)
class Request:
    """What the job asks Slurm for, as the checks and the pending reasons need it."""

    nodes: int
    tasks_per_node: int = 1
    cpus_per_task: int = 1
    mem_gb: float | None = None
    gpus_per_node: int = 0
    time_min: int = 60
    partition: str | None = None  # None: the default partition
    partition_key: str = "cluster.partition"
    qos: str | None = None
    constraint: str | None = None
    nodelist: str | None = None
    dependency: str | None = None
    relaxed: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def of(cls, cfg: Config, environ: Mapping[str, str]) -> Request:
        return cls.of_fields(cfg.nodes, vars(cfg.cluster), environ)

    @classmethod
    def of_fields(cls, nodes: int, c: Mapping[str, Any], environ: Mapping[str, str]
                  ) -> Request:
        """From the values of ``nodes`` and ``cluster.*`` (a Config's, or a run's
        config.yaml read as plain YAML: status reads a sweep's thousand of them)."""
        extra = c.get("sbatch_extra") or {}
        relaxed = {what for option, what in _RELAXING_OPTIONS.items()
                   if any(option.startswith(key) for key in extra)}
        relaxed |= {what for name, what in _RELAXING_ENV.items() if environ.get(name)}
        from_env = environ.get("SBATCH_PARTITION")
        return cls(int(nodes), c.get("tasks_per_node") or 1, c.get("cpus_per_task") or 1,
                   c.get("mem_gb") or None, c.get("gpus_per_node") or 0,
                   c.get("time_min") or 60, from_env or c.get("partition"),
                   "SBATCH_PARTITION (environment)" if from_env else "cluster.partition",
                   c.get("qos") or environ.get("SBATCH_QOS") or None, c.get("constraint"),
                   c.get("nodelist"), extra.get("dependency"), frozenset(relaxed))

    @property
    def mem_mb(self) -> int | None:
        """What --mem asks for per node (slurm.executor_parameters writes the same)."""
        return int(self.mem_gb * 1024) if self.mem_gb else None

    @property
    def cpus_per_node(self) -> int:
        return self.tasks_per_node * self.cpus_per_task

    def fits(self, group: NodeGroup) -> bool:
        return not self._short(group)

    def _short(self, group: NodeGroup) -> list[str]:
        """What of one node's share this node shape lacks: cpus, mem, gpus."""
        short = []
        if "cpus" not in self.relaxed and group.cpus is not None \
                and group.cpus < self.cpus_per_node:
            short.append("cpus")
        if self.mem_mb and "mem" not in self.relaxed and group.memory_mb is not None \
                and group.memory_mb < self.mem_mb:
            short.append("mem")
        if self.gpus_per_node and "gpus" not in self.relaxed and group.gpus < self.gpus_per_node:
            short.append("gpus")
        return short


def target(request: Request, parts: Mapping[str, Partition]) -> list[Partition] | None:
    """The partitions the job may go to (several: "a,b"; none named: the default first,
    then every other, since a site's job_submit plugin may route it to any); None when that
    is not known."""
    if request.partition is None:
        default = [p for p in parts.values() if p.default]
        return (default + [p for p in parts.values() if not p.default]) if default else None
    return [parts[n] for n in request.partition.split(",") if n in parts] or None


def problem(request: Request, parts: Mapping[str, Partition]) -> UserError | None:
    """Why the job can never start in any partition it may go to, or None (it can, or it
    is unknown); the message is about the first (the named or the default partition)."""
    if "all" in request.relaxed or not parts:
        return None
    if request.partition is not None:
        missing = [n for n in request.partition.split(",") if n not in parts]
        if missing and len(missing) == len(request.partition.split(",")):
            return UserError(request.partition_key, request.partition,
                             f"no such partition on this cluster (sinfo lists "
                             f"{', '.join(sorted(parts))}).",
                             "choose one of them, or leave cluster.partition unset for the "
                             "default partition.")
    chosen = target(request, parts)
    if chosen is None:
        return _cluster_problem(request, parts)
    errors = [_partition_problem(request, p) for p in chosen]
    if not all(errors):
        return None
    # Said about the partition that comes closest (its fix asks for the least change).
    best = max(range(len(chosen)), key=lambda i: _closeness(request, chosen[i]))
    error = errors[best]
    assert error is not None
    if len(errors) == 1:
        return error
    others = "no other partition here can run it either" if request.partition is None \
        else f"neither can {', '.join(p.name for i, p in enumerate(chosen) if i != best)}"
    return UserError(error.key, error.value, f"{error.problem.rstrip('.')}; {others}.",
                     error.fix)


def _cluster_problem(request: Request, parts: Mapping[str, Partition]) -> UserError | None:
    """Where the partition is not known (none named, none the default): a job larger than
    every partition of the cluster can never start anywhere."""
    largest = max(parts.values(), key=lambda p: p.total_nodes)
    if "nodes" in request.relaxed or not all(p.total_nodes for p in parts.values()) or \
            request.nodes <= largest.total_nodes:
        return None
    return UserError("nodes", request.nodes, f"can never start: the largest partition of "
                     f"this cluster ({largest.name}) has {largest.total_nodes} nodes.",
                     f"nodes={largest.total_nodes} or fewer.")


def _closeness(request: Request, part: Partition) -> tuple[int, ...]:
    groups = part.groups
    return (sum(g.count for g in groups if request.fits(g)),
            max((g.gpus for g in groups), default=0),
            max((g.cpus or 0 for g in groups), default=0),
            max((g.memory_mb or 0 for g in groups), default=0), part.total_nodes, part.default)


def _partition_problem(request: Request, part: Partition) -> UserError | None:
    if part.total_nodes == 0:
        return None  # nodes yet to come (cloud, FUTURE): not for us to judge
    fitting = sum(g.count for g in part.groups if request.fits(g))
    if fitting == 0:
        return _shape_problem(request, part)
    if fitting < request.nodes and "nodes" not in request.relaxed:
        if fitting == part.total_nodes:
            said = f"partition {part.name} has {fitting} nodes, the job asks for {request.nodes}"
        else:
            said = (f"only {fitting} of partition {part.name}'s {part.total_nodes} nodes have "
                    f"{_share(request)}, the job asks for {request.nodes} such nodes")
        return UserError("nodes", request.nodes, f"can never start: {said}.",
                         f"nodes={fitting}.")
    if request.qos is not None:  # a QOS may exceed the partition's limits (flags OverPartQOS,
        return None              # PartitionMaxNodes, PartitionTimeLimit): Slurm decides
    return policy_problem(request, part)


def policy_problem(request: Request, part: Partition) -> UserError | None:
    """The partition's own limits (MaxNodes, MinNodes, MaxTime) that the job exceeds."""
    may = " (or name a QOS that may exceed the partition's limits: cluster.qos)"
    if part.max_nodes is not None and request.nodes > part.max_nodes:
        return UserError("nodes", request.nodes, f"can never start: partition {part.name} "
                         f"allows at most {part.max_nodes} nodes per job (MaxNodes), the job "
                         f"asks for {request.nodes}.", f"nodes={part.max_nodes}{may}.")
    if request.nodes < part.min_nodes:
        return UserError("nodes", request.nodes, f"can never start: partition {part.name} "
                         f"takes jobs of at least {part.min_nodes} nodes (MinNodes).",
                         f"nodes={part.min_nodes}{may}.")
    limit = part.max_time_min
    if limit is not None and request.time_min > limit and "time" not in request.relaxed:
        return UserError("cluster.time_min", request.time_min, f"can never start: partition "
                         f"{part.name} allows at most {limit} minutes (MaxTime), the job asks "
                         f"for {request.time_min}.", f"cluster.time_min={limit}{may}.")
    return None


def _share(request: Request) -> str:
    parts = [f"{request.cpus_per_node} CPUs"]
    if request.mem_mb:
        parts.append(f"{request.mem_mb} MB")
    if request.gpus_per_node:
        parts.append(f"{request.gpus_per_node} GPUs")
    return " and ".join(parts)


def _shape_problem(request: Request, part: Partition) -> UserError:
    """No node of the partition holds one node's share: name the resource no node has."""
    groups = part.groups
    where = f"partition {part.name}"
    # GPUs first: they decide the tasks per node (one per GPU), hence the CPUs asked for.
    if all("gpus" in request._short(g) for g in groups):
        most = max(g.gpus for g in groups)
        fix = (f"cluster.gpus_per_node={most} or fewer" if most else
               "choose a partition with GPUs (cluster.partition), or cluster.gpus_per_node=0")
        return UserError("cluster.gpus_per_node", request.gpus_per_node,
                         f"can never start: no node of {where} has {request.gpus_per_node} "
                         f"GPUs (the most is {most}).", f"{fix}.")
    if all("mem" in request._short(g) for g in groups):
        most = max((g.memory_mb for g in groups if g.memory_mb is not None), default=0)
        return UserError("cluster.mem_gb", request.mem_gb,
                         f"can never start: no node of {where} has {request.mem_mb} MB of "
                         f"memory (the most is {most} MB).",
                         f"cluster.mem_gb={int(most / 1024 * 10) / 10} or less, or null "
                         "(the partition's default).")
    cpus = max((g.cpus for g in groups if g.cpus is not None), default=0)
    if all("cpus" in request._short(g) for g in groups):
        if request.tasks_per_node > 1:
            asked = (f"cluster.tasks_per_node={request.tasks_per_node} x cluster.cpus_per_task="
                     f"{request.cpus_per_task} = {request.cpus_per_node} CPUs per node")
            fix = (f"cluster.cpus_per_task={cpus // request.tasks_per_node}" if
                   cpus >= request.tasks_per_node else f"fewer tasks per node (at most {cpus})")
        else:
            asked, fix = f"{request.cpus_per_node} CPUs per node", f"cluster.cpus_per_task={cpus}"
        return UserError("cluster.cpus_per_task", request.cpus_per_task,
                         f"can never start: no node of {where} has {asked} (the most is "
                         f"{cpus}).", f"{fix} (or a partition with larger nodes).")
    return UserError("cluster.cpus_per_task", request.cpus_per_task,
                     f"can never start: no node of {where} has {_share(request)} together.",
                     "ask for less per node (cluster.cpus_per_task, cluster.mem_gb, "
                     "cluster.gpus_per_node), or choose another partition.")


def check(cfgs: Sequence[Config], environ: Mapping[str, str],
          labels: Sequence[str] | None = None) -> None:
    """Refuse (UserError) a submission that can never start: one sinfo call for all of
    ``cfgs`` (every point of a sweep; ``labels`` name them in the message)."""
    requests: dict[Request, int] = {}
    for i, cfg in enumerate(cfgs):
        requests.setdefault(Request.of(cfg, environ), i)
    if all("all" in r.relaxed for r in requests):
        return
    parts = partitions(environ)
    if parts is None:
        return  # unknown: let sbatch and the pending reason speak
    for request, i in requests.items():
        error = problem(request, parts)
        if error is not None:
            where = f"(sweep point {labels[i]}) " if labels else ""
            raise UserError(error.key, error.value, where + error.problem, error.fix)


def lazy_partitions(environ: Mapping[str, str] | None = None
                    ) -> Callable[[], dict[str, Partition] | None]:
    """``partitions`` asked once, on the first call (a status refresh or a follow that meets
    a reason needing the partitions' facts), then remembered."""

    env = dict(os.environ if environ is None else environ)
    kept: list[dict[str, Partition] | None] = []

    def get() -> dict[str, Partition] | None:
        if not kept:
            kept.append(partitions(env))
        return kept[0]

    return get
