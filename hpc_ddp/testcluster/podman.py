"""Podman for the test cluster's container tests: a tiny root file system and a private
store under the state folder, made once and reused (no image, no registry, no build).

The root file system holds only empty folders, an /etc/passwd and the symlinks of a
merged-/usr Debian (lib -> usr/lib); the tests mount the host's /usr/lib and /usr/lib64
(libc, libstdc++ ...) and Python's installation read-only into it, and hpc_ddp mounts the
working directory (where .venv lives). There is no /usr/bin, /bin or /usr/sbin inside: no
shell, and none of Slurm's commands (scontrol, squeue, srun), as in an image without them.
What a run in it proves: every rank ran in its own mount namespace, started by real podman
under srun on its node, seeing the node's network and hostname, with Slurm's commands only
through the relay outside. What it does not: an image with its own Python and CUDA stack.

``containers.conf`` fits podman to this machine: runc (crun 1.8 refuses the hybrid cgroup
layout here), cgroupfs (no systemd), events to a file (no journald), and ulimits no higher
than the host's (the sandbox lacks CAP_SYS_RESOURCE, and podman's rootful default of 1048576
open files cannot be set). Clients point podman at it with CONTAINERS_CONF and
CONTAINERS_STORAGE_CONF (https://github.com/containers/common/blob/main/docs/containers.conf.5.md).
"""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REQUIRED = ("podman", "runc", "conmon")
APT_INSTALL = "sudo apt-get install -y podman runc"


@dataclass(frozen=True)
class PodmanSetup:
    rootfs: Path
    # CONTAINERS_CONF and CONTAINERS_STORAGE_CONF for the clients (sbatch passes them on).
    env: dict[str, str]
    # The host's libraries and Python, read-only ("SRC:DST:ro", cluster.container.mounts).
    mounts: list[str]


def missing() -> str | None:
    """Why podman cannot run here (with the fix), or None."""
    absent = [name for name in REQUIRED if shutil.which(name) is None]
    return f"missing {', '.join(absent)}: {APT_INSTALL}" if absent else None


def prepare(state_dir: Path, python_prefix: Path | None = None) -> PodmanSetup:
    """The root file system and podman's configuration under ``state_dir``/podman (made
    once; a second call only checks them)."""
    base = state_dir / "podman"
    rootfs = base / "rootfs"
    for sub in ("usr/lib", "usr/lib64", "tmp", "proc", "sys", "dev", "etc", "root", "run",
                "var/tmp"):
        (rootfs / sub).mkdir(parents=True, exist_ok=True)
    (rootfs / "tmp").chmod(0o1777)
    for link, target in (("lib", "usr/lib"), ("lib64", "usr/lib64")):
        if not (rootfs / link).is_symlink():
            (rootfs / link).symlink_to(target)
    (rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/root:/nonexistent\n")
    (rootfs / "etc" / "group").write_text("root:x:0:\n")
    storage = base / "storage.conf"
    storage.write_text(
        "[storage]\n"
        # vfs: no overlay on top of whatever /tmp is; with --rootfs no layers are unpacked.
        'driver = "vfs"\n'
        f'graphroot = "{base / "store"}"\n'
        f'runroot = "{base / "run"}"\n')
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
    conf = base / "containers.conf"
    conf.write_text(
        "[containers]\n"
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
        "[engine]\n"
        'runtime = "runc"\n'
        'cgroup_manager = "cgroupfs"\n'
        'events_logger = "file"\n'
        f'events_logfile_path = "{base / "events.log"}"\n')
    prefix = python_prefix or Path(sys.base_prefix)
    mounts = ["/usr/lib:/usr/lib:ro", f"{prefix}:{prefix}:ro"]
    if Path("/usr/lib64").is_dir():
        mounts.insert(1, "/usr/lib64:/usr/lib64:ro")
    return PodmanSetup(rootfs, {"CONTAINERS_CONF": str(conf),
                                "CONTAINERS_STORAGE_CONF": str(storage)}, mounts)


def leftover_containers(setup: PodmanSetup, env: dict[str, str]) -> list[str]:
    """Containers still in the private store (each test's `--rm` should leave none)."""

    done = subprocess.run(["podman", "ps", "-a", "-q"], env={**env, **setup.env},
                          capture_output=True, text=True, timeout=60, check=False)
    return done.stdout.split()
