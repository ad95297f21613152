"""Whether a Slurm controller answers here: what ``cluster=auto`` and the sbatch error paths
ask before they send anything to Slurm."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping


def slurm_available(environ: Mapping[str, str]) -> bool:
    """A Slurm controller answers. ``sbatch`` on PATH alone is not enough: the Debian client
    installs it where no controller exists (docs/slurm.md); ``scontrol ping`` answers in ms
    (https://slurm.schedmd.com/scontrol.html#OPT_ping)."""
    path = environ.get("PATH", os.defpath)
    if not shutil.which("sbatch", path=path) or not shutil.which("scontrol", path=path):
        return False
    try:
        done = subprocess.run(["scontrol", "ping"], env=dict(environ), capture_output=True,
                              text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "UP" in done.stdout
