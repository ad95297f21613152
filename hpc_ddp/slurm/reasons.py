"""Slurm's pending reasons in our words: why a job waits, and whether it ever starts.

Slurm says ``PENDING`` with a reason code (squeue's %r; the table is job_reason_string in
Slurm's src/common/slurm_protocol_defs.c, https://slurm.schedmd.com/job_reason_codes.html).
Most mean "later" (Priority, Resources, a usage limit of the group). Some mean "never" unless
the job or the cluster changes (PartitionTimeLimit, BadConstraints, DependencyNeverSatisfied,
a per-job QOS limit ...): those are said with the key to change. Two are "never" only in
some cases, told apart with the partition's facts from sinfo: PartitionNodeLimit (also shown
while some of the partition's nodes are down) and ReqNodeNotAvail (never only for a node the
cluster does not have).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from hpc_ddp.errors import UserError
from hpc_ddp.slurm.fit import Partition, Request, problem, target
from hpc_ddp.slurm.state import JobState

# Reason codes told apart (or given figures) with the partitions' facts. Slurm 22.05 gives a
# job asking 8 of 4 nodes PartitionConfig or PartitionNodeLimit (seen on the test cluster).
NEEDS_FACTS = ("PartitionNodeLimit", "PartitionConfig", "ReqNodeNotAvail", "PartitionTimeLimit")
# ... of which these mean "never" only when the facts say so.
_NEVER_IF_TOLD = ("PartitionNodeLimit", "ReqNodeNotAvail")
# A limit the job alone exceeds (per job, per node, a minimum): it never passes it.
_PER_JOB = re.compile(r"^(QOS|Assoc)(Max\w*Per(Job|Node)\w*|Min\w*)$")
# A limit on the group's or user's usage: passed once other jobs end.
_USAGE = re.compile(r"^(QOS|Assoc|Association|Max)\w*(Limit|PerUser|PerAccount|Grp\w*|"
                    r"Minutes|Threshold)$")


@dataclass(frozen=True)
class Pending:
    """``code``: Slurm's reason; ``text``: what it means for this job; ``fix``: what to
    change, set when the job will not start as it is (``never``)."""

    code: str
    text: str
    fix: str = ""

    @property
    def never(self) -> bool:
        return bool(self.fix)

    def line(self) -> str:
        if self.never:
            return f"can never start ({self.code}): {self.text}: {self.fix}"
        return f"waits ({self.code}): {self.text}" if self.code else f"waits: {self.text}"


_WAITS = {
    "": "for the scheduler's next pass",
    "None": "for the scheduler's next pass",
    "Priority": "for its turn: other jobs come first",
    "Resources": "for nodes to free up",
    "Dependency": "for the jobs it depends on to end",
    "BeginTime": "for its begin time (a requeued job waits about two minutes)",
    "JobHeldUser": "held: it starts once released (`scontrol release <job id>`; a job held by "
                   "cluster.sbatch_extra.hold=true waits for exactly this)",
    "JobHeldAdmin": "held by an administrator: ask them to release it",
    "JobHoldMaxRequeue": "held after too many requeues: `scontrol release <job id>` once "
                         "the cause is fixed",
    "PartitionDown": "its partition is down: it starts once an administrator brings it up",
    "PartitionInactive": "its partition is inactive: it starts once it is brought up",
    "NodeDown": "a node it needs is down",
    "Reservation": "for its reservation to begin",
    "Licenses": "for licenses",
    "JobArrayTaskLimit": "the array runs at most sweep.parallel tasks at a time",
    "Prolog": "for its prolog to finish",
    "Cleaning": "for the previous attempt's cleanup",
}


def code_of(reason: str) -> str:
    """The reason code of squeue's text ("ReqNodeNotAvail, UnavailableNodes:node5")."""
    code = reason.split(",")[0].strip()
    return "" if code == "None" else code


def explain(reason: str, request: Request | None,
            facts: Callable[[], Mapping[str, Partition] | None]) -> Pending:
    """The meaning of a PENDING job's ``reason`` for the job that asked ``request`` (None:
    not known); ``facts`` gives the partitions (one sinfo, asked only for NEEDS_FACTS)."""
    code = code_of(reason)
    never = _never(code, reason, request, facts)
    if never is not None:
        return Pending(code, *never)
    if code in _WAITS:
        return Pending(code, _WAITS[code])
    if code == "PartitionNodeLimit":
        known = request is not None and facts()
        return Pending(code, "its node count is within the partition's limits, but not enough "
                       "of its nodes are up (`sinfo -R` lists the down ones)" if known else
                       "the partition cannot give it that many nodes: more than it has or "
                       "allows, or some are down (`sinfo`)")
    if code == "ReqNodeNotAvail":
        down = reason.partition("UnavailableNodes:")[2].strip()
        return Pending(code, "nodes it requires are down, drained or reserved"
                       + (f" ({down})" if down else ""))
    if _USAGE.match(code):
        return Pending(code, "a usage limit of its QOS or account is reached; it starts as "
                       "other jobs of yours or your group end")
    return Pending(code, "Slurm's reason (https://slurm.schedmd.com/job_reason_codes.html)")


def _never(code: str, reason: str, request: Request | None,
           facts: Callable[[], Mapping[str, Partition] | None]) -> tuple[str, str] | None:
    """(why, fix) when ``code`` means the job never starts as it is."""
    asks = request or Request(nodes=0)
    part = asks.partition or "(default)"
    if code in NEEDS_FACTS:
        parts = facts() if request is not None else None
        said = _with_facts(code, reason, asks, parts) if parts else None
        if said is not None or code in _NEVER_IF_TOLD:
            return said
    if code == "PartitionTimeLimit":
        asked = f"={asks.time_min}" if request is not None else ""
        return (f"cluster.time_min{asked} is above partition {part}'s MaxTime "
                f"(`sinfo -p {part} -o %l`)", "set cluster.time_min to at most that, or "
                "choose another cluster.partition")
    if code == "PartitionConfig":
        return (f"the job does not fit partition {part}'s configuration (its CPUs or memory "
                f"per node, or the accounts, QOS and groups it allows: `scontrol show "
                f"partition {part}`)", "change the request or cluster.partition")
    if code == "BadConstraints":
        return (f"no node satisfies the job's constraints (cluster.constraint="
                f"{asks.constraint or 'null'} with its CPUs, memory and GPUs per node; "
                "`sinfo -o '%N %f %c %m %G'`)", "change them")
    if code == "DependencyNeverSatisfied":
        return (f"a job it depends on (cluster.sbatch_extra.dependency="
                f"{asks.dependency or '?'}) failed or was cancelled",
                "cancel this one and submit again without that dependency")
    if code in ("InvalidAccount", "AccountNotAllowed"):
        return ("its account is not valid here or not allowed in the partition",
                "set cluster.account to one of `sacctmgr show assoc user=$USER "
                "format=account`")
    if code in ("InvalidQOS", "QOSNotAllowed"):
        return (f"cluster.qos={asks.qos or 'null'} is not valid here or not allowed in the "
                "partition", "choose one of `sacctmgr show assoc user=$USER format=qos`")
    if code == "MaxMemPerLimit":
        return ("cluster.mem_gb is above the partition's memory limit per node or CPU "
                f"(MaxMemPerNode/MaxMemPerCPU in `scontrol show partition {part}`)",
                "ask for less")
    if code == "ReservationDeleted":
        return "its reservation was deleted", "cancel it and submit again without it"
    if _PER_JOB.match(code):
        return (f"the job alone exceeds a per-job limit of its QOS or account ({code}; "
                "`sacctmgr show qos`)", "ask for less (nodes, cluster.time_min, GPUs) or "
                "another cluster.qos")
    return None


def _with_facts(code: str, reason: str, asks: Request,
                parts: Mapping[str, Partition]) -> tuple[str, str] | None:
    if code == "ReqNodeNotAvail":
        from hpc_ddp import hostlist  # deferred (start-up): hostlist

        names = reason.partition("UnavailableNodes:")[2].strip()
        known = {n for p in parts.values() for g in p.groups if g.names
                 for n in _expand(hostlist.expand, g.names)}
        gone = [n for n in _expand(hostlist.expand, names) if n not in known] if names else []
        if gone and known:
            return (f"it requires node(s) {', '.join(gone)}, which the cluster does not have "
                    "(`sinfo -N` lists its nodes)",
                    f"change cluster.nodelist={asks.nodelist or 'null'}")
        return None
    if code == "PartitionTimeLimit":
        for part in target(asks, parts) or []:
            limit = part.max_time_min
            if limit is not None and asks.time_min > limit:
                return (f"partition {part.name} allows at most {limit} minutes (MaxTime), the "
                        f"job asks for {asks.time_min}", f"cluster.time_min={limit}")
        return None
    # PartitionNodeLimit, PartitionConfig: what the check before sbatch would have said (the
    # partition's own limits included: Slurm says the job is held by them, whatever its QOS).
    error = problem(replace(asks, qos=None), parts)
    if error is None:
        return None
    return error.problem.removeprefix("can never start: ").rstrip("."), error.fix.rstrip(".")


def _expand(expand: Callable[[str], list[str]], names: str) -> list[str]:
    try:
        return expand(names)
    except ValueError:
        return []


def pending_of(state: JobState, run_dir: Path,
               facts: Callable[[], Mapping[str, Partition] | None],
               requests: dict[Path, Request | None] | None = None) -> Pending | None:
    """Why the Slurm job of ``run_dir`` waits, or None when it is not PENDING. The job's
    request is read from the run's config.yaml only for codes that need it (``requests``
    keeps it across refreshes)."""
    if state.state != "PENDING":
        return None
    code = code_of(state.reason)
    request = None
    if code not in _WAITS:
        cache = {} if requests is None else requests
        if run_dir not in cache:
            cache[run_dir] = _request(run_dir)
        request = cache[run_dir]
        if request is not None and state.partition:  # where Slurm put it, "a,b" included
            request = replace(request, partition=state.partition)
    return explain(state.reason, request, facts)


def _request(run_dir: Path) -> Request | None:
    """The run's request from its config.yaml, read as plain YAML (a millisecond; composing
    the Config would take ~50 ms, a minute for a 1,000-point sweep)."""
    # deferred: yaml; start-up: config.yaml_guard
    import yaml  # deferred: yaml

    from hpc_ddp.config import yaml_guard

    try:  # aliases counted first: a planted bomb must not hang a status refresh
        data = yaml_guard.load((run_dir / "config.yaml").read_text(), "config.yaml")
        return Request.of_fields(data.get("nodes", 1), data.get("cluster") or {}, {})
    except (OSError, yaml.YAMLError, AttributeError, TypeError, ValueError, UserError):
        return None
