"""A local run's warm process kept for the next local run (cluster.warm_keep_s): when one may
serve another run, as a key that names its socket (client.py).

A kept warm process forks the ranks of later runs as it forked its first run's, so what it
holds from its start must be what a new one would hold: the same interpreter and flags, the
same files of hpc_ddp, torch and every folder on sys.path (a `pip install` or an edit changes
their times), the same environment less each launch's own variables (torch and its compiler
read theirs when imported), and the same user, groups, niceness, resource limits, namespaces
and cgroup (a fork inherits them). A run that differs in any of these gets a warm process of
its own. What each rank gets anew at its fork (its environment, folder, umask, CPU affinity,
streams and signals: forked.py) is not part of the key.

Only local runs: on Slurm no process outlives its job step, and each node's warm process
leaves with it. The folder of the sockets is this user's alone (client.folder), and every
connection is checked to come from this user (wire.same_user).
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import sys
from collections.abc import Mapping
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from hpc_ddp.rank.contract import LAUNCH_ID_ENV, WARM_KEEP_ENV

# A launch's own variables, which differ from run to run and are read after the fork, never
# at import: hpc_ddp's, submitit's (its local executor's job and task), pytest's (the test
# that started the run), torchrun's names for a rank and its rendezvous, and the shell's
# bookkeeping; and what a rank sets before its program starts (rank/join/joined.py): NCCL's
# and torch's NCCL settings and flight recorder, read when a process group is made
# (https://pytorch.org/docs/stable/torch_nccl_environment_variables.html), and cuBLAS's
# workspace, read at its first handle (a warm process never initialises CUDA); Gloo's
# interface, which rank/join/joined.py may set for a local run, read when a process group is
# made; and Inductor's cache folder, which torch sets in a process that used the cache and
# reads when it compiles
# (https://github.com/pytorch/pytorch/blob/main/torch/_inductor/runtime/cache_dir_utils.py).
_PER_LAUNCH_PREFIXES = ("HPC_DDP_", "SUBMITIT_", "PYTEST_", "TORCHELASTIC_", "NCCL_",
                        "TORCH_NCCL_", "TORCH_FR_")
_PER_LAUNCH = frozenset({
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK",
    "GROUP_RANK", "NODE_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "CUDA_VISIBLE_DEVICES",
    "CUBLAS_WORKSPACE_CONFIG", "GLOO_SOCKET_IFNAME", "TORCHINDUCTOR_CACHE_DIR", "PWD",
    "OLDPWD", "SHLVL", "_"})
_NAMESPACES = ("cgroup", "ipc", "mnt", "net", "pid", "user", "uts")


def keep_seconds(environ: Mapping[str, str]) -> float:
    """How long a local launch's warm process stays after its last rank (0: not kept: no
    keep asked for, or not a local launch)."""
    if not environ.get(LAUNCH_ID_ENV):
        return 0.0
    try:
        seconds = float(environ.get(WARM_KEEP_ENV, "0"))
    except ValueError:
        return 0.0
    return seconds if seconds > 0 and seconds == seconds else 0.0


def shared_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a kept warm process starts with: ``environ`` less each launch's own
    variables (no run's secrets or store keys stay in it)."""
    return {k: v for k, v in environ.items()
            if k not in _PER_LAUNCH and not k.startswith(_PER_LAUNCH_PREFIXES)}


def key(environ: Mapping[str, str]) -> str | None:
    """What a kept warm process serving this local launch is named by (None: not kept)."""
    keep = keep_seconds(environ)
    if not keep:
        return None
    facts = {"keep_s": keep, "environ": shared_environment(environ), **process_facts()}
    return "kept " + hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def process_facts() -> dict[str, Any]:
    """What of this process a fork of the warm process would inherit, or that decided what it
    imported."""
    limits = {name: resource.getrlimit(getattr(resource, name))
              for name in sorted(dir(resource)) if name.startswith("RLIMIT_")}
    namespaces: dict[str, str | None] = {}
    for name in _NAMESPACES:
        try:
            namespaces[name] = os.readlink(f"/proc/self/ns/{name}")
        except OSError:
            namespaces[name] = None
    try:
        cgroup = Path("/proc/self/cgroup").read_text()
    except OSError:
        cgroup = None
    return {"python": [sys.executable, sys.version, bool(sys.flags.safe_path)],
            "ids": [os.getuid(), os.geteuid(), os.getgid(), os.getegid(),
                    sorted(os.getgroups())],
            "nice": os.getpriority(os.PRIO_PROCESS, 0), "limits": limits,
            "namespaces": namespaces, "cgroup": cgroup, "files": files()}


def files() -> dict[str, Any]:
    """The times and sizes of hpc_ddp's own files, torch's entry files, and every folder on
    sys.path but the run's own (an install or removal there changes the folder's time)."""
    found: dict[str, Any] = {}
    ours = Path(__file__).resolve().parents[2]
    for path in sorted(ours.rglob("*.py")):
        found[str(path)] = _stamp(path)
    spec = find_spec("torch")
    if spec is not None and spec.origin:
        torch = Path(spec.origin).parent
        for name in ("__init__.py", "version.py"):
            found[str(torch / name)] = _stamp(torch / name)
    here = Path.cwd()
    for entry in sys.path:
        folder = Path(entry or ".")
        # The run's own folder by its name only: each run writes there (outputs/, logs), and
        # a fork puts its own folder first on sys.path anyway (forked.py).
        found[entry or "."] = None if folder.absolute() == here else _stamp(folder)
    return found


def _stamp(path: Path) -> list[int] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return [info.st_ino, info.st_mtime_ns, info.st_size]
