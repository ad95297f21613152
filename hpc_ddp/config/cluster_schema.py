"""The ``cluster`` group's typed schema: where and how the job runs (Slurm or local), its
resources, requeues and restarts in place. Part of config/schema.py's Config."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpc_ddp.config.container_schema import ContainerConfig


@dataclass
class ClusterConfig:
    # Where the ranks run: "auto" (inside a Slurm allocation a step of it, else Slurm when a
    # controller answers, else local), "local" (processes on this machine through submitit's
    # local executor), "slurm" (a new job through sbatch) or "step" (a step of the allocation
    # this shell is in: srun, no new job; launch/step.py).
    kind: str = "auto"
    # Tasks (ranks) per node. None derives it: gpus_per_node when GPUs are requested (one task
    # per GPU), on a local run one per GPU torch can use, else 2 CPU ranks locally and 1 on
    # Slurm. conf/cluster/local.yaml and slurm.yaml leave it to be derived.
    tasks_per_node: int | None = None
    # GPUs per node (0: CPU job). One task per GPU is enforced. None (local, auto) derives it:
    # locally the GPUs torch can use here (unless trainer.device=cpu), on Slurm 0.
    gpus_per_node: int | None = None
    # How Slurm hands GPUs to tasks: "per_node" (--gpus-per-node: every task sees all GPUs
    # of its node) or "per_task" (--gpus-per-task=1: each task sees only its own).
    gpu_binding: str = "per_node"
    # CPUs per task (--cpus-per-task); also the default intra-op threads of each rank.
    cpus_per_task: int = 1
    # Memory per node in GB (--mem); None leaves the partition's default.
    mem_gb: float | None = None
    # Wall-clock limit in minutes (--time).
    time_min: int = 60
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    # Nodes to avoid / to use (Slurm hostlists, e.g. "node[3-4]").
    exclude: str | None = None
    nodelist: str | None = None
    exclusive: bool = False
    job_name: str = "hpc_ddp"
    # Signal sent ahead of the time limit so the job can checkpoint and requeue. USR2, not
    # USR1: NCCL 2.12-2.13 caught SIGUSR1 in its proxy thread (submitit PR #1697). A name
    # sbatch --signal knows (validate.SLURM_SIGNALS), one the ranks can catch.
    signal: str = "USR2"
    # Seconds before the time limit at which it comes: below the limit and below 65535.
    signal_delay_s: int = 120
    # Requeues allowed after a time limit or a failure (preemptions do not count).
    max_restarts: int = 3
    # Restarts in place per job attempt: when a rank's training dies abruptly (NCCL's
    # watchdog, the out-of-memory killer, a crash), a collective fails or times out, or a
    # rank hangs, every rank starts again from the latest checkpoint in the same job and
    # step, seconds later; once spent, the job is requeued (within max_restarts). Needs a
    # supervisor per rank (supervise). 0: every such failure requeues.
    restarts_in_place: int = 3
    # Nodes asked for on top of `nodes`, idle until a node of the run is lost: the job
    # survives the loss (--no-kill) and its step starts again on the nodes left, a spare
    # among them, in the same job (within restarts_in_place). Without a spare left, the lost
    # nodes are excluded and the job requeued (docs/fault-tolerance.md#a-node-lost).
    spare_nodes: int = 0
    # A node lost with no spare left: the same job goes on with the nodes that remain, never
    # fewer than this many (below it: excluded and requeued, as without it), and the run
    # grows back at its next requeue. The built-in trainer then keeps the global batch and
    # each step's samples whatever the world size (docs/fault-tolerance.md#shrinking-past-
    # a-lost-node). null: off (a lost node without a spare requeues the job).
    min_nodes: int | None = None
    # On Slurm, run each rank's training (built-in or entry=) in a child of a supervisor
    # process that outlives it: when the child dies abruptly (NCCL's watchdog aborts every
    # rank after a failed collective) or hangs, the supervisors restart every rank in place
    # (or requeue the job), and relay a request for the child's stacks. None: on when
    # restarts_in_place > 0 or the ranks use GPUs. false: never (a failure then requeues).
    supervise: bool | None = None
    # Start each node's rank processes warm: one process per node imports torch and the rank
    # program once, and every rank process (a supervisor and its training process, each
    # restart in place) is forked from it instead of importing them again: seconds a rank
    # (docs/performance.md#warm-starts). false: each starts as a fresh interpreter. In a
    # container the ranks always start cold (its runtime owns the interpreter).
    warm_start: bool = True
    # A local run (cluster=local): how long its warm process stays after the run, for the next
    # local run of the same interpreter, files and environment (a second run then starts in
    # about a second; a sweep's points and trials share one). 0: it leaves with its run. On
    # Slurm each node's warm process always leaves with its job step.
    warm_keep_s: float = 120.0
    # Shell lines run before srun on the first node (module load, conda activate, ...).
    setup: list[str] = field(default_factory=list)
    # Extra arguments for srun, e.g. ["--cpu-bind=none"].
    srun_args: list[str] = field(default_factory=list)
    # Any other sbatch option, name without "--" -> value, e.g. {mail-type: END}; "true" is a
    # bare flag (hold: true -> --hold). Options the keys above set are refused here.
    sbatch_extra: dict[str, str] = field(default_factory=dict)
    # Python interpreter on the nodes; None: the one running submit.
    python: str | None = None
    # The interface whose address rank 0 publishes for the rendezvous (e.g. "ib0": IPoIB),
    # for clusters whose host names resolve to a slow management network; IPv4 first, else
    # a global IPv6 address. None: rank 0's host name. A MASTER_ADDR you export wins.
    master_interface: str | None = None
    # The container every task runs in (the `container` group: container=pyxis|apptainer|
    # podman, conf/container/; docs/containers.md). kind none: the nodes' own environment.
    container: ContainerConfig = field(default_factory=ContainerConfig)
    # A virtual environment (its folder) or a conda environment (a name or a folder) that
    # every task activates on its own node before it starts; the job fails naming the node
    # where it does not exist. `python -m hpc_ddp.env` builds one.
    venv: str | None = None
    conda_env: str | None = None
    # Every rank fingerprints its software (Python, torch, CUDA, NCCL, cuDNN, all installed
    # distributions); rank 0 stops the run before training when nodes differ, naming them
    # and the packages. true: warn and train anyway.
    allow_mixed_env: bool = False
    # Submit from a laptop or a notebook: the SSH destination of the cluster's login node,
    # as you type it after `ssh` (user@host, or a Host alias of ~/.ssh/config with its
    # ProxyJump, port and key). Checked here first, then the project's code is copied there
    # and hpc_ddp's own submit runs there (docs/remote.md). None: this machine submits.
    remote: str | None = None
    # On the remote: the folder for code snapshots (code/<digest>) and runs (runs/...).
    remote_root: str = "~/hpc_ddp"
    # The folder copied to the remote: None is the git work tree you submit from (its
    # uncommitted and untracked, non-ignored files), else that folder itself.
    remote_code: str | None = None
    # An ssh_config file read instead of ~/.ssh/config (ssh -F).
    ssh_config: str | None = None
    # The umask (octal) of every file and folder of the run dir, on the submit host and the
    # nodes. 027: your group may read, no one else; 077: only you; 022: everyone may read.
    # Never one that lets others write (a file planted there would run on the next restart;
    # hpc_ddp refuses to load such a checkpoint: docs/security.md).
    umask: str = "027"
