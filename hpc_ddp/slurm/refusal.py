"""sbatch's refusals as one line that names the key the user set, its value, then Slurm's
words: ``cluster.partition=gpu: sbatch refused the job: invalid partition specified: gpu;
Batch job submission failed: Invalid partition name specified. Fix: ...``.

sbatch names no key ("Requested node configuration is not available" stands for CPUs,
memory, GPUs, node lists, ...): its more specific line, then what one sinfo says, then the
keys the user set among the candidates, tell which one it was.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from hpc_ddp.config.schema import Config
from hpc_ddp.errors import UserError

_NO_CLIENT_FIX = ("use cluster=local to run on this machine, or submit from a login node of "
                  "the Slurm cluster.")
_NO_CONTROLLER_FIX = ("submit from a login node of the cluster, or point SLURM_CONF at its "
                      "slurm.conf (export SLURM_CONF=/path/to/slurm.conf), or use cluster=local.")
# sbatch's words (lower case) -> the keys that decide them, the most specific first. From
# Slurm's slurm_strerror and sbatch's own checks (src/common/slurm_errno.c, src/sbatch/opt.c).
_SAID: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("invalid partition", ("partition",)),
    ("invalid account", ("account", "partition")),
    ("invalid qos", ("qos",)),
    ("invalid feature", ("constraint",)),
    ("invalid node name", ("nodelist", "exclude")),
    ("invalid generic resource", ("gpus_per_node",)),
    ("time limit", ("time_min",)),
    ("memory specification", ("mem_gb",)),
    ("memory required", ("mem_gb",)),
    ("cpu count per node", ("cpus_per_task", "tasks_per_node")),
    ("more processors requested", ("cpus_per_task", "tasks_per_node")),
    ("node count specification", ("nodes",)),
    ("job dependency problem", ("sbatch_extra.dependency",)),
    ("reservation", ("sbatch_extra.reservation",)),
    ("node configuration is not available", ("gpus_per_node", "nodelist", "exclude",
                                              "constraint", "mem_gb", "cpus_per_task",
                                              "tasks_per_node", "nodes")),
)
_FIXES = {
    "partition": "choose a partition `sinfo -s` lists, or leave cluster.partition unset for "
                 "the default one.",
    "account": "use an account of yours (`sacctmgr show assoc user=$USER "
               "format=account,partition`).",
    "qos": "use a QOS of yours (`sacctmgr show assoc user=$USER format=qos`).",
    "constraint": "ask for features the nodes have (`sinfo -o '%N %f'`).",
    "nodelist": "name nodes `sinfo -N` lists.",
    "exclude": "name nodes `sinfo -N` lists, and leave enough of the partition's nodes.",
    "gpus_per_node": "ask for at most the GPUs a node has (`sinfo -o '%P %G'`), or "
                     "cluster.gpus_per_node=0.",
    "time_min": "ask for at most the partition's time limit (`sinfo -o '%P %l'`).",
    "mem_gb": "ask for at most a node's memory (`sinfo -o '%P %m'`, in MB), or "
              "cluster.mem_gb=null.",
    "cpus_per_task": "ask for at most a node's CPUs (`sinfo -o '%P %c'`) in "
                     "cluster.tasks_per_node x cluster.cpus_per_task.",
    "nodes": "ask for at most the partition's node count (`sinfo -s`).",
}
_FIXES["tasks_per_node"] = _FIXES["cpus_per_task"]
_GENERIC_FIX = ("check partition, account, nodes and GPUs against `sinfo` (and "
                "cluster.sbatch_extra, if set); `dry_run=true` prints the script.")


def no_client(tool: str) -> UserError:
    return UserError("cluster.kind", "slurm", f"no Slurm here: {tool} is not on PATH.",
                     _NO_CLIENT_FIX)


def refusal(cfg: Config, exc: BaseException,
            environ: Mapping[str, str] | None = None) -> UserError | None:
    """The one-line UserError for a submission that sbatch refused or could not make
    (None: ``exc`` is not about the submission, let it through).

    When no controller answers ``scontrol ping`` that is the reason, whatever sbatch said;
    otherwise the message names the key behind sbatch's words and carries those words."""
    from submitit.core.utils import FailedJobError  # deferred: submitit; start-up: slurm.controller

    from hpc_ddp.slurm.controller import slurm_available

    environ = os.environ if environ is None else environ
    if isinstance(exc, FileNotFoundError) and "sbatch" in str(exc.filename or exc):
        return no_client("sbatch")
    if isinstance(exc, RuntimeError) and 'detect "srun"' in str(exc):
        # submitit builds a plain SlurmExecutor (which wants srun here) for job arrays.
        return no_client("srun")
    if not isinstance(exc, FailedJobError):
        return None
    stderr = str(exc)
    if not slurm_available(environ):
        return UserError("cluster.kind", "slurm",
                         f"no Slurm controller answers (scontrol ping); sbatch said: "
                         f"{sbatch_key_line(stderr).rstrip('.')}.",
                         _NO_CONTROLLER_FIX)
    said = sbatch_words(stderr)
    if "temporarily unavailable" in said.lower():  # EAGAIN: slurmctld takes no more jobs now
        return UserError("cluster", cfg.cluster.partition or "(default partition)",
                         f"sbatch refused the job: {said}.",
                         "the controller holds as many jobs as it takes (MaxJobCount in "
                         "`scontrol show config`; finished jobs count for MinJobAge seconds) "
                         "or is too busy: wait and submit again, or send fewer points at a "
                         "time.")
    key, value, fix, why = blamed(cfg, said, environ)
    return UserError(key, value, f"sbatch refused the job: {said}{why}.", fix)


def blamed(cfg: Config, said: str, environ: Mapping[str, str]
           ) -> tuple[str, Any, str, str]:
    """(key, value, fix, what sinfo adds) behind sbatch's words ``said``."""
    low = said.lower()
    option = re.search(r"unrecognized option '--([\w-]+)", said)
    if option and option.group(1) in cfg.cluster.sbatch_extra:
        name = option.group(1)
        return (f"cluster.sbatch_extra.{name}", cfg.cluster.sbatch_extra[name],
                "check that sbatch option (`sbatch --help`), or drop it.", "")
    for words, keys in _SAID:
        if words not in low:
            continue
        if words == "node configuration is not available":
            diagnosed = _diagnosed(cfg, environ)
            if diagnosed is not None:
                why = diagnosed.problem.removeprefix("can never start: ").rstrip(".")
                return diagnosed.key, diagnosed.value, diagnosed.fix, f" ({why})"
        key = next((k for k in keys if _is_set(cfg, k)), keys[0] if len(keys) == 1 else None)
        if key is not None:
            return _named(cfg, key), _value(cfg, key), _FIXES.get(key, _GENERIC_FIX), ""
        break
    return ("cluster", cfg.cluster.partition or "(default partition)", _GENERIC_FIX, "")


def _diagnosed(cfg: Config, environ: Mapping[str, str]) -> UserError | None:
    from hpc_ddp.slurm.fit import Request, partitions, problem  # deferred (start-up): slurm.fit

    parts = partitions(environ)
    return problem(Request.of(cfg, environ), parts) if parts else None


def _named(cfg: Config, key: str) -> str:
    return key if key == "nodes" else f"cluster.{key}"


def _value(cfg: Config, key: str) -> Any:
    if key == "nodes":
        return cfg.nodes
    if key.startswith("sbatch_extra."):
        return cfg.cluster.sbatch_extra.get(key.split(".", 1)[1], "")
    value = getattr(cfg.cluster, key)
    return "(default partition)" if key == "partition" and value is None else value


def _is_set(cfg: Config, key: str) -> bool:
    """Whether the user asked for something with ``key`` (a default is not to blame)."""
    c = cfg.cluster
    if key.startswith("sbatch_extra."):
        return key.split(".", 1)[1] in c.sbatch_extra
    if key == "nodes":
        return cfg.nodes > 1
    if key in ("cpus_per_task", "tasks_per_node"):
        return (getattr(c, key) or 1) > 1
    if key == "gpus_per_node":
        return bool(c.gpus_per_node)
    return getattr(c, key) is not None


def sbatch_words(stderr: str, limit: int = 300) -> str:
    """sbatch's error lines without their ``sbatch: error:`` prefix, joined with "; " (the
    specific one, e.g. "CPU count per node can not be satisfied", comes before the generic
    "Batch job submission failed: ...")."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [re.sub(r"^sbatch:\s*(error|fatal):\s*", "", line) for line in lines
              if re.match(r"^sbatch:\s*(error|fatal)", line) or "unrecognized option" in line]
    text = "; ".join(dict.fromkeys(e.removeprefix("sbatch: ") for e in errors)) or \
        sbatch_key_line(stderr, limit)
    return text.rstrip(".")[:limit]


def sbatch_key_line(stderr: str, limit: int = 300) -> str:
    """The line of sbatch's stderr that says why (``Batch job submission failed: ...`` or a
    fatal error), else its first error line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for marks in (("submission failed", "fatal"), ("error",)):
        for line in lines:
            if any(mark in line.lower() for mark in marks):
                return line[:limit]
    return (lines[0] if lines else "(no message)")[:limit]
