"""What the launcher, a rank's supervisor and the training process under it agree on: the
environment variables one sets for the other, and the exit codes that carry a meaning.

Names only, no code: every side imports them from here, so none has to import another.
"""

from __future__ import annotations

# -- set by a launcher for the tasks it starts ----------------------------------------------
# The local launcher's ranks: unique per launch (a uuid), the rendezvous file's name.
LAUNCH_ID_ENV = "HPC_DDP_LAUNCH_ID"
# Which start of the training processes within one Slurm attempt this is: 0 for the first,
# n after n restarts in place (rank/supervise/generations.py: the supervisors set it for
# their children, whose store keys live under a prefix of their own per generation); the
# rank's log marks every start (DistEnv.generation, docs/observability.md).
GENERATION_ENV = "HPC_DDP_GENERATION"
# Set in a process whose output is already written into its rank's log (the path of that
# log): a supervised child inherits it and does not capture its output a second time.
CAPTURED_ENV = "HPC_DDP_CAPTURED"
# The tasks of a step that `submit` ran inside an allocation (launch/step.py): the
# allocation's id. Such a run is not requeued (an interactive allocation cannot be, and a
# batch script's `submit` would start anew): it stops with the resume command.
STEP_OF_ENV = "HPC_DDP_STEP_OF"
# The pickled task every task of such a step runs (rank/main/step.py).
TASK_ENV = "HPC_DDP_STEP_TASK"

# Warm starts (rank/warm/): "0" starts every rank process as a fresh interpreter; anything
# else (or unset) forks it from its node's warm process. The launchers set it from
# cluster.warm_start (and to "0" in a container, whose interpreter is not ours to fork).
WARM_ENV = "HPC_DDP_WARM"
# A local launch's warm process stays this many seconds after its last rank ended, for the
# next local run of the same interpreter, files and environment (rank/warm/kept.py); the local
# launcher sets it from cluster.warm_keep_s. Unset or 0: it leaves with its launch, as on Slurm
# (where no process outlives its job).
WARM_KEEP_ENV = "HPC_DDP_WARM_KEEP"
# Set in a process forked from a node's warm process: that process's socket (a supervisor
# forks its training process there too), and how the rank started, for its log.
WARM_SOCKET_ENV = "HPC_DDP_WARM_SOCKET"
WARM_NOTE_ENV = "HPC_DDP_WARM_NOTE"
# A rank process with no note: started by a launcher of its own (torchrun, a plain srun).
COLD_NOTE = "cold: started as a fresh interpreter"

# -- set by a supervisor for the training process it starts -----------------------------------
# The supervised child (the built-in trainer or a function entry): its config (YAML) and run
# dir; also marks it as supervised (no recursion).
PROGRAM_CONFIG_ENV = "HPC_DDP_PROGRAM_CONFIG"
PROGRAM_RUN_DIR_ENV = "HPC_DDP_PROGRAM_RUN_DIR"
# The key of the store the supervisor holds (rank/join/authstore.py), for the child's client:
# in the environment only (readable by this user alone), never on a command line or in a file.
STORE_KEY_ENV = "HPC_DDP_STORE_KEY"
# A script: what its context (hpc_ddp.context() in the script) reads.
RUN_DIR_ENV = "HPC_DDP_RUN_DIR"
STOP_FILE_ENV = "HPC_DDP_STOP_FILE"
REQUEUE_EXIT_ENV = "HPC_DDP_REQUEUE_EXIT_CODE"
REQUEUE_SIGNAL_ENV = "HPC_DDP_REQUEUE_SIGNAL"
RESUME_CAUSE_ENV = "HPC_DDP_RESUME_CAUSE"
# Set where a script's steps are probed for their gradient sync (several ranks, DDP):
# rank 0 leaves the figures beside the stop file, SYNC_SUFFIX, for the summary.
SYNC_PROBE_ENV = "HPC_DDP_SYNC_PROBE"
SYNC_SUFFIX = ".sync.json"
# The supervised child: a stop the supervisor was signalled for before the child ran
# (stopping's code), so the child stops as if the signal had reached it.
EARLY_STOP_ENV = "HPC_DDP_EARLY_STOP"
# This node's staged copy of the data (data.stage=true), for a script or a user's loop.
DATA_ROOT_ENV = "HPC_DDP_DATA_ROOT"
# Set (to the number of the step's start in the job) in a step that hpc_ddp's driver runs in
# the batch script (slurm/driver.py): after a node is lost, the driver starts the step again
# or requeues the job, so the ranks leave that to it.
DRIVEN_ENV = "HPC_DDP_DRIVEN"
# Inside a container: its kind (pyxis, apptainer, podman). Rank records show where a rank
# ran, and a supervisor in podman passes Slurm's signals on to its child (distenv.py).
CONTAINER_ENV = "HPC_DDP_CONTAINER"
# The job's end as the batch script reckons it (its start plus the time limit, epoch seconds):
# when Slurm's warning ahead of the limit is due at the latest (rank/services/lost_signal.py).
JOB_END_ENV = "HPC_DDP_JOB_END"
# A trial of an adaptive sweep (sweep/worker.py -> rank/services/pruning.py): JSON naming the sweep
# folder, the trial's number and its objective; rank 0 reports evaluations to it. A pruned
# trial's run dir gets PRUNED_FILE (the step), which the worker reads.
TRIAL_ENV = "HPC_DDP_TRIAL"
PRUNED_FILE = "pruned.json"

# -- exit codes -------------------------------------------------------------------------------
# A script (or a function entry's process) asks for a requeue after it checkpointed:
# EX_TEMPFAIL of sysexits.h, "temporary failure; the user is invited to retry".
REQUEUE_EXIT_CODE = 75
# A supervised training process failed in a way a new start may get past (a peer died, a
# collective failed or timed out, a CUDA error) and recorded it: its supervisor decides,
# with the other supervisors, whether the ranks restart in place or the job is requeued.
RESTART_EXIT_CODE = 76
