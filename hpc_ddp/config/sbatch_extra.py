"""``cluster.sbatch_extra``: options passed to sbatch as they are, checked so that none is
unreadable or silently replaces one hpc_ddp sets itself. Pure."""

from __future__ import annotations

import re

from hpc_ddp.config.schema import ClusterConfig
from hpc_ddp.config.secret_channels import named_secrets
from hpc_ddp.errors import UserError
from hpc_ddp.redact import MASK, NO_MARKS, secret_name

# sbatch options hpc_ddp (or submitit's script) sets itself -> the fix: the same option in
# cluster.sbatch_extra would silently replace ours ({value}: the value given).
MANAGED_SBATCH = {
    "nodes": "use nodes={value}",
    "ntasks-per-node": "use cluster.tasks_per_node={value}",
    "ntasks": "set nodes and cluster.tasks_per_node (the job runs nodes x tasks_per_node tasks)",
    "gpus-per-node": "use cluster.gpus_per_node={value}",
    "gpus-per-task": "use cluster.gpus_per_node=<GPUs per node> with cluster.gpu_binding=per_task",
    "gpus": "use cluster.gpus_per_node=<GPUs per node> (one task per GPU)",
    "cpus-per-task": "use cluster.cpus_per_task={value}",
    "cpus-per-gpu": "use cluster.cpus_per_task (always set; Slurm refuses both together)",
    "mem": "use cluster.mem_gb=<GB per node>",
    "time": "use cluster.time_min=<minutes>",
    "partition": "use cluster.partition={value}",
    "account": "use cluster.account={value}",
    "qos": "use cluster.qos={value}",
    "constraint": "use cluster.constraint={value}",
    "exclude": "use cluster.exclude={value}",
    "nodelist": "use cluster.nodelist={value}",
    "exclusive": "use cluster.exclusive=true",
    "job-name": "use cluster.job_name={value}",
    "signal": "use cluster.signal=<name> and cluster.signal_delay_s=<seconds> (the ranks "
              "checkpoint and requeue on that signal)",
    "requeue": "drop it: hpc_ddp always asks for --requeue (cluster.max_restarts bounds it)",
    "no-kill": "drop it: a supervised run carries --no-kill (a lost node: cluster.spare_nodes)",
    "no-requeue": "use cluster.max_restarts=0 (the job then never requeues itself)",
    "output": "drop it: each task logs under run_dir/submitit/ (choose run_dir)",
    "error": "drop it: each task logs under run_dir/submitit/ (choose run_dir)",
    "open-mode": "drop it: the logs are appended to across requeues on purpose",
    "array": "use -m for a sweep (hpc_ddp submits the job arrays)",
    "wrap": "drop it: hpc_ddp writes the batch script (cluster.setup adds lines before srun)",
    "parsable": "drop it: submitit reads the job id from sbatch's usual output",
    "test-only": "use dry_run=true to see the script without submitting",
}
_SBATCH_OPTION = re.compile(r"^[a-z][a-z0-9-]*$")


def check_sbatch_extra(c: ClusterConfig) -> None:
    """Refuse sbatch_extra entries sbatch cannot read, and options hpc_ddp sets itself (an
    extra one would silently replace ours: nodes=8 for nodes=4, a signal the ranks ignore)."""
    for key, value in c.sbatch_extra.items():
        full = f"cluster.sbatch_extra.{key}"
        if secret_name(key) or named_secrets([str(value)], NO_MARKS):
            value = MASK  # refused by config/secrets.py, never echoed here (comment=token=x)
        option = key.replace("_", "-")
        if not _SBATCH_OPTION.match(option):
            raise UserError(full, value, "is not an sbatch option name.",
                            "use the long option name without the leading --, e.g. "
                            "+cluster.sbatch_extra.mail-type=END.")
        # sbatch takes unambiguous abbreviations of long options (getopt_long): --part=x
        # is --partition=x.
        prefixed = [m for m in MANAGED_SBATCH if m.startswith(option)]
        managed = option if option in MANAGED_SBATCH else next(iter(prefixed), None)
        if managed == "exclusive" and not c.exclusive and str(value).lower() != "true":
            managed = None  # --exclusive=user|mcs|topo: modes the boolean key cannot express
        if managed:
            how = "" if managed == option else (
                f" (sbatch reads --{option} as --{managed})" if len(prefixed) == 1
                else f" (--{option} abbreviates --{managed} and other options)")
            raise UserError(full, value, f"hpc_ddp sets --{managed} itself{how}; this entry "
                            "would silently replace it.",
                            MANAGED_SBATCH[managed].format(value=value) + " instead.")
        if option != key:
            raise UserError(full, value, "sbatch options are spelled with -, not _.",
                            f"use +cluster.sbatch_extra.{option}={value}.")
        if option in ("mem-per-cpu", "mem-per-gpu") and c.mem_gb is not None:
            raise UserError(full, value, f"conflicts with cluster.mem_gb={c.mem_gb} (--mem); "
                            "Slurm takes only one of them.",
                            "drop one: cluster.mem_gb=null, or this entry.")
        if "\n" in str(value) or "\r" in str(value):
            raise UserError(full, value, "contains a newline.", "give a single-line value.")
