"""Who am I in the job? Rank, local rank, world size and node from the task's environment.

A pure function of a mapping. Detection order (as Lightning's cluster environments, see
docs/slurm.md): a torchrun environment already set wins, then submitit's local executor (a
local run started inside a Slurm allocation is still local: its ranks never take Slurm's
identity), then Slurm, then a single process.

Under Slurm the step's own variables describe the ranks (a step may run on part of the
allocation: ``srun -N2 -r2`` inside ``salloc -N4`` runs on the 3rd and 4th nodes, and
SLURM_JOB_NODELIST / SLURM_NODELIST still list all four):
https://slurm.schedmd.com/srun.html#SECTION_OUTPUT-ENVIRONMENT-VARIABLES
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from hpc_ddp import hostlist
from hpc_ddp.rank.contract import CONTAINER_ENV, GENERATION_ENV, LAUNCH_ID_ENV


class LaunchError(RuntimeError):
    """The task was started in a way that cannot form the requested world (explained)."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    node_rank: int
    num_nodes: int
    # Ranks on this node.
    local_world_size: int
    # torchrun | slurm | local | single
    source: str
    # Identifies this attempt of this job: the rendezvous of one attempt never meets another.
    job_id: str
    restart: int = 0
    # Address of rank 0 when the environment says it (torchrun or a user's MASTER_ADDR); None:
    # rank 0 publishes its own (never a guess from a node list: a step may not run there).
    master_addr: str | None = None
    # A MASTER_PORT the user (or torchrun) set; None: rank 0 binds a free port.
    master_port: int | None = None
    # Host names of the step's nodes in Slurm's order (empty outside Slurm).
    nodes: tuple[str, ...] = ()
    # Tasks on each node, in node order (to say where a missing rank should have run).
    tasks_on_nodes: tuple[int, ...] = ()
    # The id the job was submitted as, the one a user quotes (squeue -j, scancel, sacct,
    # job.json's job_id, the submit command's first line): SLURM_JOB_ID, <array job>_<task>
    # for an array task, submitit's local job id; "" where it is job_id itself.
    submitted_id: str = ""
    # Restarts in place within this attempt (contract.GENERATION_ENV): 0 for the first start.
    # With job_id and restart it names the attempt a log line belongs to.
    generation: int = 0
    # A training process under an hpc_ddp supervisor (GENERATION_ENV is set).
    supervised: bool = False

    @property
    def attempt(self) -> tuple[str, int, int]:
        """(launch id, Slurm's restart count, generation): one start of the ranks."""
        return self.job_id, self.restart, self.generation

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def expected_host(self, rank: int) -> str | None:
        """The node a rank was placed on under Slurm's block distribution (None if unknown)."""
        first = 0
        for host, count in zip(self.nodes, self.tasks_on_nodes, strict=False):
            if first <= rank < first + count:
                return host
            first += count
        return None


def detect(environ: Mapping[str, str], simulated_tasks_per_node: int | None = None) -> DistEnv:
    """The DistEnv of the process whose environment is ``environ``.

    ``simulated_tasks_per_node`` splits a local run into simulated nodes of that many ranks.
    Raises LaunchError for a Slurm batch shell or salloc shell that forgot ``srun``.
    """
    env = _detect(environ, simulated_tasks_per_node)
    if GENERATION_ENV not in environ:
        return env
    # A supervised child (torchrun's variables, set by its supervisor): its
    # TORCHELASTIC_RESTART_COUNT counts every start after the first, the requeues and the
    # restarts in place (GENERATION_ENV).
    generation = _int(environ, GENERATION_ENV, 0)
    return dataclasses.replace(env, generation=generation, supervised=True,
                               restart=max(0, env.restart - generation),
                               submitted_id=env.submitted_id or slurm_job_name(environ))


def _detect(environ: Mapping[str, str], simulated_tasks_per_node: int | None) -> DistEnv:
    if "RANK" in environ and "WORLD_SIZE" in environ and "LOCAL_RANK" in environ:
        return _from_torchrun(environ)
    if "SUBMITIT_LOCAL_GLOBALID" in environ:
        return _from_local(environ, simulated_tasks_per_node)
    if "SLURM_JOB_ID" in environ and _slurm_wants_tasks(environ):
        return _from_slurm(environ)
    return DistEnv(0, 0, 1, 0, 1, 1, "single", environ.get("SLURM_JOB_ID", "single"),
                   master_port=_user_port(environ), submitted_id=slurm_job_name(environ))


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None:
        if default is None:
            raise LaunchError(f"{name} is not set; the launcher did not describe this task.")
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not an integer.") from None


def _user_port(environ: Mapping[str, str]) -> int | None:
    return _int(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else None


def _from_torchrun(environ: Mapping[str, str]) -> DistEnv:
    world = _int(environ, "WORLD_SIZE")
    local_world = _int(environ, "LOCAL_WORLD_SIZE", 1)
    return DistEnv(
        rank=_int(environ, "RANK"),
        local_rank=_int(environ, "LOCAL_RANK"),
        world_size=world,
        node_rank=_int(environ, "GROUP_RANK", 0),
        num_nodes=max(1, world // max(1, local_world)),
        local_world_size=local_world,
        source="torchrun",
        job_id=environ.get("TORCHELASTIC_RUN_ID", "torchrun"),
        restart=_int(environ, "TORCHELASTIC_RESTART_COUNT", 0),
        master_addr=environ.get("MASTER_ADDR"),
        master_port=_user_port(environ),
    )


def slurm_job_name(environ: Mapping[str, str]) -> str:
    """The Slurm job as submitted: ``<array job>_<task>`` for an array task (what sbatch and
    squeue call it), else SLURM_JOB_ID. https://slurm.schedmd.com/job_array.html"""
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else environ.get("SLURM_JOB_ID", "")


def in_slurm_step(environ: Mapping[str, str]) -> bool:
    """A process of a Slurm job step (an srun task, or the batch script's step): slurmstepd
    signals every process of it. https://slurm.schedmd.com/srun.html#OPT_SLURM_STEP_ID"""
    return "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ


def step_signals_every_process(environ: Mapping[str, str]) -> bool:
    """Slurm's signals to this task (the requeue signal, SIGTERM) reach every process it
    started: a Slurm step, outside a container whose runtime passes a signal on to the
    container's main process only. Podman's does (--sig-proxy,
    https://docs.podman.io/en/latest/markdown/podman-run.1.html#sig-proxy): its conmon and
    the container's processes live apart from the step's, so the supervisor, the main process,
    must pass it on to its child. Apptainer and pyxis run the processes inside the step."""
    return in_slurm_step(environ) and environ.get(CONTAINER_ENV) != "podman"


def _slurm_wants_tasks(environ: Mapping[str, str]) -> bool:
    """True in an srun step; LaunchError in a batch or salloc shell of a multi-task job."""
    if in_slurm_step(environ):
        step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID", ""))
        # The batch script runs as step "batch" (4294967291 in some versions): not a task.
        if step not in ("batch", "4294967291", "4294967292", "extern"):
            return True
    ntasks = _int(environ, "SLURM_NTASKS", 1)
    if ntasks > 1:
        where = "an salloc shell" if "SLURM_PROCID" not in environ else "the batch script"
        raise LaunchError(
            f"running in {where} of Slurm job {environ['SLURM_JOB_ID']} that asked for {ntasks} "
            "tasks, but only this one process was started. Launch the ranks with srun: "
            "`srun python -m hpc_ddp.train ...` (see jobs/train.sbatch)."
        )
    return "SLURM_PROCID" in environ


def _from_slurm(environ: Mapping[str, str]) -> DistEnv:
    if environ.get("SLURM_HET_SIZE"):
        raise LaunchError(
            f"this is a heterogeneous Slurm job (SLURM_HET_SIZE={environ['SLURM_HET_SIZE']}), "
            "which hpc_ddp does not support: its components differ in nodes and tasks, and a "
            "DDP world needs one layout. Submit one homogeneous job instead (nodes=, "
            "cluster.tasks_per_node=, cluster.gpus_per_node=), or one job per component.")
    nodelist = (environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                or environ.get("SLURM_NODELIST", ""))
    nodes = tuple(hostlist.expand(nodelist)) if nodelist else ()
    node_rank = _int(environ, "SLURM_NODEID", 0)
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    per_node = tuple(hostlist.tasks_per_node(spec)) if spec else ()
    if nodes and len(per_node) == 1 and len(nodes) > 1:
        per_node = per_node * len(nodes)
    world = _int(environ, "SLURM_STEP_NUM_TASKS", _int(environ, "SLURM_NTASKS", 1))
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID", "0"))
    return DistEnv(
        rank=_int(environ, "SLURM_PROCID"),
        local_rank=_int(environ, "SLURM_LOCALID", 0),
        world_size=world,
        node_rank=node_rank,
        num_nodes=_int(environ, "SLURM_STEP_NUM_NODES", _int(environ, "SLURM_NNODES", 1)),
        local_world_size=per_node[node_rank] if node_rank < len(per_node) else 1,
        source="slurm",
        job_id=f"{environ['SLURM_JOB_ID']}.{step}",
        submitted_id=slurm_job_name(environ),
        restart=_int(environ, "SLURM_RESTART_COUNT", 0),
        master_addr=environ.get("MASTER_ADDR") or None,
        master_port=_user_port(environ),
        nodes=nodes,
        tasks_on_nodes=per_node,
    )


def _from_local(environ: Mapping[str, str], per_node: int | None) -> DistEnv:
    world = _int(environ, "SUBMITIT_LOCAL_NTASKS", 1)
    rank = _int(environ, "SUBMITIT_LOCAL_GLOBALID")
    per_node = per_node if per_node and world % per_node == 0 else world
    return DistEnv(
        rank=rank,
        local_rank=rank % per_node,
        world_size=world,
        node_rank=rank // per_node,
        num_nodes=world // per_node,
        local_world_size=per_node,
        source="local",
        # The launch's own id (launch/local.py) before the controller's pid: a pid comes back
        # in a later run, whose ranks must never read this run's rendezvous file.
        job_id=environ.get(LAUNCH_ID_ENV) or environ.get("SUBMITIT_LOCAL_JOB_ID", "local"),
        submitted_id=environ.get("SUBMITIT_LOCAL_JOB_ID", ""),
        master_addr=environ.get("MASTER_ADDR") or "127.0.0.1",
        master_port=_user_port(environ),
    )
